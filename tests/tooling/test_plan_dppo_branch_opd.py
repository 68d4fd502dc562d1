"""What `flowgrpo plan` counts for BranchGRPO, on-policy distillation and Flow-DPPO, on the tiny recipe: BranchGRPO's shared prefixes (fewer rollout
passes and trained transitions per sample), on-policy distillation's teacher forward per trained step and its
teachers' memory, and the transition means Flow-DPPO keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.plan import plan_recipe
from flowgrpo.trainer.algorithms.branch_grpo import tree_passes

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def _plan(*overrides: str):
    return plan_recipe(TINY, list(overrides), with_suggestions=False)


def test_tree_passes_count_the_shared_prefixes():
    # 8 steps split at 0, 2, 4: 2 + 2 + 4 + 4 + 8 + 8 + 8 + 8 = 44 rows for 8 leaves; the last step is not an edge
    assert tree_passes(8, [0, 2, 4], 2) == (44 / 8, 36 / 8)
    # the official FLUX tree: 20 steps split at 0, 3, 6, 9
    rollout, trained = tree_passes(20, [0, 3, 6, 9], 2)
    assert rollout == pytest.approx((2 * 3 + 4 * 3 + 8 * 3 + 16 * 11) / 16)
    assert trained == pytest.approx(rollout - 1)


def test_plan_of_trees_distillation_and_dppo():
    """The toy recipes, planned (the toy world's configs are the packaged ones): the full Flow-GRPO recipe samples
    and trains every step of 8 independent images a prompt, the tree shares its prefixes (44 of 64 rows, 36 of 56
    trained transitions), distillation adds a teacher forward to each trained step."""
    plain = plan_recipe(str(REPO / "recipes" / "toy_flow_grpo.yaml"), [], with_suggestions=False)
    tree = plan_recipe(str(REPO / "recipes" / "toy_branchgrpo.yaml"), [], with_suggestions=False)
    opd = plan_recipe(str(REPO / "recipes" / "toy_opd.yaml"), [], with_suggestions=False)
    # the rollout and the training scale with the rows and the trained transitions (the decode does not change)
    assert tree["step_flops"] < 0.75 * plain["step_flops"]
    assert opd["step_flops"] > 1.2 * plain["step_flops"]  # a teacher forward per trained step


@pytest.mark.parametrize("recipe, overrides, expected", [
    ("toy_flow_grpo.yaml", [], dict(rollout_passes=0.0, trained_passes=0.0, stored_per_step=2, teachers=0)),
    ("toy_branchgrpo.yaml", [], dict(rollout_passes=44 / 8, trained_passes=36 / 8, stored_per_step=3, teachers=0)),
    ("toy_flowdppo.yaml", [], dict(stored_per_step=3, trained_steps=2)),  # the anchor's means are kept
    ("toy_opd.yaml", [], dict(teachers=1, teacher_kind="lora", loss="transition_mean_mse")),
    ("toy_opd.yaml", ["--use_peft", "false"], dict(teachers=1, teacher_kind="model")),  # a merged copy
    ("toy_opd.yaml", ["--teacher_lora", "", "--teachers", '[{"lora": "a", "dataset_name": "x"}, '
                                                          '{"lora": "b", "dataset_name": "y"}]'],
     dict(teachers=2, teacher_kind="lora")),
])
def test_step_settings_of_trees_distillation_and_dppo(recipe, overrides, expected):
    from flowgrpo.cli.parser import parse_recipe
    from flowgrpo.plan.planner import settings_from_args

    script, model, args = parse_recipe([str(REPO / "recipes" / recipe), *overrides])
    settings = settings_from_args(args, model, script.trainer)
    assert {k: getattr(settings, k) for k in expected} == expected
