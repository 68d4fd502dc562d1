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

``"wan_i2v"``: :class:`~diffusers.WanImageToVideoPipeline` with the components above, shaped like Wan 2.1 I2V-14B:
the transformer takes 36 input channels (16 noise, 4 first-frame mask, 16 condition latents), ``image_dim`` 32 and
``added_kv_proj_dim`` 64 (the image tokens' own key / value projections in ``attn2``); ``image_encoder`` a
``CLIPVisionModel`` (hidden 32, 2 layers, 32 px images in 8 px patches: 17 tokens; the pipeline reads the
second-to-last hidden state) with its ``CLIPImageProcessor`` at 32 px. Variants: ``"two_experts"`` (Wan 2.2 I2V-A14B:
no image encoder, two 36-channel experts, ``boundary_ratio`` 0.9) and ``"ti2v"`` (Wan 2.2 TI2V-5B's image
conditioning: ``expand_timesteps``, a 16-channel transformer whose first latent frame is the image's latents; the
real model's 48-channel 16x VAE is replaced by the tiny 16-channel one, which the pipeline treats alike).
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from .seeding import seeded_component
from .tiny_tokenizers import build_t5_tokenizer

__all__ = ["WAN_CONFIGS", "WAN_I2V_CONFIGS", "WAN_I2V_VARIANTS", "WAN_VARIANTS", "build_tiny_wan", "build_tiny_wan_i2v"]

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

#: Variants of the tiny Wan image-to-video pipeline besides the default (Wan 2.1 I2V, with an image encoder).
WAN_I2V_VARIANTS = ("two_experts", "ti2v")

_CLIP_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 32,
}
_CLIP_IMAGE_PROCESSOR = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
#: Wan 2.1 I2V: noise, mask (one channel per frame of the first latent group) and condition latents.
_WAN_I2V_TRANSFORMER = {**_WAN_TRANSFORMER, "in_channels": 16 + 4 + 16, "image_dim": _CLIP_VISION["hidden_size"],
                        "added_kv_proj_dim": _WAN_TRANSFORMER["num_attention_heads"]
                        * _WAN_TRANSFORMER["attention_head_dim"]}
_WAN_I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V-A14B's

#: Every architecture setting of the image-to-video builds (feeds the cache fingerprint).
WAN_I2V_CONFIGS = [_CLIP_VISION, _CLIP_IMAGE_PROCESSOR, _WAN_I2V_TRANSFORMER, {"boundary_ratio": _WAN_I2V_BOUNDARY_RATIO}]


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


def build_tiny_wan_i2v(seed: int, variant: str | None = None) -> WanImageToVideoPipeline:
    """The tiny ``WanImageToVideoPipeline`` (see the module docstring): Wan 2.1 I2V by default, ``"two_experts"`` Wan
    2.2 I2V-A14B, ``"ti2v"`` Wan 2.2 TI2V-5B's image conditioning."""
    if variant is not None and variant not in WAN_I2V_VARIANTS:
        raise ValueError(f"Unknown variant {variant!r} of the tiny wan_i2v pipeline; choose one of {WAN_I2V_VARIANTS}.")
    text_pipe = build_tiny_wan(seed)  # the same tokenizer, text encoder, VAE and scheduler as the tiny Wan T2V
    config = {k: v for k, v in _WAN_I2V_TRANSFORMER.items() if variant is None or k not in ("image_dim",
                                                                                            "added_kv_proj_dim")}
    if variant == "ti2v":
        config["in_channels"] = _WAN_VAE["z_dim"]
    with seeded_component(seed, 31):
        transformer = WanTransformer3DModel(**config).eval()
    extra: dict[str, Any] = {"image_encoder": None, "image_processor": None}
    if variant is None:
        with seeded_component(seed, 32):
            extra["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(**_CLIP_VISION)).eval()
        extra["image_processor"] = CLIPImageProcessor(**_CLIP_IMAGE_PROCESSOR)
    elif variant == "two_experts":
        with seeded_component(seed, 33):
            extra["transformer_2"] = WanTransformer3DModel(**config).eval()
        extra["boundary_ratio"] = _WAN_I2V_BOUNDARY_RATIO
    else:
        extra["expand_timesteps"] = True
    return WanImageToVideoPipeline(tokenizer=text_pipe.tokenizer, text_encoder=text_pipe.text_encoder,
                                   vae=text_pipe.vae, scheduler=text_pipe.scheduler, transformer=transformer, **extra)
