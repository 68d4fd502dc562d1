"""The Flow-GRPO family's variants: window schedules, DPM-Solver++ 2M, KL estimators, GRPO-Guard, reward
aggregation and shared group noise; the math exactly, then each option inside the trainer (tiny SD3 / FLUX)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from support.callbacks import StopAfter
from transformers import TrainerCallback

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.schedulers import (
    FlowODESolver,
    compress_sigmas,
    dpmpp_2m_step,
    progressive_window_start,
    rollout_steps,
    sample_sde_window,
    scheduled_sde_window,
    sde_step_from_sigmas,
    solve_flow_ode,
    valid_window_starts,
)
from flowgrpo.trainer.algorithms.flow_grpo_loss import gaussian_kl, grpo_guard_log_ratio, kl_estimate
from flowgrpo.trainer.rollout.advantages import compute_group_advantages, compute_reward_advantages
from flowgrpo.trainer.seeds import seed_for

# ---------------------------------------------------------------------------------------------------------------------
# DPM-Solver++ 2M on a Gaussian problem with the exact velocity
# ---------------------------------------------------------------------------------------------------------------------

# Data x0 ~ N(MU, S^2), x_sigma = (1 - sigma) x0 + sigma eps. The marginal is N((1 - sigma) MU, var(sigma)),
# var = (1 - sigma)^2 S^2 + sigma^2; the exact velocity is E[eps - x0 | x], and the probability-flow ODE maps
# x_1 to MU + S x_1 at sigma = 0 (the monotone transport between the two Gaussians).
MU, S = 0.5, 1.0


def gaussian_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    alpha = 1.0 - sigma
    var = alpha**2 * S**2 + sigma**2
    centred = x - alpha * MU
    expected_eps = sigma / var * centred
    expected_x0 = MU + alpha * S**2 / var * centred
    return expected_eps - expected_x0


def schedule(n: int, shift: float = 1.0) -> torch.Tensor:
    t = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def ode_error(solver: str, n: int, shift: float = 1.0) -> float:
    x1 = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)
    x0 = solve_flow_ode(gaussian_velocity, x1.clone(), schedule(n, shift), solver)
    return float((x0 - (MU + S * x1)).abs().max())


def test_dpmpp_2m_is_second_order_and_euler_first_order():
    for shift in (1.0, 3.0):
        euler = [ode_error("euler", n, shift) for n in (64, 128, 256)]
        dpm = [ode_error("dpmpp_2m", n, shift) for n in (64, 128, 256)]
        euler_rates = [euler[i] / euler[i + 1] for i in range(2)]
        dpm_rates = [dpm[i] / dpm[i + 1] for i in range(2)]
        # Euler halves its error per doubling; DPM-Solver++ 2M quarters it (up to the log factor of the last few
        # steps, whose lambda-size does not shrink on these schedules: the measured rates are 3.0-3.7).
        assert all(1.85 < r < 2.15 for r in euler_rates), (shift, euler)
        assert dpm_rates[-1] > 3.2 and all(r > 2.9 for r in dpm_rates), (shift, dpm)
        assert dpm[-1] < euler[-1] / 10


def test_dpmpp_2m_matches_diffusers_multistep_scheduler():
    """An independent implementation: diffusers' DPMSolverMultistepScheduler (dpmsolver++, order 2, flow sigmas)."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", algorithm_type="dpmsolver++", solver_order=2,
        lower_order_final=True, flow_shift=3.0, final_sigmas_type="zero")
    scheduler.set_timesteps(12)
    x = torch.tensor([1.3, -0.4, 0.05], dtype=torch.float64)
    reference = x.clone()
    for i, t in enumerate(scheduler.timesteps):
        reference = scheduler.step(gaussian_velocity(reference, float(scheduler.sigmas[i])), t, reference).prev_sample
    ours = solve_flow_ode(gaussian_velocity, x.clone(), scheduler.sigmas, "dpmpp_2m")
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)
    assert (ours - solve_flow_ode(gaussian_velocity, x.clone(), scheduler.sigmas, "euler")).abs().max() > 1e-3


