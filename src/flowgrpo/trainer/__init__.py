"""Trainers and their configuration. The trainer module (transformers.Trainer, diffusers, peft) loads on first use,
so that parsing a recipe or printing ``--help`` only imports the configuration."""

from typing import TYPE_CHECKING

from .config import FlowGRPOConfig

__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer"]

if TYPE_CHECKING:  # pragma: no cover
    from .flow_grpo_trainer import FlowGRPOTrainer


def __getattr__(name: str):
    if name == "FlowGRPOTrainer":
        from .flow_grpo_trainer import FlowGRPOTrainer

        return FlowGRPOTrainer
    raise AttributeError(f"module 'flowgrpo.trainer' has no attribute {name!r}")
