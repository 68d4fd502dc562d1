"""AWM and Diffusion-DPO as their references run them, in the trainers (tiny random SD3 pipeline, CPU): AWM's
SA-Solver rollouts at AWM's own levels, every loss velocity at ``train_guidance_scale`` while the rollouts guide,
the raw and the EMA weights evaluated, DPO's K accumulated (t, eps) draws at logit-normal levels, its rollouts by the
reference and its reference refresh.

The sampler (`flowgrpo.schedulers.sa_solver`), the draws (`dpo_timesteps`) and the losses are checked against their
references by hand in their own tests; these check that the trainers use them as stated.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from datasets import Dataset
from support.trainer_cases import PROMPTS, make_trainer, redness_reward

from flowgrpo.schedulers.flow_matching import flow_matching_error, noised_sample
from flowgrpo.schedulers.sa_solver import sa_solver_sample, sa_solver_sigmas
from flowgrpo.trainer.algorithms.dpo_loss import dpo_loss
from flowgrpo.trainer.algorithms.dpo_timesteps import logit_normal_sigmas
from flowgrpo.trainer.data.datasets import INDEX_COLUMN


@contextmanager
def transformer_calls(trainer):
    """Every call of the base transformer: (rows, first timestep), in order."""
    calls = []
    module = trainer.pipeline.transformer
    module = module.get_base_model() if hasattr(module, "get_base_model") else module

    def hook(_module, args, kwargs):
        calls.append((kwargs["hidden_states"].shape[0], float(kwargs["timestep"][0])))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def rollout(trainer, prompts, seed):
    """One micro-batch of ``prompts`` through the trainer's rollout strategy, with a generator seeded ``seed``."""
    engine = trainer.rollouts
    with trainer.policy.generation_context() as model:
        embeds, rows = engine.encode_unique(prompts)
        group_ids = torch.arange(len(prompts)) // trainer.args.num_generations
        return engine.strategy.rollout(engine, model, embeds.index_select(rows), None,
                                       torch.Generator().manual_seed(seed), None, group_ids, 0)


# ---- AWM ------------------------------------------------------------------------------------------------------------

def test_awm_sa_solver_rollout_calls_the_model_at_awms_own_levels(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="awm", num_inference_steps=6, train_timesteps=2)
    args = trainer.args
    assert (args.rollout_solver, args.sa_solver_tau, args.sa_solver_noise_range) == ("sa_solver", 0.4, [0.3, 0.9])
    with transformer_calls(trainer) as calls:
        final, record = rollout(trainer, PROMPTS[:4], seed=3)
    scheduler = trainer.rollouts.scheduler
    levels = sa_solver_sigmas(scheduler.sigmas)
    # N model calls, CFG-free (one row per sample), at timestep sigma x 1000 of AWM's own levels (0.999 first)
    assert [rows for rows, _ in calls] == [4] * 6
    assert [t for _, t in calls] == pytest.approx((levels[:-1] * 1000).tolist(), rel=1e-6)
    assert calls[0][1] == pytest.approx(999.0)
    # the trained levels come from the scheduler's unmodified levels (the first is 1, not 0.999)
    torch.testing.assert_close(record["sigmas"][0], scheduler.sigmas[:-1].float())
    assert set(record["t"].tolist()) <= set(scheduler.sigmas[1:-1].tolist())
    # the same sample as SA-Solver run by hand on the policy's velocity, initial noise and step noise from the
    # rollout's generator in that order
    gen = torch.Generator().manual_seed(3)
    with trainer.policy.generation_context() as model:
        embeds, rows = trainer.rollouts.encode_unique(PROMPTS[:4])
        embeds = embeds.index_select(rows)
        latents = trainer.adapter.prepare_latents(4, 64, 64, gen, torch.device("cpu"), torch.float32)

        def velocity(x, sigma):
            return trainer.policy.velocity(model, x, torch.full((4,), sigma * 1000), embeds, 1.0, 64, 64)

        by_hand = sa_solver_sample(velocity, latents, levels, tau=0.4, noise_range=(0.3, 0.9), generator=gen).sample
    torch.testing.assert_close(final, by_hand, rtol=0, atol=0)
    # stochastic: another seed gives another sample, and tau 0 (deterministic) another from the same seed
    assert not torch.equal(rollout(trainer, PROMPTS[:4], seed=4)[0], final)
    trainer.args.sa_solver_tau = 0.0
    assert not torch.equal(rollout(trainer, PROMPTS[:4], seed=3)[0], final)


