"""FlowMatchSDEScheduler and the SDE step functions: formulas, distributions, windows, KL, pipeline drop-in."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from flowgrpo.schedulers import (
    FlowMatchSDEScheduler,
    FlowMatchSDESchedulerOutput,
    sample_sde_window,
    sde_step_from_sigmas,
    sde_step_with_logprob,
)
from flowgrpo.trainer.algorithms.flow_grpo_loss import gaussian_kl


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are small: one intra-op thread is faster than two on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------------------------------------------
# An independent float64 (numpy) implementation of the formulas in docs / DESIGN section 2.
# ----------------------------------------------------------------------------------------------------------------


def reference_step(x, v, sigma, sigma_next, a, sde_type, sigma_max):
    """Per-sample sigma arrays of shape (batch,); returns mean, std (batch,)."""
    x, v = np.asarray(x, np.float64), np.asarray(v, np.float64)
    shape = (-1,) + (1,) * (x.ndim - 1)
    s = np.asarray(sigma, np.float64).reshape(shape)
    sn = np.asarray(sigma_next, np.float64).reshape(shape)
    dt = sn - s
    if sde_type == "sde":
        denom = np.where(s == 1, sigma_max, s)
        sigma_t = a * np.sqrt(s / (1 - denom))
        mean = x * (1 + sigma_t**2 * dt / (2 * s)) + v * (1 + sigma_t**2 * (1 - s) / (2 * s)) * dt
        std = sigma_t * np.sqrt(-dt)
    else:
        std = sn * np.sin(a * np.pi / 2)
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = (1 - sn) * x0_hat + np.sqrt(sn**2 - std**2) * x1_hat
    return mean, std.reshape(-1)


def reference_log_prob(x_next, mean, std, reduction="mean"):
    std_b = std.reshape((-1,) + (1,) * (mean.ndim - 1))
    lp = -((x_next - mean) ** 2) / (2 * std_b**2) - np.log(std_b) - 0.5 * np.log(2 * np.pi)
    axes = tuple(range(1, lp.ndim))
    return lp.mean(axis=axes) if reduction == "mean" else lp.sum(axis=axes)


def make_scheduler(num_steps=10, shift=3.0, **kwargs):
    sched = FlowMatchSDEScheduler(shift=shift, **kwargs)
    sched.set_timesteps(num_steps)
    return sched


# ----------------------------------------------------------------------------------------------------------------
# step formulas
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_step_matches_independent_float64_formulas(sde_type, noise_level):
    num_steps = 12
    sched = make_scheduler(num_steps)
    sigmas = sched.sigmas.double().numpy()
    # Every step of the schedule (including sigma == 1 and the step to sigma' = 0 for "sde"), one per sample.
    steps = np.arange(num_steps) if sde_type == "sde" else np.arange(num_steps - 1)
    batch = len(steps)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, 6, 5, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, 4, 6, 5, generator=gen, dtype=torch.float64)
    x_next = torch.randn(batch, 4, 6, 5, generator=gen, dtype=torch.float64)
    timesteps = sched.timesteps[torch.from_numpy(steps)]

    mean_ref, std_ref = reference_step(x.numpy(), v.numpy(), sigmas[steps], sigmas[steps + 1], noise_level, sde_type,
                                       sigmas[1])
    for reduction in ("mean", "sum"):
        out = sde_step_with_logprob(sched, v, timesteps, x, prev_sample=x_next, noise_level=noise_level,
                                    sde_type=sde_type, log_prob_reduction=reduction)
        assert isinstance(out, FlowMatchSDESchedulerOutput)
        assert out.log_prob.shape == (batch,) and out.std.shape == (batch,)
        assert out.log_prob.dtype == torch.float64
        np.testing.assert_allclose(out.prev_sample_mean.numpy(), mean_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out.std.numpy(), std_ref, rtol=1e-10, atol=1e-12)
        lp_ref = reference_log_prob(x_next.numpy(), mean_ref, std_ref, reduction)
        np.testing.assert_allclose(out.log_prob.numpy(), lp_ref, rtol=1e-9, atol=1e-9)
        assert torch.equal(out.prev_sample, x_next)

    # The same through the sigma-level function, with the schedule's sigmas given per sample.
    out = sde_step_from_sigmas(v, x, torch.from_numpy(sigmas[steps]), torch.from_numpy(sigmas[steps + 1]),
                               prev_sample=x_next, noise_level=noise_level, sde_type=sde_type,
                               sigma_max_fallback=float(sigmas[1]))
    np.testing.assert_allclose(out.prev_sample_mean.numpy(), mean_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.log_prob.numpy(), reference_log_prob(x_next.numpy(), mean_ref, std_ref),
                               rtol=1e-9, atol=1e-9)

    # Sampling path: prev_sample = mean + std * z, and its log-prob is the density of that sample.
    sampled = sde_step_with_logprob(sched, v, timesteps, x, noise_level=noise_level, sde_type=sde_type,
                                    generator=torch.Generator().manual_seed(7))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).numpy()
    expected = mean_ref + std_ref.reshape(-1, 1, 1, 1) * z
    np.testing.assert_allclose(sampled.prev_sample.numpy(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sampled.log_prob.numpy(), reference_log_prob(expected, mean_ref, std_ref),
                               rtol=1e-9, atol=1e-9)


def test_float32_step_close_to_float64_reference_and_differentiable():
    sched = make_scheduler(10)
    sigmas = sched.sigmas.double().numpy()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 8, 8, generator=gen)
    v = torch.randn(10, 3, 8, 8, generator=gen, requires_grad=True)
    out = sde_step_with_logprob(sched, v, sched.timesteps, x, noise_level=0.7, generator=gen)
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    mean_ref, std_ref = reference_step(x.numpy(), v.detach().numpy(), sigmas[:-1], sigmas[1:], 0.7, "sde", sigmas[1])
    np.testing.assert_allclose(out.prev_sample_mean.detach().numpy(), mean_ref, rtol=1e-4, atol=1e-5)
    # Last step (sigma' = 0) is still stochastic for "sde".
    np.testing.assert_allclose(out.std.numpy(), std_ref, rtol=1e-5)
    lp_ref = reference_log_prob(out.prev_sample.detach().double().numpy(), mean_ref, std_ref)
    np.testing.assert_allclose(out.log_prob.detach().numpy(), lp_ref, rtol=1e-4, atol=1e-4)
    # Gradients reach the model output through the mean only (the sample is a constant in its own density).
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    # Recomputing the log-prob of the stored sample (the training path) gives exactly the sampled value.
    x_next = out.prev_sample.detach()
    v2 = v.detach().clone().requires_grad_(True)
    again = sde_step_with_logprob(sched, v2, sched.timesteps, x, prev_sample=x_next, noise_level=0.7)
    assert torch.equal(again.log_prob.detach(), out.log_prob.detach())  # on-policy ratio exactly 1


def test_cps_reference_log_prob_is_opt_in():
    sched = make_scheduler(8)
    gen = torch.Generator().manual_seed(0)
    x, v, x_next = (torch.randn(7, 2, 4, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    t = sched.timesteps[:7]
    exact = sde_step_with_logprob(sched, v, t, x, prev_sample=x_next, sde_type="cps", noise_level=0.5)
    ref = sde_step_with_logprob(sched, v, t, x, prev_sample=x_next, sde_type="cps", noise_level=0.5,
                                cps_log_prob="reference")
    expected_ref = -((x_next - ref.prev_sample_mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(ref.log_prob, expected_ref)
    assert not torch.allclose(exact.log_prob, ref.log_prob)
    # The scheduler option selects it for the scheduler-level helper.
    ref_sched = make_scheduler(8, sde_type="cps", cps_log_prob="reference")
    via_config = sde_step_with_logprob(ref_sched, v, t, x, prev_sample=x_next, sde_type="cps", noise_level=0.5)
    torch.testing.assert_close(via_config.log_prob, expected_ref)


def test_ode_and_deterministic_steps_give_zero_log_prob_and_no_nan():
    sched = make_scheduler(6)
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(6, 4, 4, generator=gen), torch.randn(6, 4, 4, generator=gen)
    sig, sig_next = sched.sigmas[:-1], sched.sigmas[1:]
    ode = sde_step_from_sigmas(v, x, sig, sig_next, noise_level=0.0)
    torch.testing.assert_close(ode.prev_sample, x + (sig_next - sig).view(-1, 1, 1) * v, rtol=0, atol=0)
    assert torch.equal(ode.log_prob, torch.zeros(6)) and torch.equal(ode.std, torch.zeros(6))
    # "cps" stepping to sigma' = 0 has std 0: deterministic, log-prob 0, finite.
    cps_last = sde_step_from_sigmas(v, x, sig, sig_next, noise_level=0.7, sde_type="cps")
    assert cps_last.std[-1] == 0 and cps_last.log_prob[-1] == 0
    assert torch.isfinite(cps_last.log_prob).all() and torch.isfinite(cps_last.prev_sample).all()
    # "sde" at sigma == 1 without a fallback uses sigma' in the denominator: same as the schedule's sigmas[1].
    first_default = sde_step_from_sigmas(v[:1], x[:1], 1.0, sig_next[0], prev_sample=x[:1])
    first_given = sde_step_from_sigmas(v[:1], x[:1], 1.0, sig_next[0], prev_sample=x[:1],
                                       sigma_max_fallback=float(sched.sigmas[1]))
    torch.testing.assert_close(first_default.log_prob, first_given.log_prob)
    assert torch.isfinite(first_default.log_prob).all() and first_default.std[0] > 0
    # Zero step size (sigma' == sigma) is deterministic too.
    flat = sde_step_from_sigmas(v, x, 0.5, 0.5, noise_level=0.7)
    assert torch.equal(flat.std, torch.zeros(6)) and torch.equal(flat.log_prob, torch.zeros(6))


def test_dtypes_bf16_fp16_float64():
    sched = make_scheduler(10)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 16, 8, 8, generator=gen) * 3)
    v = torch.randn(4, 16, 8, 8, generator=gen) * 3
    t = sched.timesteps[:4]
    for dtype in (torch.bfloat16, torch.float16):
        out = sde_step_with_logprob(sched, v.to(dtype), t, x.to(dtype), generator=gen)
        assert out.prev_sample.dtype == dtype
        assert out.log_prob.dtype == torch.float32 and out.prev_sample_mean.dtype == torch.float32
        assert torch.isfinite(out.log_prob).all()
        # The density is that of the returned (rounded) sample: recomputing it from the stored sample is exact.
        again = sde_step_with_logprob(sched, v.to(dtype), t, x.to(dtype), prev_sample=out.prev_sample)
        assert torch.equal(again.log_prob, out.log_prob)
    out64 = sde_step_with_logprob(sched, v.double(), t, x.double(), generator=gen)
    assert out64.log_prob.dtype == torch.float64 and out64.prev_sample.dtype == torch.float64


# ----------------------------------------------------------------------------------------------------------------
# distributions
# ----------------------------------------------------------------------------------------------------------------


def _gaussian_velocity(x, sigma, mu, s):
    """E[eps - x0 | x_sigma = x] for x0 ~ N(mu, s^2), eps ~ N(0, 1), x_sigma = (1 - sigma) x0 + sigma eps."""
    a = 1 - sigma
    var = a * a * s * s + sigma * sigma
    return -mu + (sigma - a * s * s) / var * (x - a * mu)


def test_sde_sampling_preserves_gaussian_marginals():
    mu, s, num_steps, n = 1.5, 0.5, 50, 200_000
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
    sched.set_timesteps(num_steps)
    sigmas = sched.sigmas.double()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    for i in range(num_steps):
        v = _gaussian_velocity(x, sigmas[i], mu, s)
        # SDE on every step but the last, as in plain Flow-GRPO.
        a = 0.7 if i < num_steps - 1 else 0.0
        x = sde_step_from_sigmas(v, x, sigmas[i], sigmas[i + 1], noise_level=a, generator=gen,
                                 sigma_max_fallback=sigmas[1]).prev_sample
        sn = float(sigmas[i + 1])
        if i in (39, 44):  # late intermediate marginals (early ones carry the first big step's error): N((1 - sigma) mu, (1 - sigma)^2 s^2 + sigma^2)
            assert abs(float(x.mean()) / ((1 - sn) * mu) - 1) < 0.02
            assert abs(float(x.std()) / math.sqrt((1 - sn) ** 2 * s * s + sn * sn) - 1) < 0.02
    assert abs(float(x.mean()) / mu - 1) < 0.02
    assert abs(float(x.std()) / s - 1) < 0.02


@pytest.mark.parametrize("noise_level", [0.5, 0.9])
def test_cps_keeps_noise_level_equal_to_schedule_on_point_mass(noise_level):
    # Point-mass data x0 = c (one constant per sample); the exact velocity is v = (x - c) / sigma.
    num_steps, batch, dim = 10, 8, 20_000
    sched = make_scheduler(num_steps)
    sigmas = sched.sigmas.double()
    gen = torch.Generator().manual_seed(0)
    c = torch.linspace(-2.0, 2.0, batch, dtype=torch.float64).view(batch, 1)
    x = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    for i in range(num_steps - 1):
        v = (x - c) / sigmas[i]
        x = sde_step_from_sigmas(v, x, sigmas[i], sigmas[i + 1], noise_level=noise_level, sde_type="cps",
                                 generator=gen).prev_sample
        sn = float(sigmas[i + 1])
        residual = x - (1 - sn) * c  # = sigma' * (standard normal noise) if coefficients are preserved
        noise_level_per_sample = residual.std(dim=1) / sn
        assert torch.allclose(noise_level_per_sample, torch.ones(batch, dtype=torch.float64), atol=0.03), (
            i, noise_level_per_sample)
        assert residual.mean(dim=1).abs().max() < 0.03 * sn


def test_sampled_noise_is_standard_normal():
    sched = make_scheduler(10)
    n = 100_000
    x = torch.zeros(n, 1)
    v = torch.zeros(n, 1)
    for sde_type, t in (("sde", sched.timesteps[0]), ("sde", sched.timesteps[5]), ("cps", sched.timesteps[3])):
        out = sde_step_with_logprob(sched, v, t, x, sde_type=sde_type, noise_level=0.7,
                                    generator=torch.Generator().manual_seed(11))
        z = ((out.prev_sample.double() - out.prev_sample_mean.double()) / out.std.double().view(-1, 1)).flatten()
        assert abs(float(z.mean())) < 0.015
        assert abs(float(z.var()) - 1) < 0.02
        assert abs(float((z**3).mean())) < 0.05  # skewness
        assert abs(float((z**4).mean()) - 3) < 0.1  # kurtosis
        # Kolmogorov-Smirnov distance to the standard normal CDF (critical value at 1% ~ 1.63 / sqrt(n)).
        zs, _ = torch.sort(z)
        cdf = 0.5 * (1 + torch.erf(zs / math.sqrt(2)))
        ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
        ks = float(torch.maximum((ecdf - cdf).abs(), (ecdf - 1 / n - cdf).abs()).max())
        assert ks < 1.63 / math.sqrt(n)


def test_generators_seed_and_lists():
    sched = make_scheduler(10)
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    t = sched.timesteps[2]
    a = sde_step_with_logprob(sched, v, t, x, generator=torch.Generator().manual_seed(5))
    b = sde_step_with_logprob(sched, v, t, x, generator=torch.Generator().manual_seed(5))
    c = sde_step_with_logprob(sched, v, t, x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
    assert not torch.equal(a.prev_sample, c.prev_sample)
    # One generator per sample: sample i's noise comes from generator i alone.
    gens = [torch.Generator().manual_seed(100 + i) for i in range(3)]
    listed = sde_step_with_logprob(sched, v, t, x, generator=gens)
    for i in range(3):
        single = sde_step_with_logprob(sched, v[i:i + 1], t, x[i:i + 1], generator=torch.Generator().manual_seed(100 + i))
        assert torch.equal(listed.prev_sample[i:i + 1], single.prev_sample)
    with pytest.raises(ValueError, match="list of 2 generators for a batch of 3"):
        sde_step_with_logprob(sched, v, t, x, generator=gens[:2])


def test_per_sample_timesteps_vectorised_equals_loop():
    sched = make_scheduler(10)
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([0, 3, 3, 7, 9, 1])
    x, v = torch.randn(6, 2, 3, 3, generator=gen), torch.randn(6, 2, 3, 3, generator=gen)
    for sde_type in ("sde", "cps"):
        gens = [torch.Generator().manual_seed(i) for i in range(6)]
        batched = sde_step_with_logprob(sched, v, sched.timesteps[idx], x, sde_type=sde_type, generator=gens)
        for i in range(6):
            one = sde_step_with_logprob(sched, v[i:i + 1], sched.timesteps[idx[i]], x[i:i + 1], sde_type=sde_type,
                                        generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(batched.prev_sample[i:i + 1], one.prev_sample, rtol=0, atol=0)
            torch.testing.assert_close(batched.log_prob[i:i + 1], one.log_prob, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(batched.std[i:i + 1], one.std, rtol=0, atol=0)
        # Recomputing with the stored samples matches too (the training path).
        again = sde_step_with_logprob(sched, v, sched.timesteps[idx], x, prev_sample=batched.prev_sample,
                                      sde_type=sde_type)
        assert torch.equal(again.log_prob, batched.log_prob)


def test_argument_validation():
    sched = make_scheduler(10)
    x = v = torch.zeros(2, 3)
    t = sched.timesteps[1]
    with pytest.raises(ValueError, match="sde_type='ddim'"):
        sde_step_with_logprob(sched, v, t, x, sde_type="ddim")
    with pytest.raises(ValueError, match="noise_level=-0.1"):
        sde_step_from_sigmas(v, x, 0.5, 0.4, noise_level=-0.1)
    with pytest.raises(ValueError, match="noise_level=1.5.*cps"):
        sde_step_from_sigmas(v, x, 0.5, 0.4, noise_level=1.5, sde_type="cps")
    with pytest.raises(ValueError, match="log_prob_reduction='max'"):
        sde_step_from_sigmas(v, x, 0.5, 0.4, log_prob_reduction="max")
    with pytest.raises(ValueError, match="cps_log_prob='approx'"):
        sde_step_from_sigmas(v, x, 0.5, 0.4, cps_log_prob="approx")
    with pytest.raises(ValueError, match="sigma must be a scalar or hold one value per sample"):
        sde_step_from_sigmas(v, x, torch.tensor([0.5, 0.4, 0.3]), 0.2)
    with pytest.raises(ValueError, match="model_output has shape"):
        sde_step_from_sigmas(torch.zeros(2, 4), x, 0.5, 0.4)
    with pytest.raises(ValueError, match="timestep 123.4 is not one of the scheduler's timesteps"):
        sde_step_with_logprob(sched, v, 123.4, x)
    with pytest.raises(ValueError, match="one timestep per sample"):
        sde_step_with_logprob(sched, v, sched.timesteps[:3], x)
    with pytest.raises(ValueError, match="set_timesteps"):
        sde_step_with_logprob(FlowMatchEulerDiscreteScheduler(), v, 500.0, x)
    with pytest.raises(ValueError, match="sde_type='ode'"):
        FlowMatchSDEScheduler(sde_type="ode")
    with pytest.raises(ValueError, match="noise_level=-1"):
        FlowMatchSDEScheduler(noise_level=-1)
    with pytest.raises(ValueError, match="log_prob_reduction='median'"):
        FlowMatchSDEScheduler(log_prob_reduction="median")
    with pytest.raises(ValueError, match="sde_window_size=-2"):
        FlowMatchSDEScheduler(sde_window_size=-2)
    with pytest.raises(ValueError, match=r"sde_window_range=\[3, 3\]"):
        FlowMatchSDEScheduler(sde_window_range=[3, 3])
    with pytest.raises(ValueError, match="reduction='none'"):
        gaussian_kl(x, x, 1.0, reduction="none")


# ----------------------------------------------------------------------------------------------------------------
# windows
# ----------------------------------------------------------------------------------------------------------------


def test_sample_sde_window():
    assert sample_sde_window(10, 0) == (0, 9)
    assert sample_sde_window(1, 0) == (0, 0)
    gen = torch.Generator().manual_seed(0)
    starts = [sample_sde_window(10, 3, [1, 5], generator=gen)[0] for _ in range(2000)]
    assert set(starts) == {1, 2, 3, 4}
    counts = np.bincount(starts, minlength=5)[1:]
    assert (np.abs(counts / 2000 - 0.25) < 0.04).all()  # uniform
    for start, end in (sample_sde_window(10, 3, generator=gen) for _ in range(200)):
        assert end - start == 3 and 0 <= start and end <= 9  # default range [0, 7): windows end before the last step
    assert {sample_sde_window(10, 3, generator=gen)[0] for _ in range(500)} == set(range(7))
    a = sample_sde_window(20, 4, [0, 10], generator=torch.Generator().manual_seed(3))
    b = sample_sde_window(20, 4, [0, 10], generator=torch.Generator().manual_seed(3))
    assert a == b
    with pytest.raises(ValueError, match=r"window_range=\[2, 8\] with window_size=3 does not fit num_inference_steps=10"):
        sample_sde_window(10, 3, [2, 8])
    with pytest.raises(ValueError, match="window_size=10 does not fit num_inference_steps=10"):
        sample_sde_window(10, 10)
    with pytest.raises(ValueError, match="window_size=-1"):
        sample_sde_window(10, -1)
    with pytest.raises(ValueError, match="num_inference_steps=0"):
        sample_sde_window(0, 0)
    with pytest.raises(ValueError, match="sde_window_range"):
        sample_sde_window(10, 2, [5])


def _run_scheduler(sched, num_steps, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 4, 4, generator=gen)
    sched.set_timesteps(num_steps)
    outs = []
    for t in sched.timesteps:
        out = sched.step(torch.randn(x.shape, generator=gen), t, x)
        outs.append(out)
        x = out.prev_sample
    return outs


def test_scheduler_sde_only_inside_window():
    sched = FlowMatchSDEScheduler(shift=3.0, noise_level=0.7, sde_window_size=3, sde_window_range=[1, 5])
    sched.set_sde_generator(torch.Generator().manual_seed(0))
    outs = _run_scheduler(sched, 10)
    start, end = sched.sde_window
    assert end - start == 3 and 1 <= start < 5
    for i, out in enumerate(outs):
        inside = start <= i < end
        assert bool((out.std > 0).all()) == inside and bool((out.log_prob != 0).all()) == inside
        assert torch.isfinite(out.log_prob).all()
    # Default window (size 0): every step but the last.
    outs = _run_scheduler(FlowMatchSDEScheduler(shift=3.0), 6)
    assert [bool((o.std > 0).all()) for o in outs] == [True] * 5 + [False]
    # A fixed window persists across set_timesteps; None goes back to drawing.
    fixed = FlowMatchSDEScheduler(noise_level=0.7, sde_window_size=2)
    fixed.set_sde_window(4, 6)
    outs = _run_scheduler(fixed, 8)
    assert fixed.sde_window == (4, 6)
    assert [bool((o.std > 0).all()) for o in outs] == [False] * 4 + [True] * 2 + [False] * 2
    fixed.set_sde_window(None)
    fixed.set_timesteps(8)
    assert fixed.sde_window[1] - fixed.sde_window[0] == 2
    with pytest.raises(ValueError, match=r"window \[2, 12\) does not fit the 8-step schedule"):
        fixed.set_sde_window(2, 12)  # timesteps already set: checked at once, and the old state is kept
    fixed.set_timesteps(8)
    fresh = FlowMatchSDEScheduler()
    fresh.set_sde_window(2, 12)
    with pytest.raises(ValueError, match=r"window \[2, 12\) does not fit the 8-step schedule"):
        fresh.set_timesteps(8)
    # Windows drawn from the scheduler's generator are reproducible.
    windows = []
    for _ in range(2):
        s = FlowMatchSDEScheduler(sde_window_size=2, sde_window_range=[0, 6])
        s.set_sde_generator(torch.Generator().manual_seed(42))
        windows.append([(s.set_timesteps(10), s.sde_window)[1] for _ in range(5)])
    assert windows[0] == windows[1] and len(set(windows[0])) > 1


def test_scheduler_step_tuple_and_config_round_trip(tmp_path):
    stock = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched = FlowMatchSDEScheduler.from_config(stock.config, noise_level=0.5, sde_type="cps", sde_window_size=2,
                                              sde_window_range=(0, 3), log_prob_reduction="sum")
    assert sched.config.shift == 3.0 and sched.config.noise_level == 0.5 and sched.config.sde_type == "cps"
    assert list(sched.config.sde_window_range) == [0, 3]
    sched.save_config(tmp_path)
    loaded = FlowMatchSDEScheduler.from_pretrained(tmp_path)
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == {
        k: v for k, v in sched.config.items() if not k.startswith("_")}
    # Back to the stock class: the extra keys are ignored.
    assert FlowMatchEulerDiscreteScheduler.from_config(loaded.config).config.shift == 3.0

    sched.set_sde_window(0, 2)
    sched.set_timesteps(5)
    x, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    tup = sched.step(v, sched.timesteps[0], x, return_dict=False, generator=torch.Generator().manual_seed(0))
    assert isinstance(tup, tuple) and len(tup) == 4 and tup[0].shape == x.shape and tup[1].shape == (2,)
    sched.set_timesteps(5)
    out = sched.step(v, sched.timesteps[0], x, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.prev_sample, tup[0]) and torch.equal(out.log_prob, tup[1])
    with pytest.raises(ValueError, match="integer indices"):
        sched.step(v, 1, x)


def test_noise_level_zero_scheduler_matches_stock_bitwise():
    stock = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sde = FlowMatchSDEScheduler.from_config(stock.config, noise_level=0.0)
    for s in (stock, sde):
        s.set_timesteps(7)
    gen = torch.Generator().manual_seed(0)
    x_a = x_b = torch.randn(2, 4, 8, 8, generator=gen).to(torch.bfloat16)
    for t in stock.timesteps:
        v = torch.randn(x_a.shape, generator=gen).to(torch.bfloat16)
        x_a = stock.step(v, t, x_a).prev_sample
        out = sde.step(v, t, x_b)
        x_b = out.prev_sample
        assert torch.equal(x_a, x_b) and x_b.dtype == torch.bfloat16
        assert torch.equal(out.log_prob, torch.zeros(2)) and torch.equal(out.std, torch.zeros(2))


# ----------------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------------


def test_gaussian_kl():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    expected = ((a - b) ** 2 / (2 * std.view(3, 1, 1) ** 2)).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_kl(a, b, std), expected)
    torch.testing.assert_close(gaussian_kl(a, b, std.view(3, 1, 1), reduction="sum"), expected * 8)
    torch.testing.assert_close(gaussian_kl(a, b, 0.5), ((a - b) ** 2 / 0.5).mean(dim=(1, 2)))
    assert torch.equal(gaussian_kl(a, a, std), torch.zeros(3, dtype=torch.float64))
    assert gaussian_kl(a, b, torch.tensor([0.0, 1.0, 1.0]))[0] == 0  # deterministic sample: no KL
    assert gaussian_kl(a.to(torch.bfloat16), b.to(torch.bfloat16), 1.0).dtype == torch.float32

    # Monte Carlo: KL = E_{x ~ p_a}[log p_a(x) - log p_b(x)] with the step log-probs (sum reduction, one dim).
    sched = make_scheduler(10)
    n = 200_000
    x = torch.zeros(n, 1, dtype=torch.float64)
    va, vb = torch.full_like(x, 0.3), torch.full_like(x, -0.2)
    t = sched.timesteps[3]
    pa = sde_step_with_logprob(sched, va, t, x, generator=torch.Generator().manual_seed(0))
    pb = sde_step_with_logprob(sched, vb, t, x, prev_sample=pa.prev_sample)
    kl = gaussian_kl(pa.prev_sample_mean, pb.prev_sample_mean, pa.std)
    assert abs(float((pa.log_prob - pb.log_prob).mean()) / float(kl.mean()) - 1) < 0.05


# ----------------------------------------------------------------------------------------------------------------
# drop-in for a real (tiny) SD3 pipeline
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd3_pipe(tiny_sd3_path):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, seed, steps=4, **kwargs):
    return pipe("a red circle", num_inference_steps=steps, height=64, width=64,
                guidance_scale=kwargs.pop("guidance_scale", 1.0), generator=torch.Generator().manual_seed(seed),
                output_type="np", **kwargs).images


def test_pipeline_noise_level_zero_is_bit_identical_to_stock(sd3_pipe):
    stock = sd3_pipe.scheduler
    try:
        reference = _generate(sd3_pipe, 0, guidance_scale=3.0)
        sd3_pipe.scheduler = FlowMatchSDEScheduler.from_config(stock.config, noise_level=0.0)
        assert np.array_equal(_generate(sd3_pipe, 0, guidance_scale=3.0), reference)
    finally:
        sd3_pipe.scheduler = stock


def test_pipeline_with_sde_scheduler_saves_and_loads(sd3_pipe, tmp_path):
    stock = sd3_pipe.scheduler
    try:
        sd3_pipe.scheduler = FlowMatchSDEScheduler.from_config(stock.config, noise_level=0.5, sde_window_size=2)
        sd3_pipe.save_pretrained(tmp_path)
        loaded = StableDiffusion3Pipeline.from_pretrained(tmp_path)
        assert isinstance(loaded.scheduler, FlowMatchSDEScheduler)
        assert loaded.scheduler.config.noise_level == 0.5 and loaded.scheduler.config.sde_window_size == 2
    finally:
        sd3_pipe.scheduler = stock


def test_pipeline_sde_sampling_seeds(sd3_pipe):
    stock = sd3_pipe.scheduler
    try:
        ode = _generate(sd3_pipe, 0)
        sched = FlowMatchSDEScheduler.from_config(stock.config, noise_level=0.7)
        sd3_pipe.scheduler = sched
        images = {}
        for run, seed in (("a", 0), ("b", 0), ("c", 1)):
            sched.set_sde_generator(torch.Generator().manual_seed(seed))
            images[run] = _generate(sd3_pipe, seed)
        assert np.array_equal(images["a"], images["b"])  # same seed, same images
        assert not np.array_equal(images["a"], images["c"])  # different seeds differ
        assert not np.array_equal(images["a"], ode)  # and the SDE noise changes the result
        # Same initial latents, different SDE noise only: still different.
        sched.set_sde_generator(torch.Generator().manual_seed(5))
        assert not np.array_equal(_generate(sd3_pipe, 0), images["a"])
    finally:
        sd3_pipe.scheduler = stock


def test_pipeline_bf16_gives_finite_float32_log_probs(tiny_sd3_path):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    sched = FlowMatchSDEScheduler.from_config(pipe.scheduler.config, noise_level=0.7)
    pipe.scheduler = sched
    sched.set_sde_generator(torch.Generator().manual_seed(0))
    latents = pipe("a red circle", num_inference_steps=3, height=64, width=64, guidance_scale=1.0,
                   generator=torch.Generator().manual_seed(0), output_type="latent").images
    assert latents.dtype == torch.bfloat16 and torch.isfinite(latents.float()).all()

    # One step with a real bf16 transformer output, through the scheduler and the log-prob helper.
    prompt_embeds, _, pooled, _ = pipe.encode_prompt("a red circle", None, None, do_classifier_free_guidance=False)
    sched.set_timesteps(3)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = sched.timesteps[0]
    with torch.no_grad():
        v = pipe.transformer(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=prompt_embeds,
                             pooled_projections=pooled, return_dict=False)[0]
    assert v.dtype == torch.bfloat16
    out = sched.step(v, t, x, generator=torch.Generator().manual_seed(2))
    assert out.prev_sample.dtype == torch.bfloat16
    assert out.log_prob.dtype == torch.float32 and torch.isfinite(out.log_prob).all() and (out.std > 0).all()
    again = sde_step_with_logprob(sched, v, t, x, prev_sample=out.prev_sample, noise_level=0.7)
    assert torch.equal(again.log_prob, out.log_prob)
