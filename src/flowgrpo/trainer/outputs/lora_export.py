"""LoRA export in diffusers' format.

Trainer's own save of a ``PeftModel`` writes ``adapter_model.safetensors``, which diffusers'
``pipe.load_lora_weights`` does not read. Users need ``pytorch_lora_weights.safetensors`` whose keys are
prefixed ``transformer.`` and whose metadata carries the LoRA config; the pipeline class's own
``save_lora_weights`` writes exactly that.

A pipeline with two experts (Wan 2.2 A14B: ``transformer`` for high noise, ``transformer_2`` for low noise) trains a
LoRA on each; each is written in the same format, to its own file (:data:`EXPERT_LORA_WEIGHTS_NAMES`), and loads with
the family's own loader::

    pipe.load_lora_weights(folder)                                         # transformer
    pipe.load_lora_weights(folder, weight_name="pytorch_lora_weights_transformer_2.safetensors",
                           load_into_transformer_2=True)                   # transformer_2
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
#: The LoRA file of each expert of a two-expert pipeline.
EXPERT_LORA_WEIGHTS_NAMES = {"transformer": LORA_WEIGHTS_NAME,
                             "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
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


def expert_names(peft_model: Any) -> tuple[str, ...] | None:
    """The experts of a two-expert trainable module (``("transformer", "transformer_2")``), else ``None``."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    names = getattr(base, "expert_names", None)
    return tuple(names) if names else None


def save_diffusers_lora(pipeline_cls: Any, save_directory: str | Path, peft_model: Any,
                        state_dict: dict[str, torch.Tensor] | None = None, adapter_name: str = "default") -> Path:
    """Write ``pytorch_lora_weights.safetensors`` loadable by ``pipeline_cls.load_lora_weights(save_directory)``.

    For two experts, also ``pytorch_lora_weights_transformer_2.safetensors`` (see the module docstring). Returns
    the path of the first file.
    """
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    layers = peft_lora_state_dict(peft_model, state_dict=state_dict, adapter_name=adapter_name)
    metadata = lora_adapter_metadata(peft_model, adapter_name)
    experts = expert_names(peft_model)
    parts = {None: layers} if experts is None else {
        name: {k[len(name) + 1:]: v for k, v in layers.items() if k.startswith(name + ".")} for name in experts}
    for name, part in parts.items():
        pipeline_cls.save_lora_weights(
            save_directory=str(save_directory), transformer_lora_layers=part,
            transformer_lora_adapter_metadata=metadata,
            weight_name=LORA_WEIGHTS_NAME if name is None else EXPERT_LORA_WEIGHTS_NAMES[name], safe_serialization=True,
        )
    return save_directory / LORA_WEIGHTS_NAME
