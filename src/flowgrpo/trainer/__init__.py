"""Trainers and their configuration. The names are those of the trainer registry (`registry.TRAINERS`); trainer
modules (transformers.Trainer, diffusers, peft) load on first use, so that parsing a recipe or printing ``--help``
only imports the configurations."""

from typing import TYPE_CHECKING

from .registry import lazy_exports

_LAZY = {**lazy_exports(), "OnlineRLConfig": "flowgrpo.trainer.online_config:OnlineRLConfig"}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover  (the names __all__ lists, from the registry)
    from .algorithms.awm_config import AWMConfig  # noqa: F401
    from .algorithms.awm_trainer import AWMTrainer  # noqa: F401
    from .algorithms.crd_config import CRDConfig  # noqa: F401
    from .algorithms.crd_trainer import CRDTrainer  # noqa: F401
    from .algorithms.dgpo_config import DGPOConfig  # noqa: F401
    from .algorithms.dgpo_trainer import DGPOTrainer  # noqa: F401
    from .algorithms.dpo_config import DiffusionDPOConfig  # noqa: F401
    from .algorithms.dpo_trainer import DiffusionDPOTrainer  # noqa: F401
    from .algorithms.flow_grpo_config import FlowGRPOConfig  # noqa: F401
    from .algorithms.flow_grpo_trainer import FlowGRPOTrainer  # noqa: F401
    from .algorithms.nft_config import DiffusionNFTConfig  # noqa: F401
    from .algorithms.nft_trainer import DiffusionNFTTrainer  # noqa: F401
    from .algorithms.opd_config import DiffusionOPDConfig  # noqa: F401
    from .algorithms.opd_trainer import DiffusionOPDTrainer  # noqa: F401
    from .online_config import OnlineRLConfig  # noqa: F401


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, _, attribute = _LAZY[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'flowgrpo.trainer' has no attribute {name!r}")