def test_dpmpp_2m_steps_first_order_cases():
    torch.manual_seed(0)
    x, v, history = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    euler = x + (0.6 - 0.8) * v
    # Without history, and on a final step to sigma = 0, the step is first order, which is exactly Euler.
    torch.testing.assert_close(dpmpp_2m_step(x, v, 0.8, 0.6).prev_sample, euler)
    torch.testing.assert_close(dpmpp_2m_step(x, v, 0.3, 0.0, history, 0.5).prev_sample, x - 0.3 * v)
    torch.testing.assert_close(dpmpp_2m_step(x, v, 0.8, 0.6, history, 0.9, first_order=True).prev_sample, euler)
    # From pure noise: finite, Euler; a step after a pure-noise step has h_prev = inf, so D1 = 0.
    torch.testing.assert_close(dpmpp_2m_step(x, v, 1.0, 0.9).prev_sample, x - 0.1 * v)
    torch.testing.assert_close(dpmpp_2m_step(x, v, 0.9, 0.8, history, 1.0).prev_sample, x - 0.1 * v)
    # With history: x_t = (s_t / s_s) x - alpha_t (exp(-h) - 1) (D0 + D1 / 2) written with lambdas.
    s_prev, s, t = 0.9, 0.7, 0.5
    lam = lambda sig: math.log((1 - sig) / sig)  # noqa: E731
    h, h_prev = lam(t) - lam(s), lam(s) - lam(s_prev)
    d0 = x - s * v
    expected = (t / s) * x - (1 - t) * (math.exp(-h) - 1) * (d0 + (d0 - history) / (h_prev / h) / 2)
    out = dpmpp_2m_step(x, v, s, t, history, s_prev)
    torch.testing.assert_close(out.prev_sample, expected)
    torch.testing.assert_close(out.data_prediction, d0)
    with pytest.raises(ValueError, match="sigma_next"):
        dpmpp_2m_step(x, v, 0.5, 0.7)
    with pytest.raises(ValueError, match="sigma_prev"):
        dpmpp_2m_step(x, v, 0.5, 0.3, history)
    with pytest.raises(ValueError, match="solver='rk4'"):
        FlowODESolver("rk4")


def test_compress_sigmas_and_rollout_steps():
    sigmas = schedule(8, shift=3.0).float()
    assert compress_sigmas(sigmas, 1.0) == sigmas.tolist()
    half = compress_sigmas(sigmas, 0.5)
    assert len(half) == 5 and half[0] == sigmas[0].item() and half[-1] == 0.0
    assert half[1] == pytest.approx(sigmas[2].item())  # integer positions fall on the schedule itself
    assert len(compress_sigmas(sigmas[:3], 0.4)) == 2  # max(1, int(2 * 0.4)) = 1 step
    assert all(a > b for a, b in zip(half, half[1:]))
    with pytest.raises(ValueError, match="ratio=0"):
        compress_sigmas(sigmas, 0)

    timesteps = sigmas[:-1] * 1000
    plain = rollout_steps(sigmas, timesteps, (2, 4))
    assert [s.index for s in plain] == list(range(8)) and [s.stochastic for s in plain] == [i in (2, 3) for i in range(8)]
    assert [s.final for s in plain] == [False] * 7 + [True]
    compressed = rollout_steps(sigmas, timesteps, (2, 4), compression_ratio=0.5)
    assert [s.index for s in compressed] == [0, 1, 2, 3, None, None]  # 4 steps after the window -> 2
    assert compressed[4].sigma == sigmas[4] and compressed[-1].sigma_next == 0.0 and compressed[-1].final
    assert compressed[4].sigma_next.item() == pytest.approx(sigmas[6].item())
    assert compressed[5].timestep.item() == pytest.approx(1000 * compressed[5].sigma.item())
    whole = rollout_steps(sigmas, timesteps, (0, 0), compression_ratio=0.25)  # a whole deterministic trajectory
    assert len(whole) == 2 and not any(s.stochastic for s in whole)


# ---------------------------------------------------------------------------------------------------------------------
# window schedules
# ---------------------------------------------------------------------------------------------------------------------

