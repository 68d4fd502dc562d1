"""Tiny random-weight Qwen-Image 2.1 pipeline, built offline.

``"qwenimage21"``: :class:`~diffusers.QwenImage21Pipeline`

* ``text_encoder`` ``Qwen3VLForConditionalGeneration``: text model hidden 32, 2 layers, 2 heads of 16 (one key/value
  head), multimodal RoPE sections (2, 3, 3); a vision tower of depth 1 (hidden 16, patch 16, spatial merge 2, output
  32 = the text width), always built by the class.
* ``processor`` :class:`ImageOnlyQwen3VLProcessor` (Qwen3-VL's processor without its video processor, which
  transformers 5 cannot build without torchvision) over the locally learned Qwen2 BPE
  (:func:`flowgrpo.testing.tiny_tokenizers.build_qwen2_tokenizer`) with a chat template in Qwen3-VL's layout; the
  pipeline drops as many leading hidden states as the template's system turn has tokens.
* ``transformer`` ``QwenImage21Transformer2DModel``: 2 single-stream blocks, 4 heads of 16 (inner 64), RoPE axes
  (4, 6, 6), 16 latent channels consumed unpatched, ``context_in_dim`` 32, block-causal attention with
  ``causal_condition``.
* ``vae`` ``AutoencoderKLQwenImage21``: base width 8, 5 levels (16x spatial), 16 latent channels with per-channel
  ``latents_mean`` / ``latents_std``, RGBA in and out (as the released VAE).
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with a dynamic exponential shift; the pipeline's config carries
  ``sample_sigmas``, the author's sampling grid: ``(1.0, 0.8, 0.5)`` (3 steps).
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

# Pipelines saved with the processor below record this module in model_index.json; diffusers' loader looks the
# loadable base class up by name in this module's namespace, so ProcessorMixin must be importable from here.
from transformers.processing_utils import ProcessorMixin  # noqa: F401

from .seeding import seeded_component
from .tiny_tokenizers import build_qwen2_tokenizer

__all__ = ["ImageOnlyQwen3VLProcessor", "QWEN21_CONFIGS", "QWEN3_VL_CHAT_TEMPLATE", "build_tiny_qwenimage21"]

#: Qwen3-VL's chat layout for text and image messages (content as a string or a list of typed parts).
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _image_only_processor_class():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """``Qwen3VLProcessor`` for images only (no video processor: transformers 5 cannot construct or load one
        without torchvision). Qwen-Image 2.1 never passes video; the image token expansion and the tokenizer are
        Qwen3-VL's."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

    ImageOnlyQwen3VLProcessor.__module__ = __name__
    return ImageOnlyQwen3VLProcessor


ImageOnlyQwen3VLProcessor = _image_only_processor_class()

_QWEN3_VL_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                        "rope_theta": 5000000.0},
}
_QWEN3_VL_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": _QWEN3_VL_TEXT["hidden_size"],
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0],
}
_QWEN21_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "context_in_dim": _QWEN3_VL_TEXT["hidden_size"],
    "mlp_ratio": 3,
    "axes_dims_rope": [4, 6, 6],
    "causal_condition": True,
}
_QWEN21_VAE = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True],
    "latents_mean": [round(-0.4 + 0.05 * i, 4) for i in range(16)],
    "latents_std": [round(0.8 + 0.1 * i, 4) for i in range(16)],
}
_QWEN21_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "time_shift_type": "exponential",
}
_QWEN21_SAMPLE_SIGMAS = [1.0, 0.8, 0.5]
_QWEN3_VL_IMAGE_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}

#: Every architecture setting of the pipeline (feeds the cache fingerprint).
QWEN21_CONFIGS = [_QWEN3_VL_TEXT, _QWEN3_VL_VISION, _QWEN21_TRANSFORMER, _QWEN21_VAE, _QWEN21_SCHEDULER,
                  _QWEN21_SAMPLE_SIGMAS, _QWEN3_VL_IMAGE_PROCESSOR, QWEN3_VL_CHAT_TEMPLATE]


def _text_encoder(tokenizer) -> Qwen3VLForConditionalGeneration:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    text = dict(_QWEN3_VL_TEXT, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], rope_parameters=dict(_QWEN3_VL_TEXT["rope_parameters"]))
    config = Qwen3VLConfig(text_config=text, vision_config=dict(_QWEN3_VL_VISION),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return Qwen3VLForConditionalGeneration(config)


def build_tiny_qwenimage21(seed: int) -> QwenImage21Pipeline:
    """The tiny ``QwenImage21Pipeline`` (see the module docstring)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    processor = ImageOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(**_QWEN3_VL_IMAGE_PROCESSOR),
                                          tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    with seeded_component(seed, 41):
        text_encoder = _text_encoder(tokenizer)
    with seeded_component(seed, 42):
        transformer = QwenImage21Transformer2DModel(**_QWEN21_TRANSFORMER)
    with seeded_component(seed, 43):
        vae = AutoencoderKLQwenImage21(**_QWEN21_VAE)
    return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**_QWEN21_SCHEDULER), vae=vae.eval(),
                               text_encoder=text_encoder.eval(), processor=processor, transformer=transformer.eval(),
                               sample_sigmas=list(_QWEN21_SAMPLE_SIGMAS))
