"""A tiny random-weight HunyuanVideo 1.5 pipeline (:class:`~diffusers.HunyuanVideo15Pipeline`, text-to-video), built
offline.

* ``tokenizer`` the locally made Qwen tokenizer with a chat template
  (:func:`flowgrpo.testing.tiny_tokenizers.build_qwen3_tokenizer`); ``text_encoder`` ``Qwen2_5_VLTextModel``: width
  16, 2 layers (the pipeline reads the third-from-last hidden state), M-RoPE sections (1, 1, 2).
* ``tokenizer_2`` ``ByT5Tokenizer`` (bytes, no vocabulary file) and ``text_encoder_2`` a ``T5EncoderModel`` of width
  32 for the quoted glyph text of a prompt.
* ``transformer`` ``HunyuanVideo15Transformer3DModel`` (``task_type`` "t2v"): 1 block and 1 refiner block, 2 heads of
  8, 9 input channels (4 noise + 4 condition latents + 1 mask, the latter zero in text-to-video).
* ``vae`` ``AutoencoderKLHunyuanVideo15``: 4 latent channels, 4x in space, 2x in time (``num_frames = 2k + 1``).
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with ``shift`` 7; ``guider`` ``ClassifierFreeGuidance`` (its
  ``guidance_scale`` is the stock pipeline's guidance; the trainer uses its own ``guidance_scale``).
"""

from __future__ import annotations

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

from .seeding import seeded_component
from .tiny_tokenizers import build_qwen3_tokenizer

__all__ = ["HUNYUANVIDEO15_CONFIGS", "build_tiny_hunyuanvideo15"]

_QWEN25_VL_TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6}}
_BYT5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 4, "relative_attention_num_buckets": 8,
         "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu"}
_HV15_TRANSFORMER = {"in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
                     "num_layers": 1, "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 1, "patch_size_t": 1,
                     "text_embed_dim": 16, "text_embed_2_dim": 32, "image_embed_dim": 12, "rope_axes_dim": (2, 2, 4),
                     "target_size": 32, "task_type": "t2v"}
_HV15_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (16, 16),
             "layers_per_block": 1, "spatial_compression_ratio": 4, "temporal_compression_ratio": 2,
             "downsample_match_channel": False, "upsample_match_channel": False}
_HV15_SCHEDULER = {"shift": 7.0}

#: Every architecture setting (feeds the cache fingerprint).
HUNYUANVIDEO15_CONFIGS = [_QWEN25_VL_TEXT, _BYT5, _HV15_TRANSFORMER, _HV15_VAE, _HV15_SCHEDULER]


def build_tiny_hunyuanvideo15(seed: int) -> HunyuanVideo15Pipeline:
    """The tiny ``HunyuanVideo15Pipeline`` (see the module docstring)."""
    tokenizer = build_qwen3_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    text = dict(_QWEN25_VL_TEXT, rope_parameters=dict(_QWEN25_VL_TEXT["rope_parameters"]), vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id)
    with seeded_component(seed, 51):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**text)).eval()
    with seeded_component(seed, 52):
        text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), pad_token_id=tokenizer_2.pad_token_id,
                                                 eos_token_id=tokenizer_2.eos_token_id, **_BYT5)).eval()
    with seeded_component(seed, 53):
        transformer = HunyuanVideo15Transformer3DModel(**_HV15_TRANSFORMER).eval()
    with seeded_component(seed, 54):
        vae = AutoencoderKLHunyuanVideo15(**_HV15_VAE).eval()
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(**_HV15_SCHEDULER),
                                  text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                  guider=ClassifierFreeGuidance(guidance_scale=3.0))