def test_progressive_schedule_is_exact():
    lo, hi = valid_window_starts(25, 4)  # MixGRPO: 25 steps, window of 4
    assert (lo, hi) == (0, 20)
    starts = [progressive_window_start(k, lo, hi, 25, 1, True) for k in range(0, 25 * 23, 25)]
    assert starts == list(range(21)) + [0, 1]  # one move every 25 steps, back to 0 after the last start
    assert [progressive_window_start(k, 0, 20, 25) for k in (0, 24, 25, 49, 50)] == [0, 0, 1, 1, 2]
    assert [progressive_window_start(k, 2, 7, 1, 2, True) for k in range(7)] == [2, 4, 6, 2, 4, 6, 2]
    assert [progressive_window_start(k, 2, 7, 1, 2, False) for k in range(6)] == [2, 4, 6, 7, 7, 7]
    assert [progressive_window_start(k, 1, 3, 2, 1, False) for k in range(10)] == [1, 1, 2, 2, 3, 3, 3, 3, 3, 3]
    # The formula: lo + (k // interval) * stride while it is a valid start.
    for k in range(200):
        raw = 3 + (k // 7) * 2
        if raw <= 15:
            assert progressive_window_start(k, 3, 15, 7, 2, True) == raw

    assert scheduled_sde_window("progressive", 60, 10, 2, [1, 6], shift_interval=20) == (4, 6)
    assert scheduled_sde_window("fixed", 60, 10, 2, [1, 6]) == (1, 3)
    assert scheduled_sde_window("progressive", 5, 10, 0) == (0, 9)  # no window: every step but the last
    # "random" keeps the draw of sample_sde_window with the same generator (existing runs are unchanged).
    for seed in range(5):
        a = scheduled_sde_window("random", 99, 10, 2, [0, 5], generator=torch.Generator().manual_seed(seed))
        assert a == sample_sde_window(10, 2, [0, 5], generator=torch.Generator().manual_seed(seed))
    with pytest.raises(ValueError, match="sde_window_strategy='sliding'.*'random', 'progressive', 'fixed'"):
        scheduled_sde_window("sliding", 0, 10, 2)
    with pytest.raises(ValueError, match="does not fit"):
        valid_window_starts(10, 4, [0, 8])


# ---------------------------------------------------------------------------------------------------------------------
# KL estimators, GRPO-Guard, reward aggregation
# ---------------------------------------------------------------------------------------------------------------------

def test_kl_estimators_zero_at_the_reference_and_unbiased_for_the_gaussian_kl():
    g = torch.Generator().manual_seed(0)
    shape = (4, 3, 8, 8)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    std = torch.tensor([0.1, 0.2, 0.3, 0.0], dtype=torch.float64)  # the last sample is deterministic
    x_next = mean + std.view(-1, 1, 1, 1) * torch.randn(shape, generator=g, dtype=torch.float64)
    for estimator in ("analytic", "k1", "k3", "velocity"):
        kl = kl_estimate(estimator, mean, mean.clone(), std, prev_sample=x_next, velocity=v, ref_velocity=v.clone())
        assert kl.shape == (4,) and torch.equal(kl, torch.zeros(4, dtype=torch.float64)), estimator

    # x' drawn from the policy: E[k1] = E[k3] = the analytic KL (per element, mean-reduced).
    n, s = 400_000, 0.5
    mu = torch.full((n, 1), 0.3, dtype=torch.float64)
    mu_ref = torch.full((n, 1), 0.1, dtype=torch.float64)
    draws = mu + s * torch.randn((n, 1), generator=g, dtype=torch.float64)
    analytic = gaussian_kl(mu, mu_ref, s)[0].item()
    assert analytic == pytest.approx(0.2**2 / (2 * s**2))
    assert kl_estimate("k1", mu, mu_ref, s, prev_sample=draws).mean().item() == pytest.approx(analytic, rel=0.03)
    k3 = kl_estimate("k3", mu, mu_ref, s, prev_sample=draws)
    assert k3.min() >= 0 and k3.mean().item() == pytest.approx(analytic, rel=0.03)
    torch.testing.assert_close(kl_estimate("analytic", mu[:3], mu_ref[:3], s), gaussian_kl(mu[:3], mu_ref[:3], s))
    assert kl_estimate("velocity", mean, mean, std, velocity=v, ref_velocity=v + 0.5)[0].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="prev_sample"):
        kl_estimate("k3", mu, mu_ref, s)
    with pytest.raises(ValueError, match="kl_estimator='k2'"):
        kl_estimate("k2", mu, mu_ref, s, prev_sample=draws)


