"""A third-party algorithm package, as a user would write one: one file (its configuration, its trainer and its
``SPEC``) and one entry point in the ``flowgrpo.trainers`` group. `install_plugin_package` writes it as an installed
distribution (the module and its ``.dist-info`` with ``entry_points.txt``, what ``pip install`` leaves in
site-packages) into a folder; `ensure_plugin_installed` does so once per process in a temporary folder put on
``sys.path`` and ``PYTHONPATH`` (subprocesses and Ray workers find it), so that flowgrpo finds the algorithm by its
name as it finds the built-ins.

The variant: Flow-GRPO with one extra setting, ``advantage_scale``, that multiplies the group advantages its loss
reads (1 is Flow-GRPO exactly; -1 trains away from the reward)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

PLUGIN_NAME = "scaled_grpo"
PLUGIN_MODULE = "scaled_grpo_plugin"
PLUGIN_DIST = "flowgrpo_scaled_grpo"

#: the package's one file
PLUGIN_SOURCE = '''"""Scaled-GRPO: Flow-GRPO whose loss reads the group advantages times ``advantage_scale``."""

from dataclasses import dataclass, field

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.trainer.registry import TRAINERS


@dataclass
class ScaledGRPOConfig(FlowGRPOConfig):
    """Flow-GRPO's settings and ``advantage_scale``."""

    advantage_scale: float = field(
        default=1.0, metadata={"help": "Multiplies the group advantages of the loss (1: Flow-GRPO; -1: away from "
                                       "the reward)."})


class ScaledGRPOTrainer(FlowGRPOTrainer):
    """Flow-GRPO with scaled advantages."""

    _config_class = ScaledGRPOConfig
    _name = "Scaled-GRPO"
    _tag_names = ["scaled-grpo", "flowgrpo", "lora", "text-to-image", "diffusers"]

    def _advantages(self, batch):
        return super()._advantages(batch) * self.args.advantage_scale


SPEC = TRAINERS["flow_grpo"].derive(
    name="scaled_grpo", title="Scaled-GRPO", config="scaled_grpo_plugin:ScaledGRPOConfig",
    trainer="scaled_grpo_plugin:ScaledGRPOTrainer", summary="Flow-GRPO with the advantages times advantage_scale")
'''


def install_plugin_package(site: Path) -> Path:
    """Write the package into ``site`` as an installed distribution; returns ``site``. Everything a new algorithm
    adds is these two things: the module file and its entry point."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
    dist = site / f"{PLUGIN_DIST}-0.1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0.1.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(f"[flowgrpo.trainers]\n{PLUGIN_NAME} = {PLUGIN_MODULE}:SPEC\n",
                                           encoding="utf-8")
    (dist / "top_level.txt").write_text(f"{PLUGIN_MODULE}\n", encoding="utf-8")
    return site


_SITE: Path | None = None


def ensure_plugin_installed() -> Path:
    """Install the package once per process (a temporary folder on ``sys.path`` and ``PYTHONPATH``) and make the
    registry read the entry points again; returns the folder."""
    global _SITE
    if _SITE is None:
        _SITE = install_plugin_package(Path(tempfile.mkdtemp(prefix="flowgrpo-plugin-")))
        sys.path.insert(0, str(_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE), os.environ.get("PYTHONPATH")) if p)
        from flowgrpo.trainer.registry import TRAINERS

        TRAINERS.refresh()
    return _SITE