def test_awm_sa_solver_rollout_on_flux_trains_a_step(tiny_flux_path, tmp_path):
    """FLUX's packed latents, dynamic shift and guidance embedding: the SA-Solver rollout and a training step run."""
    trainer = make_trainer(tiny_flux_path, tmp_path, kind="awm", num_inference_steps=4, train_timesteps=2,
                           guidance_scale=1.0, reward=redness_reward)
    with transformer_calls(trainer) as calls:
        trainer.train()
    assert len(calls) == 4 + 1  # 4 SA-Solver model calls, one policy pass (beta 0: no reference)
    levels = sa_solver_sigmas(trainer.rollouts.scheduler.sigmas)[:-1]
    assert [t for _, t in calls[:4]] == pytest.approx(levels.tolist(), rel=1e-6)  # FLUX's transformer: sigma itself
    assert math.isfinite(next(h for h in trainer.state.log_history if "policy_loss" in h)["policy_loss"])


def test_awm_deterministic_rollout_sampler_is_the_engines_solver(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="awm", num_inference_steps=4, train_timesteps=2,
                           rollout_sampler="dpmpp_2m")
    final, record = rollout(trainer, PROMPTS[:2], seed=1)
    with trainer.policy.generation_context() as model:
        embeds, rows = trainer.rollouts.encode_unique(PROMPTS[:2])
        expected, _ = trainer.rollouts.final_sample(model, embeds.index_select(rows), torch.Generator().manual_seed(1),
                                                    None, "dpmpp_2m")
    torch.testing.assert_close(final, expected, rtol=0, atol=0)