def test_grpo_guard_log_ratio_is_the_exact_ratio_without_its_bias():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
    v_new = v_old + 0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    old = sde_step_from_sigmas(v_old, x, 0.8, 0.7, noise_level=0.7, generator=g)
    new = sde_step_from_sigmas(v_new, x, 0.8, 0.7, prev_sample=old.prev_sample, noise_level=0.7)
    std = old.std
    guard = grpo_guard_log_ratio(new.prev_sample_mean, old.prev_sample_mean, old.prev_sample, std)
    delta = new.prev_sample_mean - old.prev_sample_mean
    eps = (old.prev_sample - old.prev_sample_mean) / std.view(-1, 1, 1, 1)
    torch.testing.assert_close(guard, (eps * delta).mean(dim=(1, 2, 3)))
    # exact log ratio = guard / std - mean(delta^2) / (2 std^2): the guard drops the negative bias and the 1/std.
    exact = new.log_prob - old.log_prob
    torch.testing.assert_close(exact, guard / std - (delta**2).mean(dim=(1, 2, 3)) / (2 * std**2))
    assert torch.equal(grpo_guard_log_ratio(old.prev_sample_mean, old.prev_sample_mean, old.prev_sample, std),
                       torch.zeros(3, dtype=torch.float64))


def test_reward_aggregation_normalize_then_sum():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    easy = torch.tensor([10.0, 20.0, 30.0, 5.0, 5.0, 6.0])  # large spread
    hard = torch.tensor([0.0, 0.0, 0.01, 0.02, 0.0, math.nan])  # small spread; one image unscored
    weights = {"easy": 1.0, "hard": 2.0, "monitor": 0.0}
    per = {"easy": easy, "hard": hard, "monitor": torch.tensor([1e3, 0, 0, 0, 0, 0.0])}
    totals = easy + 2 * hard
    ws, ws_stats = compute_reward_advantages(totals, per, weights, groups, "group", 5.0, "weighted_sum")
    ref, ref_stats = compute_group_advantages(totals, groups, "group", 5.0)
    assert torch.equal(ws, ref) and ws_stats == ref_stats

    adv, stats = compute_reward_advantages(totals, per, weights, groups, "group", 5.0, "normalize_then_sum")
    a_easy, _ = compute_group_advantages(easy, groups, "group", math.inf)
    a_hard, _ = compute_group_advantages(hard, groups, "group", math.inf)
    torch.testing.assert_close(adv, (a_easy + 2 * a_hard).clamp(-5, 5))
    assert stats == ref_stats  # the statistics describe the training reward itself
    assert a_hard[5] == 0 and adv[5] == a_easy[5]  # unscored by "hard": only "easy" counts for that image
    # In the weighted sum the hard reward (a 1000x smaller spread) hardly moves the advantages of group 0; normalised
    # first, it weighs as much as the easy one.
    assert (ws[:3] - a_easy[:3]).abs().max() < 0.01
    assert a_hard[2] > 1 and a_easy[2] > 1 and adv[2] > 3
    with pytest.raises(ValueError, match="reward_aggregation='mean'"):
        compute_reward_advantages(totals, per, weights, groups, reward_aggregation="mean")


# ---------------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------------

def config(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4,
                num_generations=4, num_inference_steps=10, sde_window_size=2)
    base.update(kwargs)
    return FlowGRPOConfig(**base)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sde_window_strategy="sliding"), "sde_window_strategy='sliding'.*'random', 'progressive', 'fixed'"),
    (dict(ode_solver="heun"), "ode_solver='heun'.*'euler', 'dpmpp_2m'"),
    (dict(ode_solver="dpmpp_2m", ode_compression_ratio=0.0), r"ode_compression_ratio=0.0 must be in \(0, 1\]"),
    (dict(ode_solver="dpmpp_2m", ode_compression_ratio=1.5), r"ode_compression_ratio=1.5 must be in \(0, 1\]"),
    (dict(ode_compression_ratio=0.4), "ode_compression_ratio=0.4.*ode_solver='dpmpp_2m'"),
    (dict(ratio_normalization="clip"), "ratio_normalization='clip'.*'none', 'grpo_guard'"),
    (dict(kl_estimator="k2"), "kl_estimator='k2'.*'analytic', 'k1', 'k3', 'velocity'"),
    (dict(reward_aggregation="sum"), "reward_aggregation='sum'.*'weighted_sum', 'normalize_then_sum'"),
    (dict(sde_window_shift_interval=0), "sde_window_shift_interval=0 must be an integer >= 1"),
    (dict(sde_window_stride=0), "sde_window_stride=0 must be an integer >= 1"),
    (dict(sde_window_strategy="progressive", sde_window_size=0), "sde_window_strategy='progressive'.*sde_window_size"),
    (dict(sde_window_strategy="progressive", sde_window_size=4, sde_window_range=[0, 8]),
     r"sde_window_range=\[0, 8\].*does not fit"),
])
def test_bad_variant_values_fail_at_config_time(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **kwargs)


