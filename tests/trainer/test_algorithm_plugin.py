"""A third-party algorithm, installed as a package (one file and one entry point, support/plugin_package.py), gets
what a built-in gets: the command line with its settings in ``--help``, ``flowgrpo plan``, training with its own loss,
and (in the shared tests, where it is one more trainer kind) resume, LoRA export and the Ray backend
(tests/trainer/test_trainer.py, tests/distributed/test_ray_rollouts.py). Plugins load when their name is asked for,
never on ``import flowgrpo``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from support.plugin_package import PLUGIN_MODULE, PLUGIN_NAME, ensure_plugin_installed
from support.trainer_cases import make_trainer, redness_reward

REPO = Path(__file__).resolve().parents[2]

_PROBE = f"""
import sys
import flowgrpo, flowgrpo.rewards
from flowgrpo.trainer.registry import TRAINERS, trainer_names
assert {PLUGIN_NAME!r} in trainer_names(), trainer_names()
assert {PLUGIN_MODULE!r} not in sys.modules, "imported on import flowgrpo or on listing the names"
spec = TRAINERS[{PLUGIN_NAME!r}]
assert {PLUGIN_MODULE!r} in sys.modules and spec.title == "Scaled-GRPO"
from flowgrpo.cli.command import main
try:
    main(["train", "--trainer", {PLUGIN_NAME!r}, "--help"])
except SystemExit as end:
    assert end.code == 0, end.code
"""


def test_an_installed_plugin_is_a_trainer_of_the_command_line_loaded_only_when_asked_for():
    site = ensure_plugin_installed()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "src")])}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--advantage_scale" in out.stdout and "Scaled-GRPO training of a flow-matching" in out.stdout
    assert "Multiplies the group advantages" in out.stdout.replace("\n", " ")


def test_a_plugin_is_planned_as_the_algorithm_its_spec_describes():
    from flowgrpo.plan.cli import plan_recipe

    ensure_plugin_installed()
    recipe = str(REPO / "recipes" / "toy_flow_grpo.yaml")
    plain = plan_recipe(recipe, [], with_suggestions=False)
    variant = plan_recipe(recipe, ["--trainer", PLUGIN_NAME, "--advantage_scale", "-1"], with_suggestions=False)
    for key in ("peak_memory_gb", "step_flops", "breakdown_gb", "phases"):
        assert variant[key] == plain[key], key


def test_the_plugins_own_setting_changes_its_loss_and_nothing_else(tiny_sd3_path, tmp_path):
    """advantage_scale 1 trains exactly as Flow-GRPO; -1 moves the weights elsewhere."""

    def weights(kind, folder, **kwargs):
        trainer = make_trainer(tiny_sd3_path, tmp_path / folder, kind=kind, reward=redness_reward,
                               sde_window_size=2, sde_window_range=[0, 2], **kwargs)
        trainer.train()
        return {k: v.detach().clone() for k, v in trainer.policy.unwrapped.named_parameters() if v.requires_grad}

    grpo = weights("flow_grpo", "grpo")
    same = weights(PLUGIN_NAME, "same", advantage_scale=1.0)
    away = weights(PLUGIN_NAME, "away", advantage_scale=-1.0)
    assert all(torch.equal(grpo[k], same[k]) for k in grpo)
    assert any(not torch.equal(grpo[k], away[k]) for k in grpo)
