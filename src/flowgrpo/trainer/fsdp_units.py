"""FSDP2 wrapping units shared by several families: one accelerate config may name the block classes of several
model families (``accelerate_configs/fsdp8_video.yaml``: Wan, LTX-2 and HunyuanVideo 1.5), while accelerate refuses a
class name that the model being wrapped does not contain. The trainer keeps the names present in its model."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keep_present_wrap_classes"]


def keep_present_wrap_classes(plugin: Any, model: torch.nn.Module) -> list[str]:
    """Drop from ``plugin.transformer_cls_names_to_wrap`` (an accelerate ``FullyShardedDataParallelPlugin``) the class
    names no submodule of ``model`` has; returns the names kept. A config that names none of the model's classes
    raises, naming the classes it has, so a wrong config never silently shards nothing."""
    names = list(getattr(plugin, "transformer_cls_names_to_wrap", None) or [])
    if not names:
        return names
    present = {type(m).__name__ for m in model.modules()}
    kept = [n for n in names if n in present]
    if not kept:
        blocks = sorted(n for n in present if n.endswith(("Block", "Model")))
        raise ValueError(f"The FSDP config wraps {names}, none of which is in this model; name its block classes "
                         f"(fsdp_transformer_layer_cls_to_wrap), e.g. from {blocks}.")
    plugin.transformer_cls_names_to_wrap = kept
    return kept
