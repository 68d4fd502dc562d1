"""flowgrpo: online reinforcement learning for flow-matching image generators (Flow-GRPO and family).

    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
    from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer
    from flowgrpo import AWMConfig, AWMTrainer
    from flowgrpo import DiffusionDPOConfig, DiffusionDPOTrainer
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["AWMConfig", "AWMTrainer", "DiffusionDPOConfig", "DiffusionDPOTrainer", "DiffusionNFTConfig",
           "DiffusionNFTTrainer", "FlowGRPOConfig", "FlowGRPOTrainer", "__version__"]
_TRAINER_NAMES = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import (
        AWMConfig,
        AWMTrainer,
        DiffusionDPOConfig,
        DiffusionDPOTrainer,
        DiffusionNFTConfig,
        DiffusionNFTTrainer,
        FlowGRPOConfig,
        FlowGRPOTrainer,
    )


def __getattr__(name: str):
    # Lazy: `import flowgrpo` stays cheap (no torch/diffusers import) until a trainer is used.
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")
