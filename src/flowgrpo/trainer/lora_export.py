"""LoRA export in diffusers' format.

Trainer's own save of a ``PeftModel`` writes ``adapter_model.safetensors``, which diffusers'
``pipe.load_lora_weights`` does not read. Users need ``pytorch_lora_weights.safetensors`` whose keys are
prefixed ``transformer.`` and whose metadata carries the LoRA config; the pipeline class's own
``save_lora_weights`` writes exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_lora_state_dict(peft_model: Any, state_dict: dict[str, torch.Tensor] | None = None,
                         adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """LoRA tensors of ``peft_model`` keyed like the bare diffusers transformer (``blocks.0.attn.to_q.lora_A.weight``).

    ``state_dict`` may be a full (e.g. FSDP-gathered) state dict of the PeftModel; by default the live weights.
    """
    from peft import get_peft_model_state_dict

    lora = get_peft_model_state_dict(peft_model, state_dict=state_dict, adapter_name=adapter_name)
    out = {}
    for key, tensor in lora.items():
        key = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        out[key] = tensor.detach().to("cpu", torch.float32).contiguous()
    return out


def lora_adapter_metadata(peft_model: Any, adapter_name: str = "default") -> dict:
    """The LoRA config as plain JSON types (sets become sorted lists)."""
    config = peft_model.peft_config[adapter_name].to_dict()

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    config = plain(config)
    json.dumps(config)  # fail here, not inside safetensors, if something is not serialisable
    return config


def save_diffusers_lora(pipeline_cls: Any, save_directory: str | Path, peft_model: Any,
                        state_dict: dict[str, torch.Tensor] | None = None, adapter_name: str = "default") -> Path:
    """Write ``pytorch_lora_weights.safetensors`` loadable by ``pipeline_cls.load_lora_weights(save_directory)``."""
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    layers = peft_lora_state_dict(peft_model, state_dict=state_dict, adapter_name=adapter_name)
    pipeline_cls.save_lora_weights(
        save_directory=str(save_directory), transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=lora_adapter_metadata(peft_model, adapter_name),
        weight_name=LORA_WEIGHTS_NAME, safe_serialization=True,
    )
    return save_directory / LORA_WEIGHTS_NAME
