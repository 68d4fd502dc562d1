"""A tiny random-weight Qwen3-VL in the layout of ``Qwen/Qwen3-VL-8B-Instruct``, GenEval2's judge, built offline (the
``geneval2`` reward's tests and its comparison with the official ``evaluation.py``).

The folder is written as the hub repository is, in the formats of transformers 4.57 (which GenEval2 names) that
transformers 5 reads too: ``config.json`` with ``text_config`` (``rope_scaling`` holding the interleaved multimodal
RoPE sections) and ``vision_config``, ``model.safetensors``, ``generation_config.json`` (sampling settings as the
Instruct model ships them, which greedy scoring must ignore), the locally learned Qwen2 tokenizer with a chat
template in Qwen3-VL's format (no default system turn; ``<|vision_start|><|image_pad|><|vision_end|>`` per image),
``chat_template.json``, ``preprocessor_config.json`` and ``video_preprocessor_config.json`` (16-pixel patches, 2 x 2
merge, mean and std 0.5; a 32 x 32 pixel lower bound so that small test images keep their size).

Sizes: text hidden 32, 2 layers, 2 heads of 16 (1 key-value head), RoPE sections (4, 2, 2) interleaved; vision
depth 1, width 16, a 4 x 4 learned position grid, DeepStack from block 0, merged into 32.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["QWEN3_VL_CHAT_TEMPLATE", "cached_tiny_geneval2_path", "save_tiny_geneval2"]

_BUILD_REVISION = 1

#: Qwen3-VL's chat format for images and text: no default system turn, the vision tokens per image,
#: ``<|im_start|>assistant\n`` as the generation prompt.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
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

_TEXT = {"attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 32,
         "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 4096,
         "model_type": "qwen3_vl_text", "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1,
         "rms_norm_eps": 1e-6, "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2],
                                                "rope_type": "default"},
         "rope_theta": 5000000, "use_cache": True, "dtype": "float32"}
_VISION = {"deepstack_visual_indexes": [0], "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 16,
           "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 32, "model_type": "qwen3_vl",
           "num_heads": 2, "num_position_embeddings": 16, "out_hidden_size": 32, "patch_size": 16,
           "spatial_merge_size": 2, "temporal_patch_size": 2}
_IMAGE_PROCESSOR = {"size": {"longest_edge": 262144, "shortest_edge": 1024}, "patch_size": 16, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}
_VIDEO_PROCESSOR = {"size": {"longest_edge": 262144, "shortest_edge": 1024}, "patch_size": 16, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor"}
#: Sampling settings of the kind the Instruct model's generation_config.json holds (greedy scoring ignores them).
_GENERATION = {"do_sample": True, "top_k": 20, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.0}


def _tokenizer() -> Any:
    from .tiny_tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer


def _config(tokenizer: Any) -> dict[str, Any]:
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in
           ("<|endoftext|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    text = dict(_TEXT, vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "text_config": text,
            "vision_config": dict(_VISION), "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": False,
            "transformers_version": "4.57.0"}


def save_tiny_geneval2(output_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny Qwen3-VL judge (see the module docstring) to ``output_dir``; returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    from .seeding import seeded_component

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    config_json = _config(tokenizer)
    (output_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    config = AutoConfig.from_pretrained(output_dir)
    with seeded_component(seed, 61):
        model = Qwen3VLForConditionalGeneration(config).eval()
        # Larger output weights than the initialiser's, so that the answer probabilities differ between inputs.
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = config_json["text_config"]
    generation = dict(_GENERATION, bos_token_id=ids["bos_token_id"], pad_token_id=ids["bos_token_id"],
                      eos_token_id=[ids["eos_token_id"], ids["bos_token_id"]], transformers_version="4.57.0")
    (output_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(output_dir)
    (output_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_VL_CHAT_TEMPLATE}) + "\n")
    (output_dir / "preprocessor_config.json").write_text(json.dumps(_IMAGE_PROCESSOR, indent=2) + "\n")
    (output_dir / "video_preprocessor_config.json").write_text(json.dumps(_VIDEO_PROCESSOR, indent=2) + "\n")
    return output_dir


def _fingerprint(seed: int) -> str:
    import torch
    import transformers

    from .tiny_tokenizers import PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS

    spec = {"revision": _BUILD_REVISION, "seed": seed,
            "configs": [_TEXT, _VISION, _IMAGE_PROCESSOR, _VIDEO_PROCESSOR, _GENERATION, QWEN3_VL_CHAT_TEMPLATE],
            "tokenizer": [PROMPT_CORPUS, QWEN_NUM_MERGES, QWEN_SPECIAL_TOKENS],
            "versions": [torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def cached_tiny_geneval2_path(seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the tiny Qwen3-VL judge, built on first use (atomically, under a lock) in the tiny pipelines' cache
    and reused afterwards."""
    from ..build_cache import build_folder_once
    from .tiny_pipelines import default_tiny_cache_dir

    cache_dir = Path(cache_dir) if cache_dir is not None else default_tiny_cache_dir()
    target = cache_dir / f"geneval2-qwen3vl-seed{seed}-{_fingerprint(seed)}"
    return build_folder_once(target, lambda path: save_tiny_geneval2(path, seed), marker="config.json",
                             what="tiny GenEval2 judge cache folder")