def test_window_range_defaults_per_strategy(tmp_path):
    assert config(tmp_path).sde_window_range == [0, 5]  # random: the first half, as before
    assert config(tmp_path, sde_window_strategy="progressive").sde_window_range == [0, 8]  # every window
    assert config(tmp_path, sde_window_strategy="fixed", sde_window_size=4).sde_window_range == [0, 6]


# ---------------------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------------------

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "three yellow stars", "a cat", "a dog"]


def brightness(prompts, images, **columns):
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


def redness(prompts, images, **columns):
    return [float((np.asarray(im, dtype=np.float32)[..., 0] / 255.0).mean()) for im in images]


def make_trainer(path, tmp_path, rewards=(brightness,), **kwargs):
    base = dict(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4, num_generations=4,
        resolution=64, num_inference_steps=6, eval_num_inference_steps=4, guidance_scale=1.0, max_steps=1,
        learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32", sde_window_size=2,
    )
    base.update(kwargs)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    return FlowGRPOTrainer(model=str(path), reward_funcs=list(rewards), args=FlowGRPOConfig(**base),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora)


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "ratio_mean" in h]


class CountRolloutForwards(TrainerCallback):
    """Counts transformer forwards in eval mode (the rollout's) during training."""

    def __init__(self, trainer):
        self.count = 0
        base = trainer.accelerator.unwrap_model(trainer.model).get_base_model()
        base.register_forward_pre_hook(lambda module, args: setattr(self, "count", self.count + (not module.training)))


# Every option at least once, and the interactions that matter together (DPM-Solver++ with compression and a
# progressive window under GRPO-Guard with each x'-based KL estimator; shared noise across micro-batches; two rewards
# normalised separately).
COMBINATIONS = {
    "flash-guard-k3": dict(sde_window_strategy="progressive", sde_window_range=[1, 3], ode_solver="dpmpp_2m",
                           ode_compression_ratio=0.5, ratio_normalization="grpo_guard", kl_estimator="k3", beta=0.04),
    "flash-guard-k1-cps-cfg": dict(sde_window_strategy="progressive", ode_solver="dpmpp_2m", ode_compression_ratio=0.4,
                                   ratio_normalization="grpo_guard", kl_estimator="k1", beta=0.04, sde_type="cps",
                                   guidance_scale=3.0),
    "fixed-velocity-same-noise": dict(sde_window_strategy="fixed", sde_window_range=[0, 1], kl_estimator="velocity",
                                      beta=0.1, same_noise_per_group=True, per_device_train_batch_size=2,
                                      gradient_accumulation_steps=2),
    "random-dpm-analytic-two-rewards": dict(ode_solver="dpmpp_2m", kl_estimator="analytic", beta=0.04,
                                            reward_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5],
                                            scale_rewards="group", rewards=(brightness, redness)),
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_first_pass_ratio_is_one_and_every_kl_estimator_zero(tiny_sd3_path, tmp_path, name):
    kwargs = dict(COMBINATIONS[name])
    rewards = kwargs.pop("rewards", (brightness,))
    trainer = make_trainer(tiny_sd3_path, tmp_path, rewards=rewards, **kwargs)
    counter = CountRolloutForwards(trainer)
    trainer.train()
    log = train_logs(trainer)[0]
    args = trainer.args
    assert abs(log["ratio_mean"] - 1.0) < 1e-6 and log["on_policy_ratio_max_dev"] < 1e-6, log
    assert log["kl"] == pytest.approx(0.0, abs=1e-10)
    assert log["clip_frac"] == 0.0 and math.isfinite(log["policy_loss"])
    window = trainer.buffer[0]["window"]
    assert log["sde_window_start"] == window[0]
    window_generator = torch.Generator().manual_seed(seed_for(args.seed, 0))
    assert window == scheduled_sde_window(args.sde_window_strategy, 0, args.num_inference_steps, args.sde_window_size,
                                          args.sde_window_range, generator=window_generator)
    # Rollout forwards (CFG runs both branches in one call): the steps up to the window's end, then the (possibly
    # compressed) rest, per micro-batch.
    after = max(1, int((args.num_inference_steps - window[1]) * args.ode_compression_ratio))
    assert counter.count == args.steps_per_generation * (window[1] + after)
    card = trainer._card_extra_sections()
    for field in ("sde_window_strategy", "sde_window_shift_interval", "sde_window_stride", "sde_window_roll_back",
                  "ode_solver", "ratio_normalization", "kl_estimator", "reward_aggregation", "same_noise_per_group"):
        assert f"{field}={getattr(args, field)}" in card, field
    assert f"ode_compression_ratio={args.ode_compression_ratio:g}" in card

    if args.same_noise_per_group:
        # One group of 4 split over two micro-batches: every member starts from the same x_1 (the window starts at
        # step 0, so the first stored latent is x_1), and the SDE noise still differs per member.
        first = torch.cat([b["latents"][:, 0] for b in trainer.buffer])
        nxt = torch.cat([b["next_latents"][:, 0] for b in trainer.buffer])
        assert first.shape[0] == 4 and all(torch.equal(first[0], f) for f in first[1:])
        assert not torch.equal(nxt[0], nxt[1]) and not torch.equal(nxt[0], nxt[2])
        # The noise is a function of (seed, generation, group): the same rows whatever the split.
        together = trainer.rollouts.strategy.group_initial_latents(trainer.adapter, torch.tensor([3, 3, 5, 5]), 7)
        torch.testing.assert_close(trainer.rollouts.strategy.group_initial_latents(trainer.adapter, torch.tensor([5, 3]), 7), together[[2, 0]])
        assert not torch.equal(together[0], together[2])


