"""The package's shape holds: the import contracts of pyproject.toml (layers: the core packages import no tooling; the
command line free of flowgrpo.testing; no import circles), one line of inheritance in every trainer of the registry,
one table per concept (trainers, families), configuration docstrings that list every field, and an architecture page
whose module paths exist. (Rewards as plugins: tests/rewards/test_reward_plugins.py.)"""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "flowgrpo"


def _lint_imports(*args: str, src: Path = REPO / "src") -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject.toml's contracts over the package found in ``src``."""
    env = {"PYTHONPATH": f"{src}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin", "NO_COLOR": "1", "COLUMNS": "400"}
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--config", str(REPO / "pyproject.toml"),
                           "--no-cache", "--no-logo", *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts: the layers (the core imports no tooling), the command line free of
    flowgrpo.testing, no circle of imports between modules, and the planner, the command line, the health guards and
    the rollout backends free of flowgrpo.trainer.algorithms (they ask the algorithm's spec)."""
    out = _lint_imports()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 4 kept, 0 broken." in out.stdout, out.stdout


def test_the_import_contracts_catch_each_broken_rule(tmp_path):
    """A copy of the package with bad imports (each inside a function: they count too) breaks every contract: a core
    module importing the toy world, the command line reaching flowgrpo.testing through flowgrpo.toy, two modules
    importing each other, and the health guards importing an algorithm."""
    import shutil

    package = tmp_path / "flowgrpo"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "shipped_world", "model_configs"))
    probes = {"trainer/seeds.py": "from ..toy import world", "cli/lora.py": "from ..toy import build",
              "build_cache.py": "from . import cpu_threads", "cpu_threads.py": "from . import build_cache",
              "trainer/health/alarms.py": "from ..algorithms import flow_grpo_loss"}
    for path, line in probes.items():
        with open(package / path, "a", encoding="utf-8") as f:
            f.write(f"\n\ndef _probe():\n    {line}\n")
    out = _lint_imports(src=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Contracts: 0 kept, 4 broken." in out.stdout, out.stdout
    for text in ("flowgrpo.trainer is not allowed to import flowgrpo.toy",
                 "flowgrpo.trainer.health is not allowed to import flowgrpo.trainer.algorithms",
                 "flowgrpo.cli is not allowed to import flowgrpo.testing",
                 "flowgrpo.cli.lora -> flowgrpo.toy.build",
                 "Circle of 2 modules: flowgrpo.build_cache, flowgrpo.cpu_threads"):
        assert text in out.stdout, (text, out.stdout)


def _trainer_names() -> list[str]:
    from flowgrpo.trainer.registry import TRAINERS

    return list(TRAINERS)


@pytest.mark.parametrize("name", _trainer_names())
def test_every_trainer_is_one_line_of_inheritance_down_to_transformers_trainer(name):
    from transformers import Trainer

    from flowgrpo.trainer.registry import trainer_class

    cls = trainer_class(name)
    own = [c for c in cls.__mro__ if c.__module__.startswith("flowgrpo.")]
    for klass in own:
        assert len(klass.__bases__) == 1, f"{klass.__name__} has bases {klass.__bases__}: no mixins in the chain"
    assert own[-1].__bases__ == (Trainer,)
    assert [c.__name__ for c in own][-2:] == ["OnlineRLTrainer", "FlowBaseTrainer"]


def test_one_trainer_table():
    import flowgrpo
    import flowgrpo.trainer
    from flowgrpo.toy.learning import TOY_TRAINERS
    from flowgrpo.trainer.registry import BUILTIN_TRAINERS, TRAINERS, lazy_exports

    assert TOY_TRAINERS == {name: (spec.config, spec.trainer) for name, spec in TRAINERS.items()}
    exported = set(lazy_exports())
    assert exported <= set(flowgrpo.__all__) and exported <= set(flowgrpo.trainer.__all__)
    # the built-ins are exported by flowgrpo; a plugin installed by another test of this process is not
    for spec in (TRAINERS[name] for name in BUILTIN_TRAINERS):
        assert getattr(flowgrpo, spec.trainer_name).__name__ == spec.trainer_name
        assert getattr(flowgrpo, spec.config_name).__name__ == spec.config_name


def test_one_family_table():
    from flowgrpo.cli.arguments import TINY_PIPELINE_FAMILIES
    from flowgrpo.models import FAMILIES, adapter_classes
    from flowgrpo.plan.model_specs import family_of_pipeline
    from flowgrpo.testing import TINY_FAMILIES

    classes = adapter_classes()
    assert [cls.family for cls in classes] == list(FAMILIES)  # each adapter names its own family
    assert TINY_FAMILIES == tuple(FAMILIES)
    assert TINY_PIPELINE_FAMILIES == (*FAMILIES, "toy")
    assert set(family_of_pipeline().values()) == set(FAMILIES)
    assert sorted(family_of_pipeline()) == sorted(n for cls in classes for n in cls.pipeline_class_names)


def _registered_configs():
    from flowgrpo.trainer.online_config import OnlineRLConfig
    from flowgrpo.trainer.registry import TRAINERS, config_class

    return [OnlineRLConfig] + [config_class(name) for name in TRAINERS]


@pytest.mark.parametrize("config", _registered_configs(), ids=lambda c: c.__name__)
def test_config_docstrings_list_every_field_grouped_by_concern(config):
    from flowgrpo.trainer.config_docs import config_groups

    doc = config.__doc__
    grouped = [name for _, names in config_groups(config) for name in names]
    own = {f.name for f in dataclasses.fields(config)
           if any(f.name in vars(k).get("__annotations__", {}) for k in config.__mro__
                  if k.__module__.startswith("flowgrpo."))}
    assert set(grouped) == own, f"fields outside a '# ---- concern ----' section or unknown: {set(grouped) ^ own}"
    for name in own:
        entries = re.findall(rf"^    {name} \(`", doc, re.M)
        assert len(entries) == 1, f"{config.__name__}.{name} is documented {len(entries)} times"
    headings = re.findall(r"^    > (.+)$", doc, re.M)
    assert len(headings) >= 5 and headings[-1].startswith("The other fields of `transformers.TrainingArguments`")


def test_architecture_page_names_only_paths_that_exist():
    text = (REPO / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:src|tests|scripts|recipes|docs|accelerate_configs)/[A-Za-z0-9_./-]+)`", text))
    modules = set(re.findall(r"`(flowgrpo(?:\.[a-z_0-9]+)+)`", text))
    assert paths and modules
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    unknown = []
    for dotted in sorted(modules):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module; the rest must be attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attribute in parts[cut:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                unknown.append(dotted)
            break
        else:
            unknown.append(dotted)
    assert not unknown, f"docs/architecture.md names modules or attributes that do not exist: {unknown}"


def test_configurations_import_without_models_or_diffusers():
    """`--help` and recipe checks import the configurations only: no diffusers, no model code (the light constants of
    flowgrpo.schedulers, e.g. SA-Solver's defaults, are fine); the training run's module imports nothing of
    flowgrpo.testing or flowgrpo.toy (their model folders are plugins)."""
    code = ("import sys\nfrom flowgrpo.trainer.registry import TRAINERS, config_class\n"
            "[config_class(name) for name in TRAINERS]\nimport flowgrpo.cli.parser\n"
            "print(sorted(m for m in ('diffusers', 'flowgrpo.models.base', 'flowgrpo.schedulers.sde_step') if m in sys.modules))\n"
            "import flowgrpo.cli.train\n"
            "print(sorted(m for m in sys.modules if m.startswith(('flowgrpo.testing', 'flowgrpo.toy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]"], out.stdout
