"""Trainers and their configuration. The trainer modules (transformers.Trainer, diffusers, peft) load on first use,
so that parsing a recipe or printing ``--help`` only imports the configurations."""

from typing import TYPE_CHECKING

from .algorithms.flow_grpo_config import FlowGRPOConfig
from .algorithms.nft_config import DiffusionNFTConfig
from .online_config import OnlineRLConfig

__all__ = ["DiffusionNFTConfig", "DiffusionNFTTrainer", "FlowGRPOConfig", "FlowGRPOTrainer", "OnlineRLConfig"]

if TYPE_CHECKING:  # pragma: no cover
    from .algorithms.flow_grpo_trainer import FlowGRPOTrainer
    from .algorithms.nft_trainer import DiffusionNFTTrainer

_LAZY = {"FlowGRPOTrainer": ".algorithms.flow_grpo_trainer", "DiffusionNFTTrainer": ".algorithms.nft_trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'flowgrpo.trainer' has no attribute {name!r}")
