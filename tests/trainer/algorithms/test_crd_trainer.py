"""CRDTrainer on the tiny SD3 pipeline: the first pass's loss is the centred rewards' by hand (per group and per
micro-batch), the sampling copy samples the rollouts and the copies follow their schedules once per generation. The
loss itself is checked by hand in test_crd_loss.py; resume, export and two ranks on every family in test_trainer.py and
test_model_families.py."""

from __future__ import annotations

import pytest
import torch
from support.trainer_cases import make_trainer, redness_reward

from flowgrpo import CRDConfig

SETTINGS = dict(kind="crd", reward=redness_reward, per_device_train_batch_size=4, num_generations=2,
                crd_num_timesteps=2, beta=0.0)


def logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("centering", ["group", "batch"])
def test_first_pass_loss_is_the_centred_rewards(tiny_sd3_path, tmp_path, centering):
    trainer = make_trainer(tiny_sd3_path, tmp_path, max_steps=1, crd_centering=centering, **SETTINGS)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "crd/implicit_reward" in h)
    # the policy is its old copy on the first pass: r_theta = 0, so Q = 0 and L = (C / beta) mean R^2
    assert log["crd/implicit_reward"] == 0.0 and log["crd/old_deviation"] == 0.0
    record = trainer.buffer[0]
    r = (record["advantages"].clamp(-5, 5) / 10 + 0.5).clamp(0, 1)
    if centering == "group":
        groups = record["group_ids"]
        means = torch.stack([r[groups == g].mean() for g in groups])
    else:
        means = r.mean().expand(4)
    assert len(set(record["group_ids"].tolist())) == 2  # two prompts: the centrings differ
    assert log["policy_loss"] == pytest.approx(float(5 * (r - means).square().mean()), rel=1e-5)


def test_rollouts_come_from_the_sampling_copy_and_the_copies_move_once_per_generation(tiny_sd3_path, tmp_path):
    frozen = dict(sampling_policy_decay_initial=1.0, sampling_policy_decay_rate=0.0, sampling_policy_decay_max=1.0)
    trained = make_trainer(tiny_sd3_path, tmp_path / "a", max_steps=3, learning_rate=1e-2, **frozen, **SETTINGS)
    trained.train()
    still = make_trainer(tiny_sd3_path, tmp_path / "b", max_steps=3, learning_rate=0.0, **frozen, **SETTINGS)
    still.train()
    following = make_trainer(tiny_sd3_path, tmp_path / "c", max_steps=3, learning_rate=1e-2, **SETTINGS)
    following.train()
    # a frozen sampling copy samples as the initial weights, however far the policy has moved
    assert logs(trained, "reward") == logs(still, "reward")
    assert logs(following, "reward")[0] == logs(still, "reward")[0]
    assert logs(following, "reward")[1:] != logs(still, "reward")[1:]  # a copy that follows the policy
    # one generation per optimizer step here: both copies move after every step, by their schedules
    assert logs(following, "crd/old_policy_decay") == pytest.approx([0.255, 0.26, 0.265])
    assert logs(following, "crd/sampling_policy_decay") == [0.0, 0.0, 0.0]  # a copy of the policy before step 75
    sampling = following.policy.copies["sampling"]
    for theta, copy in sampling.pairs:
        torch.testing.assert_close(copy, theta.detach())
    assert not all(torch.equal(o, t) for t, o in following.policy.old_policy.pairs)  # the old copy lags

    args = following.args  # a generation of two micro-batches, one optimizer step each: copies every other step
    args.steps_per_generation, args.gradient_accumulation_steps, args.num_iterations = 2, 1, 1
    assert [following._ends_generation(k) for k in (1, 2, 3, 4)] == [False, True, False, True]
    args.steps_per_generation, args.gradient_accumulation_steps, args.num_iterations = 2, 2, 2  # two passes
    assert [following._ends_generation(k) for k in (1, 2, 3, 4)] == [False, True, False, True]


def test_crd_config_refuses_gardo(tmp_path):
    with pytest.raises(ValueError, match="regularizer='gardo'.*CRDTrainer"):
        CRDConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=24, regularizer="gardo",
                  gardo_auxiliary_rewards=["a"])
