"""A tiny random-weight VideoReward checkpoint in the official layouts, built offline (the ``videoalign`` reward's
tests and its comparison with the official code).

Two folders under the output folder:

* ``base/``: a tiny Qwen2-VL standing in for ``Qwen/Qwen2-VL-2B-Instruct``, written as that hub repository is (the
  transformers 4.45 formats, which transformers 5 reads too): ``config.json`` with the text settings at the top level
  and ``rope_scaling = {"type": "mrope", ...}``, ``model.safetensors`` in the 4.45 key layout (``model.layers.*``,
  ``visual.*``; tied embeddings as in the 2B model), the locally learned Qwen2 tokenizer with a Qwen2-VL chat template
  that renders images and videos, ``chat_template.json`` and ``preprocessor_config.json`` (``min_pixels`` /
  ``max_pixels``, CLIP mean and std, 14-pixel patches, 2 frames, 2 x 2 merge).
* ``videoreward/``: the ``KlingTeam/VideoReward`` layout: ``model_config.json`` (the official training script's four
  sections, ``prompt_template_type = "detailed_special"``, ``output_dim = 1``, LoRA r 8 / alpha 16 on every
  language-model linear layer, the published normalisation as ``inference_config``, ``Qwen/Qwen2-VL-2B-Instruct`` as
  ``model_name_or_path``: the tests pass ``base/`` as the reward's ``base_model_name_or_path``) and ``checkpoint-<step>/model.pth``: the state dict of the PEFT-wrapped reward model with
  the keys PEFT 0.10 gives it over transformers 4.45 (``base_model.model.model.layers.0.self_attn.q_proj.base_layer
  .weight``, ``....lora_A.default.weight``, ``base_model.model.visual.*``, ``base_model.model.rm_head.weight``, ...),
  with random non-zero LoRA factors; beside it the tokenizer with the three reward tokens, as the training run saved
  it.

The text model: hidden 32, 2 layers, 2 heads of 16 (1 key-value head), RoPE sections (2, 3, 3); the vision tower:
depth 1, width 16, 14-pixel patches, 2-frame temporal patches, merged 2 x 2 into 32.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["QWEN2_VL_VIDEO_CHAT_TEMPLATE", "TINY_VIDEOREWARD_STEP", "cached_tiny_videoreward_path",
           "save_tiny_videoreward"]

_BUILD_REVISION = 1
TINY_VIDEOREWARD_STEP = 42
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")

#: Qwen2-VL's chat format for images and videos: a default system turn, ``<|vision_start|><|image_pad|>
#: <|vision_end|>`` per image and ``<|vision_start|><|video_pad|><|vision_end|>`` per video, ``<|im_start|>assistant\n``
#: as the generation prompt.
QWEN2_VL_VIDEO_CHAT_TEMPLATE = (
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
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0, "use_sliding_window": False,
         "sliding_window": 32768, "max_window_layers": 2, "tie_word_embeddings": True, "use_cache": True}
_VISION = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "hidden_act": "quick_gelu", "mlp_ratio": 2, "num_heads": 2,
           "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
_MROPE_SECTION = [2, 3, 3]
_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                 "processor_class": "Qwen2VLProcessor"}
_LORA = {"r": 8, "alpha": 16}
#: The language-model linear layers the official script wraps with LoRA (every nn.Linear outside the excluded names).
LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def _tokenizer() -> Any:
    from .tiny_tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN2_VL_VIDEO_CHAT_TEMPLATE
    return tokenizer


def _base_config(tokenizer: Any) -> dict[str, Any]:
    """``config.json`` of the tiny base in the layout of ``Qwen/Qwen2-VL-2B-Instruct`` (transformers 4.45)."""
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in
           ("<|endoftext|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
            "<|video_pad|>")}
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", **_TEXT,
            "vocab_size": len(tokenizer), "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"], "vision_config": dict(_VISION),
            "rope_scaling": {"type": "mrope", "mrope_section": list(_MROPE_SECTION)}, "torch_dtype": "float32",
            "transformers_version": "4.45.2"}


def to_transformers_445_keys(state: dict[str, Any]) -> dict[str, Any]:
    """Transformers 5 Qwen2-VL keys in the 4.45 layout: ``model.language_model.*`` -> ``model.*``,
    ``model.visual.*`` -> ``visual.*``; other keys as they are."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        elif key.startswith("model.visual."):
            key = "visual." + key[len("model.visual."):]
        out[key] = value
    return out


