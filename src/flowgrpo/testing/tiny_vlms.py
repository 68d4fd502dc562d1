"""Tiny random-weight vision-language models for the VLM rewards' tests, built offline.

* ``"qwen2_5_vl"``: ``Qwen2_5_VLForConditionalGeneration`` with the architecture of the tiny Qwen-Image text encoder
  (:mod:`flowgrpo.testing.tiny_qwenimage`: text hidden 32, 2 layers, multimodal RoPE sections (2, 3, 3); a vision
  tower of depth 1, patch 14, spatial merge 2) and a ``Qwen2_5_VLProcessor`` (PIL image processor, the locally
  learned Qwen2 tokenizer, the Qwen2-VL chat template). The family of ``Qwen/Qwen2.5-VL-7B-Instruct`` and of the
  Qwen2.5-VL-based UnifiedReward checkpoints.
* ``"qwen2_vl"``: ``Qwen2VLForConditionalGeneration`` (the backbone of HPSv3): text hidden 32, 2 layers, 2 heads of
  16, RoPE sections (2, 3, 3); a Qwen2-VL vision tower of depth 1 (width 16, patch 14, spatial merge 2, output 32),
  with a ``Qwen2VLProcessor``.
* ``"qwen3_vl"``: ``Qwen3VLForConditionalGeneration`` (the family of the Qwen3-VL-based UnifiedReward 2.0
  checkpoints): text hidden 32, 2 layers, 2 heads of 16, interleaved RoPE sections (4, 2, 2); a Qwen3-VL vision
  tower of depth 1 (width 16, patch 16, spatial merge 2, a 4 x 4 learned position grid, DeepStack from block 0),
  with a ``Qwen3VLProcessor``. Its chat template is the Qwen2-VL one above (the format, not Qwen3-VL's wording).

Both are saved in one folder as on the hub (model, tokenizer, image-processor config) and load back with
``AutoModelForImageTextToText.from_pretrained`` and the processor loader of :mod:`flowgrpo.rewards.vlm_models`.
The processors have no video processor: transformers builds that one only with torchvision, which CPU-only
installs lack, and the rewards never score video.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["QWEN2_VL_CHAT_TEMPLATE", "TINY_VLM_KINDS", "build_tiny_vlm", "cached_tiny_vlm_path", "save_tiny_vlm"]

TINY_VLM_KINDS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")

_BUILD_REVISION = 1

#: The chat format of Qwen2-VL and Qwen2.5-VL: a default system turn, ``<|vision_start|><|image_pad|><|vision_end|>``
#: for each image part, and ``<|im_start|>assistant\n`` as the generation prompt.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QWEN2_VL_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
}
_QWEN2_VL_VISION = {
    "depth": 1,
    "embed_dim": 16,
    "hidden_size": 32,  # the merger's output width = the text width
    "mlp_ratio": 2,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_QWEN3_VL_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                        "mrope_interleaved": True},
}
_QWEN3_VL_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
_IMAGE_PROCESSOR = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
_QWEN3_IMAGE_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}


def _image_processor(kind: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**(_QWEN3_IMAGE_PROCESSOR if kind == "qwen3_vl" else _IMAGE_PROCESSOR))


def _tokenizer() -> Any:
    from .tiny_tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer: Any) -> dict[str, int]:
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")
    return {name: tokenizer.convert_tokens_to_ids(name) for name in names}


def _qwen_vl(tokenizer: Any, seed: int, generation: str) -> Any:
    """A tiny Qwen2-VL (``generation="2"``) or Qwen3-VL (``"3"``) with the tokenizer's special tokens."""
    import transformers

    from .seeding import seeded_component

    config_class = getattr(transformers, f"Qwen{generation}VLConfig")
    model_class = getattr(transformers, f"Qwen{generation}VLForConditionalGeneration")
    text_defaults, vision, salt = {"2": (_QWEN2_VL_TEXT, _QWEN2_VL_VISION, 31),
                                   "3": (_QWEN3_VL_TEXT, _QWEN3_VL_VISION, 33)}[generation]
    ids = _token_ids(tokenizer)
    text = dict(text_defaults, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    text["rope_parameters"] = dict(text_defaults["rope_parameters"])
    config = config_class(text_config=text, vision_config=dict(vision),
                          image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                          vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    with seeded_component(seed, salt):
        return model_class(config).eval()


def _qwen2_vl(tokenizer: Any, seed: int) -> Any:
    return _qwen_vl(tokenizer, seed, "2")


def _qwen3_vl(tokenizer: Any, seed: int) -> Any:
    return _qwen_vl(tokenizer, seed, "3")


def _qwen2_5_vl(tokenizer: Any, seed: int) -> Any:
    from .seeding import seeded_component
    from .tiny_qwenimage import build_qwen25_vl_text_encoder

    with seeded_component(seed, 32):
        return build_qwen25_vl_text_encoder(tokenizer).eval()


_PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                      "qwen3_vl": "Qwen3VLProcessor"}
_MODEL_BUILDERS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}


