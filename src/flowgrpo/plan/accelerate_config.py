"""The parts of an accelerate config that set memory: the world size, DDP / FSDP2 / DeepSpeed ZeRO and their options."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Parallelism:
    """How the trained model is spread over the GPUs."""

    kind: str                            # "single" | "ddp" | "fsdp" | "zero2" | "zero3"
    world_size: int
    wrap_classes: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    offload_params: bool = False         # FSDP CPU offload / DeepSpeed offload_param_device
    offload_optimizer: bool = False      # DeepSpeed offload_optimizer_device
    mixed_precision: str = "bf16"
    source: str = "default"

    def with_world(self, world_size: int) -> Parallelism:
        kind = self.kind
        if kind == "single" and world_size > 1:
            kind = "ddp"
        return Parallelism(kind, world_size, self.wrap_classes, self.reshard_after_forward, self.offload_params,
                           self.offload_optimizer, self.mixed_precision, self.source)


def load_parallelism(path: str | None, num_processes: int | None = None) -> Parallelism:
    """Read ``path`` (an accelerate YAML config); ``None`` means one GPU. ``num_processes`` overrides its count."""
    import yaml

    if path is None:
        par = Parallelism("single", 1, source="one GPU (no --config_file)")
        return par.with_world(num_processes) if num_processes else par
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config_file {path!r}: no such file; the shipped configs are in accelerate_configs/.")
    raw = yaml.safe_load(file.read_text()) or {}
    world = int(num_processes or raw.get("num_processes", 1) or 1) * (1 if num_processes else
                                                                        int(raw.get("num_machines", 1) or 1))
    distributed = str(raw.get("distributed_type", "NO")).upper()
    mixed = str(raw.get("mixed_precision", "no"))
    if distributed == "FSDP":
        fsdp = raw.get("fsdp_config", {}) or {}
        classes = tuple(c.strip() for c in str(fsdp.get("fsdp_transformer_layer_cls_to_wrap", "")).split(",")
                        if c.strip())
        return Parallelism("fsdp", world, classes, bool(fsdp.get("fsdp_reshard_after_forward", True)),
                           bool(fsdp.get("fsdp_offload_params", False)), False, mixed, str(file))
    if distributed == "DEEPSPEED":
        ds = raw.get("deepspeed_config", {}) or {}
        stage = int(ds.get("zero_stage", 2))
        if stage not in (2, 3):
            raise ValueError(f"{path}: zero_stage={stage}; the planner knows ZeRO stages 2 and 3.")
        return Parallelism(f"zero{stage}", world, (), True, str(ds.get("offload_param_device", "none")) != "none",
                           str(ds.get("offload_optimizer_device", "none")) != "none", mixed, str(file))
    kind = "single" if world == 1 else "ddp"
    return Parallelism(kind, world, (), True, False, False, mixed, str(file))


def intended_config(recipe: str | Path) -> str | None:
    """The accelerate config a recipe's header names (``--config_file accelerate_configs/X.yaml``), if any."""
    text = Path(recipe).read_text()
    match = re.search(r"--config_file\s+(accelerate_configs/[\w.-]+\.yaml)", text)
    return match.group(1) if match else None


__all__ = ["Parallelism", "intended_config", "load_parallelism"]