def _peft_wrapped(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """The 4.45-layout ``state`` as PEFT 0.10 names the LoRA-wrapped reward model's state dict, with random LoRA
    factors (B not zero, so the merge matters)."""
    import torch

    from .seeding import seeded_component

    out: dict[str, Any] = {}
    with seeded_component(seed, 52):
        for key, value in state.items():
            module, _, leaf = key.rpartition(".")
            wrapped = key.startswith("model.layers.") and module.endswith(LORA_TARGETS)
            if not wrapped:
                out[f"base_model.model.{key}"] = value
                continue
            out[f"base_model.model.{module}.base_layer.{leaf}"] = value
            if leaf == "weight":
                rows, cols = value.shape
                out[f"base_model.model.{module}.lora_A.default.weight"] = torch.randn(_LORA["r"], cols) * 0.2
                out[f"base_model.model.{module}.lora_B.default.weight"] = torch.randn(rows, _LORA["r"]) * 0.2
    return out


def _model_config() -> dict[str, Any]:
    """``model_config.json`` as the official training script writes it (the four sections), naming the real base
    model as the released one does: pass the tiny ``base/`` folder as the reward's ``base_model_name_or_path``."""
    return {
        "data_config": {"meta_data": "train.csv", "data_dir": "videos", "meta_data_test": None,
                        "max_frame_pixels": 200704, "num_frames": None, "fps": 2.0, "p_shuffle_frames": 0.0,
                        "p_color_jitter": 0.0, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "add_noise": False, "sample_type": "uniform",
                        "use_tied_data": True},
        "training_args": {"output_dir": "videoreward", "bf16": False, "disable_flash_attn2": True},
        "model_config": {"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "model_revision": "main", "output_dim": 1,
                         "use_special_tokens": True, "freeze_vision_tower": False, "freeze_llm": False,
                         "tune_merger": True, "torch_dtype": "float32", "trust_remote_code": False,
                         "attn_implementation": None, "load_in_8bit": False, "load_in_4bit": False,
                         "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False, "reward_token": "special",
                         "loss_type": "btt"},
        "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": _LORA["r"],
                             "lora_alpha": _LORA["alpha"], "lora_dropout": 0.05, "lora_target_modules": None,
                             "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"],
                             "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
                             "num_lora_modules": -1},
        "inference_config": {"VQ_mean": 3.6757, "VQ_std": 2.2476, "MQ_mean": 1.1646, "MQ_std": 1.3811,
                             "TA_mean": 2.8105, "TA_std": 2.5121},
    }


def save_tiny_videoreward(output_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write ``base/`` and ``videoreward/`` (see the module docstring) under ``output_dir``; returns ``output_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from .seeding import seeded_component

    output_dir = Path(output_dir)
    base, reward = output_dir / "base", output_dir / "videoreward"
    base.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    (base / "config.json").write_text(json.dumps(_base_config(tokenizer), indent=2) + "\n")
    config = AutoConfig.from_pretrained(base)
    with seeded_component(seed, 51):
        model = Qwen2VLForConditionalGeneration(config).eval()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    base_state = to_transformers_445_keys(state)
    base_state.pop("lm_head.weight", None)  # tied to the embedding, as in Qwen2-VL-2B
    save_file(base_state, str(base / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(base)
    (base / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_VIDEO_CHAT_TEMPLATE}) + "\n")
    (base / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR, indent=2) + "\n")

    # The reward model: the base with three more tokens (embedding resized to len(tokenizer)) and its head.
    reward_tokenizer = _tokenizer()
    reward_tokenizer.add_special_tokens({"additional_special_tokens": list(REWARD_TOKENS)})
    rows = len(reward_tokenizer)
    with seeded_component(seed, 53):
        embed = base_state["model.embed_tokens.weight"]
        new_rows = torch.randn(rows - embed.shape[0], embed.shape[1]) * 0.02
        head = torch.randn(1, _TEXT["hidden_size"]) * 0.5
    full = dict(base_state)
    full["model.embed_tokens.weight"] = torch.cat([embed, new_rows])
    full["lm_head.weight"] = full["model.embed_tokens.weight"].clone()
    full["rm_head.weight"] = head
    checkpoint = reward / f"checkpoint-{TINY_VIDEOREWARD_STEP}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    torch.save(_peft_wrapped(full, seed), checkpoint / "model.pth")
    reward_tokenizer.save_pretrained(checkpoint)
    (reward / "model_config.json").write_text(json.dumps(_model_config(), indent=4) + "\n")
    return output_dir


def _fingerprint(seed: int) -> str:
    import torch
    import transformers

    from .tiny_tokenizers import PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS

    spec = {"revision": _BUILD_REVISION, "seed": seed, "configs": [_TEXT, _VISION, _MROPE_SECTION, _PREPROCESSOR,
                                                                   _LORA, QWEN2_VL_VIDEO_CHAT_TEMPLATE],
            "tokenizer": [PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS],
            "versions": [torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def cached_tiny_videoreward_path(seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder holding ``base/`` and ``videoreward/`` of the tiny checkpoint, built on first use (atomically, under a
    lock) in the tiny pipelines' cache and reused afterwards."""
    from ..build_cache import build_folder_once
    from .tiny_pipelines import default_tiny_cache_dir

    cache_dir = Path(cache_dir) if cache_dir is not None else default_tiny_cache_dir()
    target = cache_dir / f"videoreward-seed{seed}-{_fingerprint(seed)}"
    return build_folder_once(target, lambda path: save_tiny_videoreward(path, seed),
                             marker="videoreward/model_config.json", what="tiny VideoReward cache folder")