def build_tiny_vlm(kind: str = "qwen2_5_vl", seed: int = 0) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, image_processor)`` of the tiny ``kind`` (one of :data:`TINY_VLM_KINDS`), float32 on CPU.

    The tokenizer carries the Qwen2-VL chat template.
    """
    if kind not in TINY_VLM_KINDS:
        raise ValueError(f"unknown tiny VLM {kind!r}; choose one of {', '.join(TINY_VLM_KINDS)}")
    tokenizer = _tokenizer()
    return _MODEL_BUILDERS[kind](tokenizer, seed), tokenizer, _image_processor(kind)


def save_tiny_vlm(kind: str, output_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build the tiny ``kind`` VLM and save it as a hub repository holds one: the model, the tokenizer with its chat
    template, and ``preprocessor_config.json`` naming the processor class (``Qwen2VLProcessor`` /
    ``Qwen2_5_VLProcessor``)."""
    output_dir = Path(output_dir)
    model, tokenizer, image_processor = build_tiny_vlm(kind, seed)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    image_processor.save_pretrained(output_dir)
    config_file = output_dir / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["processor_class"] = _PROCESSOR_CLASSES[kind]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return output_dir


def _fingerprint(kind: str, seed: int) -> str:
    import torch
    import transformers

    from .tiny_qwenimage import QWEN_CONFIGS
    from .tiny_tokenizers import PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS

    spec = {
        "revision": _BUILD_REVISION, "kind": kind, "seed": seed,
        "configs": [_QWEN2_VL_TEXT, _QWEN2_VL_VISION, _QWEN3_VL_TEXT, _QWEN3_VL_VISION, _IMAGE_PROCESSOR,
                    _QWEN3_IMAGE_PROCESSOR, QWEN_CONFIGS, QWEN2_VL_CHAT_TEMPLATE],
        "tokenizer": [PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS],
        "versions": [torch.__version__, transformers.__version__],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def cached_tiny_vlm_path(kind: str = "qwen2_5_vl", seed: int = 0,
                         cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the saved tiny ``kind`` VLM, built on first use (atomically, under a lock) and reused afterwards.

    ``cache_dir`` defaults to the tiny pipelines' cache (``$FLOWGRPO_TINY_PIPELINE_CACHE`` or
    ``~/.cache/flowgrpo/tiny-pipelines``); the folder name carries a fingerprint of the architecture, the tokenizer's
    inputs and the library versions.
    """
    from ..build_cache import build_folder_once
    from .tiny_pipelines import default_tiny_cache_dir

    if kind not in TINY_VLM_KINDS:
        raise ValueError(f"unknown tiny VLM {kind!r}; choose one of {', '.join(TINY_VLM_KINDS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_tiny_cache_dir()
    target = cache_dir / f"vlm-{kind}-seed{seed}-{_fingerprint(kind, seed)}"
    return build_folder_once(target, lambda path: save_tiny_vlm(kind, path, seed), marker="config.json",
                             what="tiny VLM cache folder")