@pytest.mark.parametrize("train_guidance, rows_per_sample", [(1.0, 1), (None, 2)])
def test_awm_loss_velocities_use_the_training_guidance(tiny_sd3_path, tmp_path, train_guidance, rows_per_sample):
    """Rollouts at CFG 3 (two rows per sample); the policy, reference and EMA-adapter passes at
    train_guidance_scale: 1 gives one row per (level, sample), null the rollouts' CFG (two)."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="awm", num_inference_steps=4, train_timesteps=2,
                           guidance_scale=3.0, train_guidance_scale=train_guidance, beta=0.01, ema_beta=1.0,
                           per_device_train_batch_size=4, num_generations=4, reward=redness_reward)
    with transformer_calls(trainer) as calls:
        trainer.train()
    rollout_rows, training_rows = 2 * 4, rows_per_sample * 2 * 4
    assert [rows for rows, _ in calls[:4]] == [rollout_rows] * 4  # 4 SA-Solver steps at CFG 3
    assert [rows for rows, _ in calls[4:]] == [training_rows] * 3  # policy, reference, EMA adapter
    log = next(h for h in trainer.state.log_history if "policy_loss" in h)
    assert log["ratio_mean"] == pytest.approx(1.0) and log["kl"] == pytest.approx(0.0, abs=1e-12)  # at the reference


def test_awm_evaluates_the_raw_and_the_ema_weights(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="awm", num_inference_steps=4, train_timesteps=2,
                           eval_num_inference_steps=3, use_ema=True, ema_decay=0.9, learning_rate=5e-2, max_steps=2,
                           reward=redness_reward)
    trainer.train()
    eval_set = Dataset.from_dict({"prompt": PROMPTS[:2]})
    metrics = trainer.evaluate(eval_set)
    for prefix in ("eval", "eval_raw"):
        assert f"{prefix}_reward" in metrics and f"{prefix}_rewards/redness_reward/mean" in metrics
    assert metrics["eval_reward"] != metrics["eval_raw_reward"]
    ema = trainer.policy.ema
    trainer.policy.ema = None  # no EMA: the weights evaluated are the raw ones
    try:
        raw = trainer.evaluate(eval_set)
        with ema.swapped_in(trainer.policy.trainable_parameters()):
            averaged = trainer.evaluate(eval_set)
    finally:
        trainer.policy.ema = ema
    assert "eval_raw_reward" not in raw
    assert raw["eval_reward"] == pytest.approx(metrics["eval_raw_reward"], rel=1e-6)
    assert averaged["eval_reward"] == pytest.approx(metrics["eval_reward"], rel=1e-6)
    trainer.args.eval_raw_weights = False
    trainer.evaluator.raw_weights = trainer._eval_raw_weights()
    assert "eval_raw_reward" not in trainer.evaluate(eval_set)


def test_other_trainers_evaluate_only_the_ema(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, use_ema=True, eval_num_inference_steps=2)
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:1]}))
    assert "eval_reward" in metrics and not any(k.startswith("eval_raw") for k in metrics)


# ---- Diffusion-DPO --------------------------------------------------------------------------------------------------

def dpo_trainer(path, tmp_path, **kwargs):
    settings = dict(kind="diffusion_dpo", dpo_mode="online", num_inference_steps=3, per_device_train_batch_size=8,
                    num_generations=4, reward=redness_reward)
    return make_trainer(path, tmp_path, **{**settings, **kwargs})


def test_dpo_draws_k_levels_per_pair_through_the_schedulers_shift(tiny_sd3_path, tmp_path):
    trainer = dpo_trainer(tiny_sd3_path, tmp_path, dpo_num_noise_draws=3)
    assert trainer._loss_parts({}) == 3
    record = trainer._generate([{"prompt": p, INDEX_COLUMN: i // 4} for i, p in enumerate(PROMPTS)])[0]
    batch = trainer._prepare_batch(record)
    pairs = batch["pairs"]
    assert pairs == 2 and batch["levels"].shape == (3, 2 * pairs) and batch["eps"].shape[:2] == (3, 2 * pairs)
    # a pair shares each draw's level and noise; the draws differ
    torch.testing.assert_close(batch["levels"][:, :pairs], batch["levels"][:, pairs:])
    torch.testing.assert_close(batch["eps"][:, :pairs], batch["eps"][:, pairs:])
    assert not torch.equal(batch["eps"][0], batch["eps"][1])
    # logit-normal through the scheduler's own shift (the tiny pipeline's 3.0), drawn first from the step's generator
    from flowgrpo.trainer.seeds import seed_for

    shift = trainer.rollouts.scheduler.config.shift
    assert shift == 3.0
    gen = torch.Generator().manual_seed(seed_for(0, 4099, trainer._micro_step, 0))
    torch.testing.assert_close(batch["levels"][:, :pairs], logit_normal_sigmas(3 * pairs, shift, gen).reshape(3, 2))


def test_dpo_accumulated_draws_give_the_gradient_of_the_mean_over_draws_and_pairs(tiny_sd3_path, tmp_path):
    """Each draw is one backward part: their sum (each 1 / K) is the gradient of dpo_loss on all K x P terms, the
    velocities taken without CFG while the rollouts guide."""
    trainer = dpo_trainer(tiny_sd3_path, tmp_path, dpo_num_noise_draws=3, guidance_scale=3.0, beta_dpo=500.0)
    record = trainer._generate([{"prompt": p, INDEX_COLUMN: i // 4} for i, p in enumerate(PROMPTS)])[0]
    batch = trainer._prepare_batch(record)
    model = trainer.model
    params = trainer.policy.trainable_parameters()
    with transformer_calls(trainer) as calls:
        for part in range(3):
            (trainer._batch_loss(model, batch, part, True).loss / 3).backward()
    accumulated = [p.grad.clone() for p in params]
    assert [rows for rows, _ in calls] == [4] * 6  # 2 pairs x 2 samples, one row each: no CFG; policy + reference
    for p in params:
        p.grad = None
    errors, ref_errors = [], []
    for part in range(3):
        x_t = noised_sample(batch["x0_pairs"], batch["eps"][part], batch["levels"][part])
        t = batch["levels"][part] * 1000
        v = trainer.policy.velocity(model, x_t, t, batch["pair_embeds"], 1.0, 64, 64)
        v_ref = trainer.policy.reference_velocity(model, x_t, t, batch["pair_embeds"], 64, 64, guidance_scale=1.0)
        errors.append(flow_matching_error(v, batch["eps"][part], batch["x0_pairs"]))
        ref_errors.append(flow_matching_error(v_ref, batch["eps"][part], batch["x0_pairs"]))
    e, r = torch.stack(errors), torch.stack(ref_errors)
    stacked = dpo_loss(e[:, :2].flatten(), e[:, 2:].flatten(), r[:, :2].flatten(), r[:, 2:].flatten(), 500.0)
    stacked.loss.backward()
    for got, p in zip(accumulated, params):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-8)


def test_dpo_logs_the_saturation_diagnostics(tiny_sd3_path, tmp_path):
    trainer = dpo_trainer(tiny_sd3_path, tmp_path, dpo_num_noise_draws=2, max_steps=2, learning_rate=5e-2,
                          beta_dpo=100.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dpo/pairs" in h]
    assert len(logs) == 2
    for log in logs:
        assert {"dpo/accuracy", "dpo/inside", "dpo/abs_inside", "dpo/gradient_weight"} <= set(log)
        assert log["dpo/abs_inside"] >= abs(log["dpo/inside"]) and 0 < log["dpo/gradient_weight"] < 1
    assert logs[0]["dpo/abs_inside"] == 0.0 and logs[0]["dpo/gradient_weight"] == 0.5  # at the reference
    assert logs[1]["dpo/abs_inside"] > 0


def test_dpo_rollouts_by_the_reference_are_the_base_models(tiny_sd3_path, tmp_path):
    """dpo_rollout_policy: reference samples with the frozen base whatever the policy has learned (flow_grpo's DPO);
    the LoRA starts as the identity, so a fresh trainer's policy rollout is the base model's."""
    trained = dpo_trainer(tiny_sd3_path, tmp_path / "a", dpo_rollout_policy="reference", learning_rate=5e-2,
                          max_steps=1)
    trained.train()
    fresh = dpo_trainer(tiny_sd3_path, tmp_path / "b")
    by_reference, _ = rollout(trained, PROMPTS[:4], seed=2)
    torch.testing.assert_close(by_reference, rollout(fresh, PROMPTS[:4], seed=2)[0], rtol=0, atol=1e-6)
    trained.rollouts.strategy.by_reference = False
    assert not torch.allclose(rollout(trained, PROMPTS[:4], seed=2)[0], by_reference, atol=1e-4)


@pytest.mark.parametrize("sync", [True, False])
def test_dpo_reference_refresh_restarts_the_margin(tiny_sd3_path, tmp_path, sync):
    """OnlineDPO: with sync_ref_model (every step here, alpha 1) the reference is the policy after each step, so the
    next step starts at inside = 0; without it the margin keeps growing."""
    trainer = dpo_trainer(tiny_sd3_path, tmp_path, sync_ref_model=sync, ref_model_sync_steps=1,
                          ref_model_mixup_alpha=1.0, max_steps=2, learning_rate=5e-2, beta_dpo=100.0)
    trainer.train()
    second = [h for h in trainer.state.log_history if "dpo/pairs" in h][1]
    if sync:
        assert second["dpo/abs_inside"] == pytest.approx(0.0, abs=1e-6) and second["loss"] == pytest.approx(0.6931,
                                                                                                          abs=1e-4)
    else:
        assert second["dpo/abs_inside"] > 1e-3
