"""Tiny random-weight FLUX.2 [klein] and Z-Image pipelines, built offline (both read a Qwen3 language model).

``"flux2_klein"``: :class:`~diffusers.Flux2KleinPipeline`, shaped like FLUX.2 [klein] base (4B / 9B)

* ``text_encoder`` ``Qwen3ForCausalLM``: hidden 24, 28 layers (the pipeline stacks the hidden states after layers 9,
  18 and 27, as it does for the real 36-layer encoder), 2 heads of 12 (one key/value head); ``tokenizer`` the locally
  learned Qwen2 BPE with Qwen3's chat template (:func:`flowgrpo.testing.tiny_tokenizers.build_qwen3_tokenizer`).
* ``transformer`` ``Flux2Transformer2DModel``: 1 double-stream and 1 single-stream block, 4 heads of 16 (inner 64),
  RoPE axes (4, 4, 4, 4) over the 4-D (T, H, W, L) position ids, ``in_channels`` 32 (8 latent channels patchified
  2x2), ``joint_attention_dim`` 72 (= 3 x the text width), no guidance embedding (klein).
* ``vae`` ``AutoencoderKLFlux2``: 4 levels (8, 16, 16, 16 channels: scale factor 8), 8 latent channels, and a batch
  norm over the 2x2-patchified latents whose running statistics are set to non-trivial values (the pipelines
  normalise with them).
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting; the pipeline's ``mu`` comes from
  ``compute_empirical_mu(sequence length, steps)``.

``"flux2"``: :class:`~diffusers.Flux2Pipeline`, shaped like FLUX.2 [dev]

* ``text_encoder`` ``Mistral3ForConditionalGeneration``: a Mistral text model of hidden 24 and 31 layers (the pipeline
  stacks the hidden states after layers 10, 20 and 30), 2 heads of 12 (one key/value head), and a Pixtral vision tower
  of one layer (hidden 16, patch 16), always built by the class; ``tokenizer`` the locally learned byte-level BPE
  with Mistral's special tokens and chat layout (:func:`flowgrpo.testing.tiny_tokenizers.build_mistral_tokenizer`).
  The real checkpoint's ``tokenizer`` is a ``PixtralProcessor``, which transformers 5 cannot import without
  torchvision; the pipeline only renders and tokenises text with it (``apply_chat_template(..., tokenize=True,
  return_dict=True)``; reference images go to the VAE), which a tokenizer with the chat template does the same way. FLUX.2 [dev]'s system message takes about 60
  of these tokens: use ``max_sequence_length`` 96 or more, or the prompt is cut off.
* ``transformer``, ``vae``, ``scheduler`` as for [klein], with the guidance embedding (FLUX.2 [dev] is
  guidance-distilled).

Variant ``"distilled"`` of ``"flux2_klein"``: the same components with ``is_distilled=True`` (FLUX.2 [klein] 4B / 9B, the step-distilled
releases: no CFG).

``"zimage"``: :class:`~diffusers.ZImagePipeline`, shaped like Z-Image (Turbo)

* ``text_encoder`` ``Qwen3Model``: hidden 40, 3 layers (the pipeline reads the second-to-last hidden state), 2 heads
  of 20; ``tokenizer`` as above.
* ``transformer`` ``ZImageTransformer2DModel``: single-stream, 1 noise-refiner, 1 context-refiner and 1 main block,
  dim 64, 4 heads of 16, RoPE axes (4, 6, 6), patch 2, 16 latent channels, ``cap_feat_dim`` 40 (= the text width).
* ``vae`` ``AutoencoderKL`` as the tiny FLUX.1 one (FLUX.1's scaling 0.3611 and shift 0.1159).
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with Z-Image Turbo's static ``shift`` 3.0.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from .seeding import seeded_component
from .tiny_tokenizers import build_mistral_tokenizer, build_qwen3_tokenizer

__all__ = ["FLUX2_CONFIGS", "FLUX2_KLEIN_VARIANTS", "ZIMAGE_CONFIGS", "build_tiny_flux2", "build_tiny_flux2_klein",
           "build_tiny_zimage"]

#: Variants of the tiny FLUX.2 [klein] pipeline besides the default (base: CFG with the empty prompt).
FLUX2_KLEIN_VARIANTS = ("distilled",)

_KLEIN_TEXT = {
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 28,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
_FLUX2_VAE = {
    "block_out_channels": [8, 16, 16, 16],
    "layers_per_block": 1,
    "latent_channels": 8,
    "norm_num_groups": 4,
    "sample_size": 64,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
}
_KLEIN_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 4 * _FLUX2_VAE["latent_channels"],
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 3 * _KLEIN_TEXT["hidden_size"],
    "timestep_guidance_channels": 32,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [4, 4, 4, 4],
    "guidance_embeds": False,
}
_FLUX2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}
_MISTRAL_TEXT = {
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 31,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "max_position_embeddings": 1024,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
_PIXTRAL_VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 8,
    "image_size": 64,
    "patch_size": 16,
}
_DEV_TRANSFORMER = {**_KLEIN_TRANSFORMER, "joint_attention_dim": 3 * _MISTRAL_TEXT["hidden_size"],
                    "guidance_embeds": True}
_ZIMAGE_TEXT = {
    "hidden_size": 40,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 20,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
_ZIMAGE_TRANSFORMER = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 64,
    "n_layers": 1,
    "n_refiner_layers": 1,
    "n_heads": 4,
    "n_kv_heads": 4,
    "cap_feat_dim": _ZIMAGE_TEXT["hidden_size"],
    "axes_dims": [4, 6, 6],
    "axes_lens": [256, 64, 64],
}
_ZIMAGE_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 16, 16, 16],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 64,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
}
_ZIMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

#: Every architecture setting of the FLUX.2 pipelines (feeds the cache fingerprint).
FLUX2_CONFIGS = [_KLEIN_TEXT, _FLUX2_VAE, _KLEIN_TRANSFORMER, _FLUX2_SCHEDULER, _MISTRAL_TEXT, _PIXTRAL_VISION,
                 _DEV_TRANSFORMER]
#: Every architecture setting of the Z-Image pipeline (feeds the cache fingerprint).
ZIMAGE_CONFIGS = [_ZIMAGE_TEXT, _ZIMAGE_TRANSFORMER, _ZIMAGE_VAE, _ZIMAGE_SCHEDULER]


def _qwen3_config(arch: dict[str, Any], tokenizer) -> Qwen3Config:
    return Qwen3Config(**{**arch, "rope_parameters": dict(arch["rope_parameters"])}, vocab_size=len(tokenizer),
                       pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None)


def _flux2_vae(seed: int) -> AutoencoderKLFlux2:
    with seeded_component(seed, 22):
        vae = AutoencoderKLFlux2(**_FLUX2_VAE)
        channels = vae.bn.running_mean.numel()
        # Running statistics of the patchified latents, as a trained VAE has them (the pipelines undo them).
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    return vae.eval()


def build_tiny_flux2_klein(seed: int, variant: str | None = None) -> Flux2KleinPipeline:
    """The tiny ``Flux2KleinPipeline`` (see the module docstring); ``variant="distilled"`` sets ``is_distilled``."""
    tokenizer = build_qwen3_tokenizer()
    with seeded_component(seed, 21):
        text_encoder = Qwen3ForCausalLM(_qwen3_config(_KLEIN_TEXT, tokenizer))
    with seeded_component(seed, 23):
        transformer = Flux2Transformer2DModel(**_KLEIN_TRANSFORMER)
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX2_SCHEDULER), vae=_flux2_vae(seed),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(),
        is_distilled=variant == "distilled",
    )


def build_tiny_flux2(seed: int) -> Flux2Pipeline:
    """The tiny ``Flux2Pipeline`` (FLUX.2 [dev], see the module docstring)."""
    tokenizer = build_mistral_tokenizer()
    config = Mistral3Config(
        text_config={"model_type": "mistral", **_MISTRAL_TEXT, "vocab_size": len(tokenizer),
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "pixtral", **_PIXTRAL_VISION}, spatial_merge_size=1,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    with seeded_component(seed, 24):
        text_encoder = Mistral3ForConditionalGeneration(config)
    with seeded_component(seed, 25):
        transformer = Flux2Transformer2DModel(**_DEV_TRANSFORMER)
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX2_SCHEDULER), vae=_flux2_vae(seed),
                         text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval())


def build_tiny_zimage(seed: int) -> ZImagePipeline:
    """The tiny ``ZImagePipeline`` (see the module docstring)."""
    tokenizer = build_qwen3_tokenizer()
    with seeded_component(seed, 31):
        text_encoder = Qwen3Model(_qwen3_config(_ZIMAGE_TEXT, tokenizer))
    with seeded_component(seed, 32):
        transformer = ZImageTransformer2DModel(**_ZIMAGE_TRANSFORMER)
    with seeded_component(seed, 33):
        vae = AutoencoderKL(**_ZIMAGE_VAE)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**_ZIMAGE_SCHEDULER), vae=vae.eval(),
                          text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval())
