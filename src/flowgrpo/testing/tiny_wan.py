"""Tiny random-weight Wan text-to-video pipelines, built offline.

``"wan"``: :class:`~diffusers.WanPipeline` shaped like Wan 2.1 T2V

* ``text_encoder`` ``UMT5EncoderModel``: d_model 48, 2 layers, 3 heads of 16, gated-GELU FFN 64; ``tokenizer`` the
  locally trained T5 SentencePiece model (:func:`flowgrpo.testing.tiny_tokenizers.build_t5_tokenizer`), which serves
  as UMT5's.
* ``transformer`` ``WanTransformer3DModel``: 2 blocks, 4 heads of 16 (inner 64), patch (1, 2, 2), 16 latent
  channels, ``text_dim`` 48 (= the UMT5 width), FFN 96, RMS q/k norm across heads; attention modules ``attn1``
  (self) and ``attn2`` (cross), as in the real model.
* ``vae`` ``AutoencoderKLWan``: base width 8, 4 levels, temporal downsampling in the last two (4x in time, 8x in
  space: ``num_frames = 4k + 1``), 16 latent channels with per-channel ``latents_mean`` / ``latents_std``.
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with ``shift`` 3.0 (the 480p ``flow_shift``).

Variant ``"two_experts"`` (Wan 2.2 A14B layout): a second transformer ``transformer_2`` (its own weights, the
low-noise expert) and ``boundary_ratio`` 0.875.

Five 64 px frames of four videos with 10 steps and CFG take about a quarter of a second on one CPU core.
"""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from .seeding import seeded_component
from .tiny_tokenizers import build_t5_tokenizer

__all__ = ["WAN_CONFIGS", "WAN_VARIANTS", "build_tiny_wan"]

#: Variants of the tiny Wan pipeline besides the default (Wan 2.1 layout, one transformer).
WAN_VARIANTS = ("two_experts",)

_UMT5 = {
    "d_model": 48,
    "d_kv": 16,
    "num_heads": 3,
    "d_ff": 64,
    "num_layers": 2,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.0,
    "tie_word_embeddings": False,
}
_WAN_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": _UMT5["d_model"],
    "freq_dim": 32,
    "ffn_dim": 96,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 64,
}
_WAN_VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "latents_mean": [round(-0.7 + 0.09 * i, 4) for i in range(16)],
    "latents_std": [round(1.1 + 0.11 * i, 4) for i in range(16)],
}
_WAN_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_WAN_BOUNDARY_RATIO = 0.875

#: Every architecture setting (feeds the cache fingerprint).
WAN_CONFIGS = [_UMT5, _WAN_TRANSFORMER, _WAN_VAE, _WAN_SCHEDULER, {"boundary_ratio": _WAN_BOUNDARY_RATIO}]


def build_tiny_wan(seed: int, variant: str | None = None) -> WanPipeline:
    """The tiny ``WanPipeline`` (see the module docstring); ``variant="two_experts"`` adds Wan 2.2's second expert."""
    tokenizer = build_t5_tokenizer()
    with seeded_component(seed, 21):
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **_UMT5))
    with seeded_component(seed, 22):
        transformer = WanTransformer3DModel(**_WAN_TRANSFORMER)
    with seeded_component(seed, 23):
        vae = AutoencoderKLWan(**_WAN_VAE)
    extra: dict[str, Any] = {}
    if variant == "two_experts":
        with seeded_component(seed, 24):
            extra["transformer_2"] = WanTransformer3DModel(**_WAN_TRANSFORMER).eval()
        extra["boundary_ratio"] = _WAN_BOUNDARY_RATIO
    elif variant is not None:
        raise ValueError(f"Unknown variant {variant!r} of the tiny wan pipeline; choose one of {WAN_VARIANTS}.")
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler(**_WAN_SCHEDULER), transformer=transformer.eval(),
                       **extra)
