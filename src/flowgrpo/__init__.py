"""flowgrpo: online reinforcement learning for flow-matching image generators (Flow-GRPO and family).

    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import FlowGRPOConfig, FlowGRPOTrainer


def __getattr__(name: str):
    # Lazy: `import flowgrpo` stays cheap (no torch/diffusers import) until the trainer is used.
    if name in ("FlowGRPOConfig", "FlowGRPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")
