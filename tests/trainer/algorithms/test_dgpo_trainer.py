"""DGPOTrainer on the tiny SD3 pipeline: the first pass is on-policy, the loss is built from the drawn steps and the
shared group noise, the EMA reference follows its schedule and takes over the rollouts. The loss itself is checked by
hand in test_dgpo_loss.py; resume, export and two ranks on every family in test_trainer.py and test_model_families.py.
"""

from __future__ import annotations

import pytest
import torch
from support.trainer_cases import make_trainer, redness_reward
from transformers import TrainerCallback

from flowgrpo import DGPOConfig
from flowgrpo.trainer.algorithms.dgpo_trainer import DGPORollout

SETTINGS = dict(kind="dgpo", reward=redness_reward, per_device_train_batch_size=4, num_generations=2,
                dgpo_num_timesteps=2, dgpo_trunc_steps=2, beta=0.01, beta_dpo=10.0, dgpo_clip=0.05)


class TensorsAfterStep(TrainerCallback):
    """The trained LoRA tensors and the EMA reference's after each optimizer step (after the trainer's own end-of-step
    work, which runs first)."""

    def __init__(self, trainer):
        self.trainer, self.seen = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        pairs = self.trainer.policy.old_policy.pairs
        self.seen.append(([p.detach().clone() for p, _ in pairs], [o.detach().clone() for _, o in pairs]))


def logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_first_pass_is_on_policy_and_the_ema_reference_follows_its_schedule(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, max_steps=3, dgpo_switch_ema_ref=1, learning_rate=1e-2,
                           **SETTINGS)
    tensors = TensorsAfterStep(trainer)
    trainer.add_callback(tensors)
    trainer.train()
    first = next(h for h in trainer.state.log_history if "dgpo/dsm" in h)
    # the LoRA starts at zero: the policy is the base and the EMA reference, so D = D^ref, S_g = 0, w = 1/2,
    # nothing leaves the trust region and the KL is 0
    assert first["dgpo/dsm"] == first["dgpo/ref_dsm"]
    assert first["dgpo/group_score"] == 0.0 and first["dgpo/group_weight"] == 0.5
    assert first["clip_frac"] == 0.0 and first["kl"] == 0.0
    assert logs(trainer, "dgpo/ema_decay") == pytest.approx([0.0, 0.001, 0.002])  # min(0.3, 0.001 k), k from 0
    # the rollouts of a generation are the EMA reference's once more than dgpo_switch_ema_ref steps are done
    assert logs(trainer, "dgpo/rollouts_by_ema_reference") == [0.0, 0.0, 1.0]
    (theta1, ema1), (theta2, ema2), _ = tensors.seen
    for t, e in zip(theta1, ema1):  # decay 0 after the first step: a copy
        torch.testing.assert_close(e, t)
    for t1, t2, e in zip(theta1, theta2, ema2):
        torch.testing.assert_close(e, 0.001 * t1 + 0.999 * t2)
    assert any(not torch.equal(a, b) for a, b in zip(theta1, theta2))


def test_the_loss_reads_the_drawn_steps_and_one_noise_per_group(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, max_steps=1, steps_per_generation=2,
                           gradient_accumulation_steps=2, **SETTINGS)
    trainer.train()
    args = trainer.args
    first, second = trainer.buffer
    trainer._micro_step = 1
    batch = trainer._prepare_batch(first)
    steps = batch["dgpo_steps"]
    assert len(set(steps)) == 2 and set(steps) <= {0, 1, 2}
    trainer._micro_step = 2
    assert trainer._prepare_batch(second)["dgpo_steps"] == steps  # one draw per pass over the generation
    groups = first["group_ids"].tolist()
    assert len(set(groups)) == 2 and sorted(batch["group_index"].tolist()) == [0, 0, 1, 1]
    for noise in batch["noise"]:  # one eps per group and trained step
        for i in range(4):
            for k in range(4):
                assert torch.equal(noise[i], noise[k]) == (groups[i] == groups[k])
    assert not torch.equal(batch["noise"][0], batch["noise"][1])

    # the trainer's D^ref is the base's error at x_t = (1 - sigma_j) x0 + sigma_j eps of the drawn step j
    trainer._micro_step = 1
    out = trainer._batch_loss(trainer.model, batch, 0, True)
    j, noise, x0 = steps[0], batch["noise"][0], first["x0"]
    trainer.rollouts.adapter.set_timesteps(trainer.rollouts.scheduler, args.num_inference_steps, 64, 64, x0.device)
    sigma = trainer.rollouts.scheduler.sigmas[j]
    x_t = (1 - sigma) * x0 + sigma * noise
    t = (sigma * 1000).expand(4)
    with torch.no_grad(), trainer.model.disable_adapter():
        v_base = trainer.policy.velocity(trainer.model, x_t, t, first["embeds"], 1.0, 64, 64)
    ref_dsm = (v_base - (noise - x0)).square().mean(dim=(1, 2, 3))
    assert out.metrics["dgpo/ref_dsm"] == pytest.approx(float(ref_dsm.mean()), rel=1e-5)
    trainer._micro_step = 1
    trainer.args.dgpo_shared_noise = False
    private = trainer._prepare_batch(first)["noise"][0]
    assert not torch.equal(private[0], private[1]) and groups[0] == groups[1]


def test_the_ema_reference_is_kept_only_when_something_reads_it(tmp_path):
    def config(**kwargs):
        return DGPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=100, per_device_train_batch_size=16,
                          **kwargs)

    assert config().keeps_ema_reference  # the trust region reads it
    assert not config(dgpo_clip_dsm=False, dgpo_switch_ema_ref=100).keeps_ema_reference
    assert config(dgpo_clip_dsm=False, dgpo_switch_ema_ref=99).keeps_ema_reference  # the rollouts switch to it
    assert config(dgpo_clip_dsm=False, dgpo_use_ema_reference=True, dgpo_switch_ema_ref=100).keeps_ema_reference
    rollout = DGPORollout(config(dgpo_switch_ema_ref=50), keeps_ema_reference=True)
    assert [rollout.plan(0, step) for step in (0, 50, 51)] == [False, False, True]
    assert not DGPORollout(config(), keeps_ema_reference=False).plan(0, 1000)
    with pytest.raises(ValueError, match="regularizer='gardo'.*DGPOTrainer"):
        config(regularizer="gardo", gardo_auxiliary_rewards=["a"])
