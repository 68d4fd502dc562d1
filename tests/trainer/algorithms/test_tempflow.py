"""TempFlow-GRPO (the ``tempflow_*`` options of FlowGRPOConfig): the rows of a group, the loss weight 2.25 x std and
the per-step advantages by hand against DESIGN section 11, and one training step on the tiny SD3 pipeline with a group
split over two micro-batches (the trunk sampled the same in both, each child one recorded step from its trunk state,
the first pass on-policy, the advantages normalised among siblings)."""

from __future__ import annotations

import types

import pytest
import torch
from support.trainer_cases import make_args, make_trainer, redness_reward

from flowgrpo import FlowGRPOConfig
from flowgrpo.schedulers import SDESettings, sde_transition
from flowgrpo.trainer.algorithms.tempflow import tempflow_cost, tempflow_row, weighted_advantages
from flowgrpo.trainer.algorithms.tempflow_rollout import TempFlowRollout
from flowgrpo.trainer.registry import TRAINERS
from flowgrpo.trainer.rollout.advantages import compute_reward_advantages


def test_rows_weights_and_per_step_advantages_by_hand(tmp_path):
    # rows of a group: 3 children at each of steps 0 and 2 (G = 6); the second group starts at position 6
    assert [tempflow_row(p, 6, 3, [0, 2]) for p in (0, 2, 3, 5, 6)] == [(0, 0, 0), (0, 0, 2), (0, 2, 0), (0, 2, 2),
                                                                         (1, 0, 0)]
    # the weight: a = 0.7, sigma 0.5 -> 0.25: std = 0.7 sqrt(0.5 / 0.5) sqrt(0.25) = 0.35, w = 2.25 x 0.35 = 0.7875
    x = torch.zeros(2, 4)
    std = sde_transition(torch.zeros(2, 4), x, 0.5, 0.25, SDESettings(0.7, "sde", 0.9)).std
    assert std.tolist() == pytest.approx([0.35, 0.35])
    assert weighted_advantages(torch.tensor([1.0, -2.0]), std).tolist() == pytest.approx([0.7875, -1.575])
    # advantages among the children of one state: the sibling groups of the strategy, then advantages.py
    args = types.SimpleNamespace(num_generations=6, tempflow_children=3, tempflow_branch_steps=[0, 2], sde_type="sde")
    groups = TempFlowRollout(args).advantage_groups(torch.zeros(12, dtype=torch.long))
    assert groups.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0] * 2)
    adv, _ = compute_reward_advantages(rewards, {"r": rewards}, {"r": 1.0}, groups, scale_rewards="group")
    s0, s1 = (2 / 3) ** 0.5 + 1e-4, 2 ** 0.5 + 1e-4  # (1, 2, 3) and (10, 10, 13) about their means 2 and 11
    assert adv[:6].tolist() == pytest.approx([-1 / s0, 0.0, 1 / s0, -1 / s1, -1 / s1, 2 / s1], rel=1e-6)
    # the cost: 10 steps, branches at 0-8, 6 children, one branch step a micro-batch: each row T - j passes, the
    # trunk j passes shared by 6 rows; a whole trajectory a micro-batch samples its trunk once and trains 9 parts
    assert tempflow_cost(10, list(range(9)), 6, 6) == pytest.approx((6 + 4 / 6, 1.0))
    assert tempflow_cost(10, list(range(9)), 6, 54) == pytest.approx((6 + 8 / 54, 9.0))


def test_settings_are_checked(tmp_path):
    base = dict(tempflow_children=2, num_generations=6, num_inference_steps=4, per_device_train_batch_size=6)
    args = make_args(tmp_path, **base)
    assert args.tempflow_branch_steps == [0, 1, 2]  # every step but the last, as the official script
    facts = TRAINERS["flow_grpo"].facts(args)
    assert facts.record.steps == 1 and facts.workers.refusal and "tempflow_step" in facts.record.fields
    for kwargs, match in [(dict(num_generations=4), "num_generations: 6"),
                          (dict(tempflow_branch_steps=[0, 3]), "0 .. num_inference_steps - 2 = 2"),
                          (dict(sde_window_size=2, sde_window_range=[0, 2]), "sde_window_size: 0"),
                          (dict(ode_solver="dpmpp_2m"), "Euler steps"),
                          (dict(policy_loss="dppo", num_iterations=2), "weights the clipped objective")]:
        with pytest.raises(ValueError, match=match):
            make_args(tmp_path, **{**base, **kwargs})
    with pytest.raises(ValueError, match="needs tempflow_children > 0"):
        FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], tempflow_branch_steps=[0])


def test_a_step_with_a_group_split_over_two_micro_batches(tiny_sd3_path, tmp_path):
    """2 children at steps 0, 1, 2 of 4 (G = 6) in micro-batches of 3: the trunk state at step 1 is sampled in both
    micro-batches and is the same; siblings share their state and differ after their SDE step; the first pass is
    on-policy; each step's advantages are centred among its siblings; the weight is 2.25 x the step's std."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, reward=redness_reward, tempflow_children=2, num_generations=6,
                           per_device_train_batch_size=3, gradient_accumulation_steps=2, resolution=32)
    trainer.train()
    first, second = trainer.buffer
    assert first["tempflow_step"].tolist() == [0, 0, 1] and second["tempflow_step"].tolist() == [1, 2, 2]
    assert first["latents"].shape[1] == 1  # one recorded step a child
    torch.testing.assert_close(first["latents"][2], second["latents"][0])  # the trunk at step 1, sampled twice
    assert torch.equal(first["latents"][0], first["latents"][1])  # siblings leave the same state ...
    assert not torch.equal(first["next_latents"][0], first["next_latents"][1])  # ... by different draws
    adv = torch.cat([first["advantages"], second["advantages"]])
    for rows in ([0, 1], [2, 3], [4, 5]):  # the children of one state, centred among themselves
        assert float(adv[rows].sum()) == pytest.approx(0.0, abs=1e-6) and float(adv[rows].abs().min()) > 0.1
    log = next(h for h in trainer.state.log_history if "ratio_mean" in h)
    assert log["on_policy_ratio_max_dev"] < 1e-6 and log["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    sig = trainer.rollouts.scheduler.sigmas.tolist()  # at sigma = 1 the denominator takes sigmas[1]
    stds = [0.7 * (s / (1 - (s if s < 1 else sig[1]))) ** 0.5 * (s - n) ** 0.5 for s, n in zip(sig[:3], sig[1:4])]
    assert log["tempflow/weight"] == pytest.approx(2.25 * sum([stds[0], stds[1], stds[1], stds[2]]) / 4, rel=1e-4)
