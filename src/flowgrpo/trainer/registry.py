"""The trainers a recipe can name (``trainer: flow_grpo | diffusion_nft | awm | diffusion_dpo | dgpo | crd |
diffusion_opd``), each with its configuration class: the one table that the command line, the toy world and the
package's lazy exports read.

Configurations import cheaply (for ``--help`` and recipe checks); trainer classes load on first use. Adding an
algorithm is one `TrainerSpec` here (docs/architecture.md, "How to add an algorithm").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["DEFAULT_TRAINER", "TRAINERS", "TrainerSpec", "check_trainer_name", "config_class", "lazy_exports",
           "trainer_class"]


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer: its recipe name, and its configuration and trainer classes as ``"module:Class"`` paths."""

    name: str
    config: str
    trainer: str

    @property
    def config_name(self) -> str:
        return self.config.partition(":")[2]

    @property
    def trainer_name(self) -> str:
        return self.trainer.partition(":")[2]


_ALGORITHMS = "flowgrpo.trainer.algorithms"
#: name -> spec, in the order the documentation lists them
TRAINERS: dict[str, TrainerSpec] = {spec.name: spec for spec in (
    TrainerSpec("flow_grpo", f"{_ALGORITHMS}.flow_grpo_config:FlowGRPOConfig",
                f"{_ALGORITHMS}.flow_grpo_trainer:FlowGRPOTrainer"),
    TrainerSpec("diffusion_nft", f"{_ALGORITHMS}.nft_config:DiffusionNFTConfig",
                f"{_ALGORITHMS}.nft_trainer:DiffusionNFTTrainer"),
    TrainerSpec("awm", f"{_ALGORITHMS}.awm_config:AWMConfig", f"{_ALGORITHMS}.awm_trainer:AWMTrainer"),
    TrainerSpec("diffusion_dpo", f"{_ALGORITHMS}.dpo_config:DiffusionDPOConfig",
                f"{_ALGORITHMS}.dpo_trainer:DiffusionDPOTrainer"),
    TrainerSpec("dgpo", f"{_ALGORITHMS}.dgpo_config:DGPOConfig", f"{_ALGORITHMS}.dgpo_trainer:DGPOTrainer"),
    TrainerSpec("crd", f"{_ALGORITHMS}.crd_config:CRDConfig", f"{_ALGORITHMS}.crd_trainer:CRDTrainer"),
    TrainerSpec("diffusion_opd", f"{_ALGORITHMS}.opd_config:DiffusionOPDConfig",
                f"{_ALGORITHMS}.opd_trainer:DiffusionOPDTrainer"),
)}
DEFAULT_TRAINER = "flow_grpo"


def check_trainer_name(name: str) -> str:
    if name not in TRAINERS:
        raise ValueError(f"trainer={name!r} is not a trainer; choose one of {', '.join(map(repr, TRAINERS))}.")
    return name


def _load(path: str):
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def config_class(name: str) -> type:
    """The configuration class of trainer ``name`` (e.g. ``DiffusionNFTConfig`` for ``"diffusion_nft"``)."""
    return _load(TRAINERS[check_trainer_name(name)].config)


def trainer_class(name: str) -> type:
    """The trainer class of ``name`` (imports transformers, diffusers and peft)."""
    return _load(TRAINERS[check_trainer_name(name)].trainer)


def lazy_exports() -> dict[str, str]:
    """Every registered class name -> its ``"module:Class"`` path (what ``flowgrpo`` and ``flowgrpo.trainer``
    export lazily)."""
    out = {}
    for spec in TRAINERS.values():
        out[spec.config_name] = spec.config
        out[spec.trainer_name] = spec.trainer
    return out
