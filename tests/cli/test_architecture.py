"""The package's shape holds: no import circles, the core packages import no tooling, one line of inheritance in
every trainer, one table per concept (trainers, families, reward modules), configuration docstrings that list every
field, rewards found as plugins, and an architecture page whose module paths exist."""

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


def test_no_import_circles_and_the_core_imports_no_tooling():
    from flowgrpo.import_graph import read_import_graph

    graph = read_import_graph(PACKAGE)
    assert graph.cycles() == [], "import circles: fold the shared pieces into a module both can import"
    assert graph.layer_violations() == [], "core packages (schedulers, models, rewards, trainer) import tooling"


def test_the_import_graph_sees_circles_and_layering(tmp_path):
    """The checker itself: a circle, a dynamic import and a core module importing tooling are all found."""
    from flowgrpo.import_graph import read_import_graph

    pkg = tmp_path / "flowgrpo"
    (pkg / "rewards").mkdir(parents=True)
    (pkg / "toy").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards" / "__init__.py").write_text("import importlib\nimportlib.import_module('flowgrpo.toy.r')\n")
    (pkg / "rewards" / "a.py").write_text("from .b import x\n")
    (pkg / "rewards" / "b.py").write_text("def f():\n    from .a import _y\n")
    (pkg / "toy" / "__init__.py").write_text("")
    (pkg / "toy" / "r.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..rewards import a\n")
    graph = read_import_graph(pkg)
    assert graph.cycles() == [["flowgrpo.rewards.a", "flowgrpo.rewards.b"]]
    assert graph.layer_violations() == [("flowgrpo.rewards", "flowgrpo.toy.r")]
    assert graph.private_imports() == [("flowgrpo.rewards.b", "flowgrpo.rewards.a", "_y")]


@pytest.mark.parametrize("name", ["flow_grpo", "diffusion_nft", "awm", "diffusion_dpo", "dgpo", "crd"])
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
    from flowgrpo.trainer.registry import TRAINERS, lazy_exports

    assert TOY_TRAINERS == {name: (spec.config, spec.trainer) for name, spec in TRAINERS.items()}
    exported = set(lazy_exports())
    assert exported <= set(flowgrpo.__all__) and exported <= set(flowgrpo.trainer.__all__)
    for spec in TRAINERS.values():
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


def test_reward_modules_are_plugins_and_the_core_reward_package_names_none():
    import flowgrpo.rewards as rewards
    from flowgrpo.rewards.registry import BUILTIN_REWARD_MODULES

    setup = (REPO / "setup.py").read_text()
    declared = re.search(r"BUILTIN_REWARD_MODULES = \(([^)]*)\)", setup).group(1)
    assert tuple(re.findall(r'"([a-z_0-9]+)"', declared)) == BUILTIN_REWARD_MODULES
    assert "toy = flowgrpo.toy.rewards" in setup and "toy_hackable = flowgrpo.toy.hackable" in setup
    source = (PACKAGE / "rewards" / "__init__.py").read_text()
    assert "toy" not in source.replace("the toy world's", "")
    assert {"ocr", "toy_shape", "toy_area"} <= set(rewards.list_rewards())


def test_a_third_party_package_adds_a_reward_by_entry_point(tmp_path):
    """A distribution on the path that declares ``flowgrpo.rewards`` entry points (a module and a callable) adds its
    rewards; a broken one is skipped with a warning naming it, and the built-in rewards still load."""
    site = tmp_path / "site"
    dist = site / "flowgrpo_extra_rewards-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowgrpo-extra-rewards\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[flowgrpo.rewards]\nextra_module = extra_rewards\nextra_callable = extra_rewards:half\n"
        "broken = extra_rewards_missing\n")
    (site / "extra_rewards.py").write_text(
        "from flowgrpo.rewards import register_reward\n\n"
        "@register_reward('extra_ones')\ndef ones(prompts, images, **columns):\n    return [1.0] * len(images)\n\n"
        "def half(prompts, images, **columns):\n    return [0.5] * len(images)\n")
    code = ("import flowgrpo.rewards as r\n"
            "print(r.get_reward('extra_ones')(['p'], [None]), r.get_reward('extra_callable')(['p'], [None]),"
            " 'ocr' in r.list_rewards())\n")
    env = {"PYTHONPATH": f"{site}{':'}{REPO / 'src'}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0] [0.5] True"
    assert "broken = extra_rewards_missing" in out.stderr and "skipped" in out.stderr


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
    flowgrpo.schedulers, e.g. SA-Solver's defaults, are fine)."""
    code = ("import sys\nfrom flowgrpo.trainer.registry import TRAINERS, config_class\n"
            "[config_class(name) for name in TRAINERS]\nimport flowgrpo.cli.parser\n"
            "print(sorted(m for m in ('diffusers', 'flowgrpo.models.base', 'flowgrpo.schedulers.sde_step') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
