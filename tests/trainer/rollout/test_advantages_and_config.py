"""Group advantages on hand-made reward tables, the prompt sampler and FlowGRPOConfig validation."""

import math

import numpy as np
import pytest
import torch

from flowgrpo import FlowGRPOConfig
from flowgrpo.trainer.data.sampler import RepeatSampler
from flowgrpo.trainer.rollout.advantages import STD_EPS, compute_group_advantages


def reference_advantages(rewards, groups, scale, clip):
    """Straightforward numpy version of DESIGN.md section 2 (NaN = unscored)."""
    rewards = np.asarray(rewards, dtype=float)
    groups = np.asarray(groups)
    valid = ~np.isnan(rewards)
    adv = np.zeros_like(rewards)
    batch_std = rewards[valid].std()
    for g in np.unique(groups):
        members = (groups == g) & valid
        if not members.any():
            continue
        mean = rewards[members].mean()
        s = {"group": rewards[members].std(), "batch": batch_std, "none": 1.0}[scale]
        denom = s + STD_EPS if scale != "none" else 1.0
        adv[members] = (rewards[members] - mean) / denom
    return np.clip(adv, -clip, clip)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_reference_table(scale):
    rewards = [1.0, 2.0, 3.0, 4.0, 0.5, 0.5, 0.5, 0.5, 10.0, 0.0, float("nan"), 5.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    adv, stats = compute_group_advantages(torch.tensor(rewards), torch.tensor(groups), scale, adv_clip_max=5.0)
    expected = reference_advantages(rewards, groups, scale, 5.0)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-5, atol=1e-6)
    # group 1 has zero std: one of three groups
    assert stats.frac_reward_zero_std == pytest.approx(1 / 3)
    # unscored image: advantage 0, excluded from the statistics
    assert adv[10].item() == 0.0
    valid = [r for r in rewards if not math.isnan(r)]
    assert stats.reward_mean == pytest.approx(np.mean(valid))
    assert stats.reward_std == pytest.approx(np.std(valid))
    assert stats.num_valid == 11


def test_group_values_hand_computed():
    adv, _ = compute_group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([5, 5, 9, 9]), "group", 5.0)
    # each group: mean 0.5 / 2.5, std 0.5
    expected = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (0.5 + STD_EPS)
    torch.testing.assert_close(adv, expected)


def test_advantage_clipping():
    rewards = torch.tensor([0.0] * 99 + [100.0])
    adv, _ = compute_group_advantages(rewards, torch.zeros(100, dtype=torch.long), "group", adv_clip_max=2.5)
    assert adv.max().item() == pytest.approx(2.5)


def test_gathered_ranks_give_same_stats_as_one_table():
    """Two ranks each holding half of every group: gathering then normalising equals the single-process table."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(16, generator=gen)
    groups = torch.arange(4).repeat_interleave(4)
    single, single_stats = compute_group_advantages(rewards, groups, "batch", 5.0)
    rank0, rank1 = slice(0, 8), slice(8, 16)
    gathered_rewards = torch.cat([rewards[rank0], rewards[rank1]])
    gathered_groups = torch.cat([groups[rank0], groups[rank1]])
    multi, multi_stats = compute_group_advantages(gathered_rewards, gathered_groups, "batch", 5.0)
    torch.testing.assert_close(single, multi)
    assert single_stats == multi_stats
    # a group split across ranks (groups interleaved) still uses all its members
    perm = torch.randperm(16, generator=gen)
    shuffled, _ = compute_group_advantages(rewards[perm], groups[perm], "group", 5.0)
    torch.testing.assert_close(shuffled, compute_group_advantages(rewards, groups, "group", 5.0)[0][perm])


def test_all_unscored_group_gets_zero_advantage():
    rewards = torch.tensor([float("nan"), float("nan"), 1.0, 2.0])
    adv, stats = compute_group_advantages(rewards, torch.tensor([0, 0, 1, 1]), "group", 5.0)
    assert adv[:2].tolist() == [0.0, 0.0]
    assert stats.frac_reward_zero_std == 0.0


def test_repeat_sampler_layout_and_determinism():
    data = list(range(6))
    sampler = RepeatSampler(data, num_generations=2, prompts_per_generation=3, repeat_count=2, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 6 * 2 * 2
    first_generation = order[:6]
    assert first_generation[0::2] == first_generation[1::2]  # each index G times in a row
    assert order[6:12] == first_generation  # repeated for the next micro-step
    assert len(set(first_generation)) == 3
    assert list(RepeatSampler(data, 2, 3, 2, seed=3)) == order  # same on every rank
    sampler.set_epoch(1)
    assert list(sampler) != order
    with pytest.raises(ValueError, match="distinct prompts"):
        RepeatSampler([0, 1], num_generations=2, prompts_per_generation=3)


def make_config(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, num_generations=4,
                resolution=64, num_inference_steps=4)
    base.update(kwargs)
    return FlowGRPOConfig(**base)


def test_config_defaults_and_derived_fields(tmp_path):
    cfg = make_config(tmp_path, gradient_accumulation_steps=2)
    assert cfg.steps_per_generation == 2
    assert cfg.generation_batch_size == 8
    assert (cfg.height, cfg.width) == (64, 64)
    assert cfg.eval_guidance_scale == cfg.guidance_scale
    assert cfg.remove_unused_columns is False
    published = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[])
    assert (published.noise_level, published.beta, published.epsilon, published.adv_clip_max) == (0.7, 0.04, 1e-4, 5.0)
    # the sampling settings are the model's own, resolved by the trainer (tests/models/test_generation_defaults.py)
    assert (published.num_inference_steps, published.eval_num_inference_steps, published.guidance_scale,
            published.resolution, published.max_sequence_length, published.num_frames) == (None,) * 6


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        (dict(num_generations=1), ["num_generations"]),
        (dict(num_generations=3), ["num_generations", "generation batch"]),
        (dict(sde_window_size=5), ["sde_window_size", "num_inference_steps"]),
        (dict(sde_window_size=2, sde_window_range=[0, 4]), ["sde_window_range", "sde_window_size"]),
        (dict(sde_type="ode"), ["sde_type"]),
        (dict(scale_rewards="global"), ["scale_rewards"]),
        (dict(resolution=60), ["height"]),
        (dict(generation_batch_size=6), ["generation_batch_size"]),
        (dict(remove_unused_columns=True), ["remove_unused_columns"]),
    ],
)
def test_invalid_config_names_fields(tmp_path, kwargs, fields):
    with pytest.raises(ValueError) as err:
        make_config(tmp_path, **kwargs)
    for field in fields:
        assert field in str(err.value)


def test_every_new_field_has_help():
    from dataclasses import fields

    from transformers import TrainingArguments

    base = {f.name for f in fields(TrainingArguments)}
    new = [f for f in fields(FlowGRPOConfig) if f.name not in base]
    assert len(new) >= 25
    for f in new:
        assert len(f.metadata.get("help", "")) > 20, f.name
