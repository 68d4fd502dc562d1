"""The trainers a recipe can name (``trainer: flow_grpo | diffusion_nft``), each with its configuration class.

Configurations import cheaply (for ``--help`` and recipe checks); trainer classes load on first use.
"""

from __future__ import annotations

import importlib

#: name -> (configuration class, trainer class), as "module:attribute" paths
TRAINERS: dict[str, tuple[str, str]] = {
    "flow_grpo": ("flowgrpo.trainer.algorithms.flow_grpo_config:FlowGRPOConfig",
                  "flowgrpo.trainer.algorithms.flow_grpo_trainer:FlowGRPOTrainer"),
    "diffusion_nft": ("flowgrpo.trainer.algorithms.nft_config:DiffusionNFTConfig",
                      "flowgrpo.trainer.algorithms.nft_trainer:DiffusionNFTTrainer"),
}
DEFAULT_TRAINER = "flow_grpo"

__all__ = ["DEFAULT_TRAINER", "TRAINERS", "check_trainer_name", "config_class", "trainer_class"]


def check_trainer_name(name: str) -> str:
    if name not in TRAINERS:
        raise ValueError(f"trainer={name!r} is not a trainer; choose one of {', '.join(map(repr, TRAINERS))}.")
    return name


def _load(path: str):
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def config_class(name: str) -> type:
    """The configuration class of trainer ``name`` (e.g. ``DiffusionNFTConfig`` for ``"diffusion_nft"``)."""
    return _load(TRAINERS[check_trainer_name(name)][0])


def trainer_class(name: str) -> type:
    """The trainer class of ``name`` (imports transformers, diffusers and peft)."""
    return _load(TRAINERS[check_trainer_name(name)][1])
