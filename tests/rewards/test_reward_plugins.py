"""Rewards are plugins loaded when asked for: importing flowgrpo and flowgrpo.rewards imports no reward module, a
reward's name imports its own module only, every built-in reward is declared by name in setup.py, and a third-party
package's rewards (named, callable or module-level entry points) work beside a broken one, which errors, naming
itself, only when it is used.

The third-party package is a real distribution (``*.dist-info`` with ``entry_points.txt``) on the ``PYTHONPATH`` of a
fresh interpreter, where ``importlib.metadata`` finds it as it finds an installed package."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, site: Path | None = None) -> subprocess.CompletedProcess:
    path = f"{site}:{REPO / 'src'}" if site else str(REPO / "src")
    env = {"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def _third_party_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    dist = site / "flowgrpo_extra_rewards-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowgrpo-extra-rewards\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[flowgrpo.rewards]\n"
        "broken = extra_rewards_missing\n"          # a module that does not exist
        "extra_ones = extra_rewards\n"              # a reward by name: its module registers it
        "extra_callable = extra_rewards:half\n"     # a callable, registered under the entry point's name
        "extra_module = extra_rewards_module\n")    # the earlier form: a module under any name
    (site / "extra_rewards.py").write_text(
        "from flowgrpo.rewards import register_reward\n\n"
        "@register_reward('extra_ones')\ndef ones(prompts, images, **columns):\n    return [1.0] * len(images)\n\n"
        "def half(prompts, images, **columns):\n    return [0.5] * len(images)\n")
    (site / "extra_rewards_module.py").write_text(
        "from flowgrpo.rewards import register_reward\n\n"
        "@register_reward('extra_twos')\ndef twos(prompts, images, **columns):\n    return [2.0] * len(images)\n")
    return site


def test_importing_flowgrpo_and_its_rewards_imports_no_reward_plugin(tmp_path):
    """No plugin module (built-in, the toy world's, third-party) is imported by ``import flowgrpo`` or ``import
    flowgrpo.rewards``; asking for PickScore imports its module, and no other."""
    code = (
        "import sys\nfrom importlib.metadata import entry_points\n"
        "plugins = {ep.module for ep in entry_points(group='flowgrpo.rewards')}\n"
        "loaded = lambda: sorted(m for m in plugins if m in sys.modules)\n"
        "import flowgrpo, flowgrpo.rewards\nprint(len(plugins), loaded())\n"
        "flowgrpo.rewards.get_reward('pickscore')\nprint(loaded())\n")
    after_import, after_pickscore = _run(code, _third_party_site(tmp_path)).stdout.splitlines()[-2:]
    count, loaded = after_import.split(" ", 1)
    from flowgrpo.rewards.registry import BUILTIN_REWARD_MODULES

    # the built-in modules, the toy world's two and the third party's three: none imported
    assert int(count) == len(BUILTIN_REWARD_MODULES) + 2 + 3 and loaded == "[]", after_import
    assert after_pickscore == "['flowgrpo.rewards.clip_scorers']"


def test_a_broken_reward_plugin_fails_only_when_used_and_names_itself(tmp_path):
    code = (
        "import logging, flowgrpo.rewards as r\nfrom flowgrpo.plugins import PluginError\n"
        "logging.basicConfig(format='LOG %(message)s')\n"
        "print(r.get_reward('extra_ones')(['p'], [None]), r.get_reward('extra_callable')(['p'], [None]),"
        " r.get_reward('extra_twos')(['p'], [None]), r.get_reward('ocr').__class__.__name__, flush=True)\n"
        "try:\n    r.get_reward('broken')\nexcept PluginError as err:\n    print('ERROR', err, flush=True)\n"
        "names = r.list_rewards()\n"
        "print('LISTED', all(n in names for n in ('extra_ones', 'extra_callable', 'extra_twos', 'ocr', 'toy_shape')),"
        " 'broken' in names)\n")
    out = _run(code, _third_party_site(tmp_path))
    lines = out.stdout.splitlines()
    assert lines[0] == "[1.0] [0.5] [2.0] OCRReward", out.stdout
    assert lines[1].startswith("ERROR") and lines[2] == "LISTED True False", out.stdout
    for part in ("'broken'", "broken = extra_rewards_missing", "flowgrpo-extra-rewards 0.1",
                 "ModuleNotFoundError", "pip uninstall flowgrpo-extra-rewards"):
        assert part in lines[1], (part, lines[1])
    # listing names it once, as skipped; nothing was said of it before it was used
    assert out.stderr.count("broken = extra_rewards_missing") == 1 and "skipped" in out.stderr, out.stderr


def test_setup_declares_every_builtin_reward_by_name_with_its_module():
    """setup.py's table (one entry point per reward) names exactly what each module registers; its flowgrpo.rewards
    modules are the fallback modules of an uninstalled tree, and the core reward package names no toy module."""
    from flowgrpo.rewards.registry import _REGISTRY, BUILTIN_REWARD_MODULES

    tree = ast.parse((REPO / "setup.py").read_text())
    table = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "BUILTIN_REWARDS")
    core = [m.rpartition(".")[2] for m in table if m.startswith("flowgrpo.rewards.")]
    assert tuple(core) == BUILTIN_REWARD_MODULES
    assert {m for m in table if not m.startswith("flowgrpo.rewards.")} == {"flowgrpo.toy.rewards",
                                                                           "flowgrpo.toy.hackable"}
    for module in table:
        importlib.import_module(module)
    registered = {}
    for name, obj in _REGISTRY.items():
        registered.setdefault(obj.__module__, set()).add(name)
    for module, names in table.items():
        assert set(names) == registered[module], module
    source = (REPO / "src" / "flowgrpo" / "rewards" / "__init__.py").read_text()
    assert "toy" not in source.replace("the toy world's", "")
