"""flowgrpo: online reinforcement learning for flow-matching image generators (Flow-GRPO and family).

    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
    from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer
    from flowgrpo import AWMConfig, AWMTrainer
    from flowgrpo import DiffusionDPOConfig, DiffusionDPOTrainer
    from flowgrpo import DGPOConfig, DGPOTrainer
    from flowgrpo import CRDConfig, CRDTrainer
    from flowgrpo import DiffusionOPDConfig, DiffusionOPDTrainer

Every trainer of the registry (``flowgrpo.trainer.registry.TRAINERS``) is exported with its configuration.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from .notices import quiet_library_notices as _quiet_library_notices  # standard library only

_quiet_library_notices()  # before any module of the package imports transformers, diffusers, peft, DeepSpeed

from .trainer.registry import lazy_exports as _lazy_exports  # noqa: E402  (a light module: no torch)

_TRAINER_NAMES = frozenset(_lazy_exports())

__all__ = sorted(_TRAINER_NAMES) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover  (the names __all__ lists, from the registry)
    from .trainer import (  # noqa: F401
        AWMConfig,
        AWMTrainer,
        CRDConfig,
        CRDTrainer,
        DGPOConfig,
        DGPOTrainer,
        DiffusionDPOConfig,
        DiffusionDPOTrainer,
        DiffusionNFTConfig,
        DiffusionNFTTrainer,
        DiffusionOPDConfig,
        DiffusionOPDTrainer,
        FlowGRPOConfig,
        FlowGRPOTrainer,
    )


def __getattr__(name: str):
    # Lazy: `import flowgrpo` stays cheap (no torch/diffusers import) until a trainer is used.
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")
