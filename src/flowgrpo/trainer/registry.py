"""The trainers a recipe can name (``trainer: NAME``): the algorithms of the entry-point group ``flowgrpo.trainers``,
each an `AlgorithmSpec` (``flowgrpo.trainer.algorithm_spec``), the one table that the command line, the planner, the
toy world and the package's lazy exports read.

The built-in algorithms register in the group exactly as a third-party package does (``setup.py``:
``flow_grpo = flowgrpo.trainer.algorithms.flow_grpo_config:SPEC``); `BUILTIN_TRAINERS` also lists them so that a
source checkout that is not installed finds them (a test keeps the two equal). A package adds an algorithm with one
file (its configuration, trainer and ``SPEC``) and one entry point::

    [project.entry-points."flowgrpo.trainers"]
    my_algorithm = "my_package.my_algorithm:SPEC"

Entry points are loaded when their name is asked for (``TRAINERS[name]``, ``recipe trainer: name``) or when the
trainers are listed (`flowgrpo.plugins.PluginGroup`); a broken one is an error naming it (`flowgrpo.plugins.PluginError`),
raised only then. Specs import their configuration module
(cheap: ``--help`` and recipe checks); trainer classes load on first use.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from ..plugins import PluginGroup
from .algorithm_spec import AlgorithmSpec, load_path

__all__ = ["BUILTIN_TRAINERS", "DEFAULT_TRAINER", "ENTRY_POINT_GROUP", "TRAINERS", "TrainerPluginError",
           "check_trainer_name", "config_class", "lazy_exports", "spec_of", "trainer_class", "trainer_names",
           "trainer_table"]

ENTRY_POINT_GROUP = "flowgrpo.trainers"
_ALGORITHMS = "flowgrpo.trainer.algorithms"
#: name -> (its spec, its configuration class, its trainer class), as ``"module:attribute"`` paths, in the order the
#: documentation lists them: what a source checkout registers without its entry points, and what ``flowgrpo``
#: exports lazily (``from flowgrpo import DGPOTrainer``)
BUILTIN_TRAINERS: dict[str, tuple[str, str, str]] = {
    "flow_grpo": (f"{_ALGORITHMS}.flow_grpo_config:SPEC", f"{_ALGORITHMS}.flow_grpo_config:FlowGRPOConfig",
                  f"{_ALGORITHMS}.flow_grpo_trainer:FlowGRPOTrainer"),
    "diffusion_nft": (f"{_ALGORITHMS}.nft_config:SPEC", f"{_ALGORITHMS}.nft_config:DiffusionNFTConfig",
                      f"{_ALGORITHMS}.nft_trainer:DiffusionNFTTrainer"),
    "awm": (f"{_ALGORITHMS}.awm_config:SPEC", f"{_ALGORITHMS}.awm_config:AWMConfig",
            f"{_ALGORITHMS}.awm_trainer:AWMTrainer"),
    "diffusion_dpo": (f"{_ALGORITHMS}.dpo_config:SPEC", f"{_ALGORITHMS}.dpo_config:DiffusionDPOConfig",
                      f"{_ALGORITHMS}.dpo_trainer:DiffusionDPOTrainer"),
    "dgpo": (f"{_ALGORITHMS}.dgpo_config:SPEC", f"{_ALGORITHMS}.dgpo_config:DGPOConfig",
             f"{_ALGORITHMS}.dgpo_trainer:DGPOTrainer"),
    "crd": (f"{_ALGORITHMS}.crd_config:SPEC", f"{_ALGORITHMS}.crd_config:CRDConfig",
            f"{_ALGORITHMS}.crd_trainer:CRDTrainer"),
    "diffusion_opd": (f"{_ALGORITHMS}.opd_config:SPEC", f"{_ALGORITHMS}.opd_config:DiffusionOPDConfig",
                      f"{_ALGORITHMS}.opd_trainer:DiffusionOPDTrainer"),
    "reward_backprop": (f"{_ALGORITHMS}.reward_backprop_config:SPEC",
                        f"{_ALGORITHMS}.reward_backprop_config:RewardBackpropConfig",
                        f"{_ALGORITHMS}.reward_backprop_trainer:RewardBackpropTrainer"),
}
DEFAULT_TRAINER = "flow_grpo"


class TrainerPluginError(ImportError):
    """A ``flowgrpo.trainers`` entry point that does not give an `AlgorithmSpec` of its own name (one that cannot be
    imported raises `flowgrpo.plugins.PluginError`, naming it and its package)."""


class _SpecTable(Mapping):
    """name -> `AlgorithmSpec`: the entry points of ``flowgrpo.trainers`` (`flowgrpo.plugins.PluginGroup`, with the
    built-ins for a source checkout that is not installed), each loaded on first access."""

    def __init__(self) -> None:
        self.group = PluginGroup(ENTRY_POINT_GROUP, builtin={name: row[0] for name, row in BUILTIN_TRAINERS.items()})

    def names(self) -> list[str]:
        """Every registered name, the built-ins first (without loading anything)."""
        return list(BUILTIN_TRAINERS) + sorted(n for n in self.group.names() if n not in BUILTIN_TRAINERS)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in BUILTIN_TRAINERS or name in self.group)

    def __getitem__(self, name: str) -> AlgorithmSpec:
        if name in BUILTIN_TRAINERS and name not in self.group:  # a built-in missing from a stale installation
            spec = load_path(BUILTIN_TRAINERS[name][0])
        elif name in self.group:
            spec = self.group.load(name)
        else:
            raise KeyError(name)
        if not isinstance(spec, AlgorithmSpec) or spec.name != name:
            got = f"an AlgorithmSpec named {spec.name!r}" if isinstance(spec, AlgorithmSpec) else type(spec).__name__
            raise TrainerPluginError(f"The trainer {name!r}: its {ENTRY_POINT_GROUP} entry point gives {got}; it must "
                                     f"give the AlgorithmSpec of {name!r} (flowgrpo.trainer.algorithm_spec).")
        return spec

    def refresh(self) -> None:
        """Read the entry points again (after installing a package in a running process)."""
        self.group.refresh()


#: name -> spec, in the order the documentation lists them (built-ins first)
TRAINERS = _SpecTable()


def trainer_names() -> list[str]:
    """Every registered trainer name, without loading any."""
    return TRAINERS.names()


def trainer_table() -> list[tuple[str, str, str]]:
    """(name, title, summary) of every registered trainer, for listings (``--help``): each entry point is loaded; one
    that fails is listed with its error instead of breaking the listing."""
    rows = []
    for name in trainer_names():
        try:
            spec = TRAINERS[name]
        except ImportError as err:  # PluginError or TrainerPluginError
            rows.append((name, "cannot be loaded", str(err)))
            continue
        rows.append((name, spec.title, spec.summary))
    return rows


def check_trainer_name(name: str) -> str:
    """``name`` when it is a registered trainer; else a ValueError with the closest names ("did you mean")."""
    if name in TRAINERS:
        return name
    names = trainer_names()
    close = difflib.get_close_matches(str(name), names, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(f"trainer={name!r} is not a trainer; {hint}choose one of {', '.join(map(repr, names))}.")


def config_class(name: str) -> type:
    """The configuration class of trainer ``name`` (e.g. ``DiffusionNFTConfig`` for ``"diffusion_nft"``)."""
    return TRAINERS[check_trainer_name(name)].config_class()


def trainer_class(name: str) -> type:
    """The trainer class of ``name`` (imports transformers, diffusers and peft)."""
    return TRAINERS[check_trainer_name(name)].trainer_class()


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def spec_of(args: Any) -> AlgorithmSpec:
    """The spec of the algorithm a configuration instance belongs to: the one whose configuration class is
    ``type(args)``, else the nearest registered base class's (a user's subclass of ``FlowGRPOConfig`` is Flow-GRPO)."""
    for cls in type(args).__mro__:
        path = _class_path(cls)
        for name, (_, config, _) in BUILTIN_TRAINERS.items():
            if config == path:
                return TRAINERS[name]
        for name in TRAINERS.names():
            if name not in BUILTIN_TRAINERS and TRAINERS[name].config == path:
                return TRAINERS[name]
    raise ValueError(f"{type(args).__name__} is not the configuration of a registered trainer "
                     f"({', '.join(trainer_names())}); subclass one of their configurations or register an "
                     f"AlgorithmSpec in the {ENTRY_POINT_GROUP!r} entry points.")


def lazy_exports() -> dict[str, str]:
    """Every built-in class name -> its ``"module:Class"`` path (what ``flowgrpo`` and ``flowgrpo.trainer`` export
    lazily). A plugin's classes are its own package's to export."""
    out = {}
    for _, config, trainer in BUILTIN_TRAINERS.values():
        out[config.partition(":")[2]] = config
        out[trainer.partition(":")[2]] = trainer
    return out
