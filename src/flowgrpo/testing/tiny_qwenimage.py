"""Tiny random-weight Qwen-Image and Qwen-Image-Edit pipelines, built offline.

``"qwenimage"``: :class:`~diffusers.QwenImagePipeline`

* ``text_encoder`` ``Qwen2_5_VLForConditionalGeneration``: text model hidden 32, 2 layers, 2 heads of 16 (one
  key/value head), multimodal RoPE sections (2, 3, 3) (they sum to head_dim / 2); a vision tower of depth 1 (hidden
  16, patch 14, spatial merge 2, output 32 = the text width), always built by the class; ``tokenizer`` the locally
  learned Qwen2 BPE (:func:`flowgrpo.testing.tiny_tokenizers.build_qwen2_tokenizer`), whose template prefixes have
  exactly the 34 / 64 tokens the pipelines drop.
* ``transformer`` ``QwenImageTransformer2DModel``: 2 blocks, 4 heads of 16 (inner 64), RoPE axes (4, 6, 6),
  ``in_channels`` 64 (16 latent channels packed 2x2), ``joint_attention_dim`` 32, no guidance embedding (as the
  released models).
* ``vae`` ``AutoencoderKLQwenImage``: base width 8, 4 levels (scale factor 8 = 2 ** len(temperal_downsample)),
  16 latent channels with per-channel ``latents_mean`` / ``latents_std``.
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with the released checkpoints' exponential dynamic shift
  (base 0.5, max 0.9, sequence lengths 256..8192, ``shift_terminal`` 0.02).

``"qwenimage_edit"``: :class:`~diffusers.QwenImageEditPipeline`, the same components plus ``processor``, a
:class:`ImageOnlyQwen2VLProcessor` (the image processor of Qwen2-VL in its PIL backend and the tokenizer).
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor

# Pipelines saved with the processor below record this module in model_index.json; diffusers' loader looks the
# loadable base class up by name in this module's namespace, so ProcessorMixin must be importable from here.
from transformers.processing_utils import ProcessorMixin  # noqa: F401

from .seeding import seeded_component
from .tiny_tokenizers import build_qwen2_tokenizer

__all__ = ["ImageOnlyQwen2VLProcessor", "QWEN_CONFIGS", "build_tiny_qwenimage", "build_tiny_qwenimage_edit",
           "build_tiny_qwenimage_edit_plus"]


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for images only (no video processor).

    transformers 5 cannot construct (or load) the stock processor without torchvision: checking its video processor
    looks up a video-processor registry that only exists with torchvision. Image editing never uses video, so this
    processor has no video processor; everything else (the image token expansion, the tokenizer) is Qwen2-VL's.
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                         chat_template=chat_template, **kwargs)


_QWEN_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
}
_QWEN_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": _QWEN_TEXT["hidden_size"],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [0],
}
_QWEN_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": _QWEN_TEXT["hidden_size"],
    "guidance_embeds": False,
    "axes_dims_rope": [4, 6, 6],
}
_QWEN_VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "latents_mean": [round(-0.75 + 0.1 * i, 4) for i in range(16)],
    "latents_std": [round(1.0 + 0.12 * i, 4) for i in range(16)],
}
_QWEN_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
_QWEN_IMAGE_PROCESSOR = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}

#: Every architecture setting of the two pipelines (feeds the cache fingerprint).
QWEN_CONFIGS = [_QWEN_TEXT, _QWEN_VISION, _QWEN_TRANSFORMER, _QWEN_VAE, _QWEN_SCHEDULER, _QWEN_IMAGE_PROCESSOR]


def build_qwen25_vl_text_encoder(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    text = dict(_QWEN_TEXT, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    text["rope_parameters"] = dict(_QWEN_TEXT["rope_parameters"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(_QWEN_VISION),
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config)


def _components(seed: int) -> dict[str, Any]:
    tokenizer = build_qwen2_tokenizer()
    with seeded_component(seed, 11):
        text_encoder = build_qwen25_vl_text_encoder(tokenizer)
    with seeded_component(seed, 12):
        transformer = QwenImageTransformer2DModel(**_QWEN_TRANSFORMER)
    with seeded_component(seed, 13):
        vae = AutoencoderKLQwenImage(**_QWEN_VAE)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**_QWEN_SCHEDULER),
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
        "tokenizer": tokenizer,
        "transformer": transformer.eval(),
    }


def build_tiny_qwenimage(seed: int) -> QwenImagePipeline:
    """The tiny ``QwenImagePipeline`` (see the module docstring)."""
    return QwenImagePipeline(**_components(seed))


def _edit_components(seed: int) -> dict[str, Any]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    components = _components(seed)
    components["processor"] = ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**_QWEN_IMAGE_PROCESSOR), tokenizer=components["tokenizer"])
    return components


def build_tiny_qwenimage_edit(seed: int) -> QwenImageEditPipeline:
    """The tiny ``QwenImageEditPipeline``: the Qwen-Image components plus an image-only Qwen2-VL processor."""
    return QwenImageEditPipeline(**_edit_components(seed))


def build_tiny_qwenimage_edit_plus(seed: int) -> QwenImageEditPlusPipeline:
    """The tiny ``QwenImageEditPlusPipeline``: the components of the tiny ``QwenImageEditPipeline``."""
    return QwenImageEditPlusPipeline(**_edit_components(seed))