def test_grpo_guard_and_dpm_on_flux(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, sde_window_strategy="fixed", ode_solver="dpmpp_2m",
                           ode_compression_ratio=0.5, ratio_normalization="grpo_guard", kl_estimator="k3", beta=0.04)
    trainer.train()
    log = train_logs(trainer)[0]
    assert abs(log["ratio_mean"] - 1.0) < 1e-6 and log["kl"] == pytest.approx(0.0, abs=1e-10)


def test_sample_integrates_whole_trajectories_with_either_solver(tiny_sd3_path, tmp_path):
    """`_sample(..., window=(0, 0), ode_solver=...)` is a deterministic sampler over the rollout schedule."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, num_inference_steps=5)
    h, w = trainer.args.image_size
    embeds = trainer.adapter.encode_prompts(PROMPTS[:2], 16, trainer.accelerator.device)
    x1 = trainer.adapter.prepare_latents(2, h, w, torch.Generator().manual_seed(0), torch.device("cpu"), torch.float32)
    with trainer.policy.generation_context() as model:
        def velocity(x, sigma):
            t = torch.full((2,), sigma * 1000.0)
            return trainer.policy.velocity(model, x, t, embeds, 1.0, h, w)

        outputs = {}
        for solver in ("euler", "dpmpp_2m"):
            outputs[solver], _ = trainer.rollouts.sample(model, embeds, 5, 1.0, 0.0, (0, 0), None, record=False,
                                                 ode_solver=solver, initial_latents=x1)
            sigmas = trainer.rollouts.scheduler.sigmas.float()
            expected = solve_flow_ode(velocity, x1, sigmas, solver)
            torch.testing.assert_close(outputs[solver], expected, atol=1e-5, rtol=1e-5)
    assert (outputs["euler"] - outputs["dpmpp_2m"]).abs().max() > 1e-4



def test_progressive_schedule_survives_resume(tiny_sd3_path, tmp_path):
    # Valid starts 1 .. 3, one move per step: 1, 2, 3, back to 1.
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, num_inference_steps=5, sde_window_size=1,
                  sde_window_strategy="progressive", sde_window_range=[1, 4], sde_window_shift_interval=1,
                  ratio_normalization="grpo_guard", learning_rate=3e-3)
    interrupted = make_trainer(tiny_sd3_path, tmp_path, **common)
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    resumed = make_trainer(tiny_sd3_path, tmp_path, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    logs = train_logs(resumed)
    assert [round(x["step"]) for x in logs] == [1, 2, 3, 4]
    assert [x["sde_window_start"] for x in logs] == [1.0, 2.0, 3.0, 1.0]
    assert [x["sde_window_start"] for x in logs] == [
        progressive_window_start(k, 1, 3, shift_interval=1) for k in range(4)]
