"""SA-Solver, the stochastic sampler of AWM's official rollouts (flowgrpo.schedulers.sa_solver): the official
trajectory on fixed inputs, one step against a transcription of the official update, the noise window, per-sample
generators, and the marginals of a Gaussian problem with the exact velocity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowgrpo.schedulers import (
    euler_step,
    sa_corrector_step,
    sa_predictor_step,
    sa_solver_sample,
    sa_solver_sigmas,
    sa_solver_tau,
    sde_noise_level_for_tau,
    sde_step_from_sigmas,
    tau_for_sde_noise_level,
)


def scheduler_sigmas(steps: int, shift: float = 3.0) -> torch.Tensor:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas


def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A fixed nonlinear velocity field for comparing trajectories."""
    return torch.tanh(x) * (1.0 + sigma) - 0.3 * x * sigma + 0.1


def start() -> torch.Tensor:
    return torch.linspace(-1.5, 1.7, 6, dtype=torch.float64).reshape(2, 3)


# ---------------------------------------------------------------------------------------------------------------------
# the official sampler
# ---------------------------------------------------------------------------------------------------------------------

# The official ``SASolver.sample`` (scxue/advantage_weighted_matching, flow_grpo/diffusers_patch/sa_solver.py) run once
# in float64 on `velocity`, `start()` and the levels `sa_solver_sigmas(scheduler_sigmas(steps))`, with
# ``torch.manual_seed(seed)``, ``pc_mode='PEC'`` and its ``tau(t) = tau if 0.3 <= t <= 0.9 else 0``. Key:
# (steps, tau, predictor order, corrector order, seed); value: its final sample, flattened.
OFFICIAL_FINAL = {
    (14, 0.4, 2, 2, 0): [-0.4745686535727092, -0.2963714113936743, -0.006367186144518011, 0.2595706936675552,
                         0.22135962570628992, 0.30509604273154367],
    (14, 0.0, 2, 2, 0): [-0.6500536315512281, -0.33105940014941804, -0.1194708784658272, 0.06236583086522443,
                         0.2870938589002721, 0.6283064493825496],
    (6, 0.4, 2, 2, 3): [-0.5197105124583141, -0.19613406014425686, -0.34136386249732753, -0.02893496351168273,
                        0.15197045685896476, 0.3810506652636794],
    (5, 0.7, 1, 2, 1): [-0.7043770104236441, -0.3157503394781578, 1.0865270914807548, -0.41862832479540923,
                        0.3622039007148935, -0.24552727344250705],
    (5, 0.7, 2, 0, 1): [-0.7340448850524439, -0.38622997280515226, 1.244699424381873, -0.42616985616272773,
                        0.4403908946624215, -0.34423321005408725],
}
# The same run's state after step 7 of (14, 0.4, 2, 2, 0) (its ``intermediates[7]``).
OFFICIAL_STATE_7 = [-1.0089765547486176, -0.819763667388882, -0.5459711898724163, -0.10348126346689951,
                    0.13892596975748744, 0.9390621439025728]


def official_noise_generator(seed: int, shape) -> torch.Generator:
    """The official sampler draws ``randn_like`` from the global generator before its first step (unused), then one
    noise a step: skipping one draw aligns a generator seeded alike with the noise of its steps 1 .. N - 1."""
    generator = torch.Generator().manual_seed(seed)
    torch.randn(shape, generator=generator, dtype=torch.float64)
    return generator


@pytest.mark.parametrize("key", sorted(OFFICIAL_FINAL))
def test_matches_the_official_sampler_on_fixed_inputs(key):
    steps, tau, predictor, corrector, seed = key
    x = start()
    out = sa_solver_sample(velocity, x, sa_solver_sigmas(scheduler_sigmas(steps)), tau=tau, predictor_order=predictor,
                           corrector_order=corrector, generator=official_noise_generator(seed, x.shape),
                           return_intermediates=True)
    assert out.sample.dtype == torch.float64
    torch.testing.assert_close(out.sample.flatten(), torch.tensor(OFFICIAL_FINAL[key], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert len(out.intermediates) == steps + 1 and torch.equal(out.intermediates[-1], out.sample)
    if key == (14, 0.4, 2, 2, 0):
        torch.testing.assert_close(out.intermediates[7].flatten(), torch.tensor(OFFICIAL_STATE_7, dtype=torch.float64),
                                   rtol=0, atol=1e-12)
        # float32 (the rollouts' dtype) follows the same trajectory to float32 rounding
        x32 = sa_solver_sample(velocity, x.float(), sa_solver_sigmas(scheduler_sigmas(steps)),
                               generator=official_noise_generator(seed, x.shape)).sample
        assert x32.dtype == torch.float32
        torch.testing.assert_close(x32.double(), out.sample, rtol=0, atol=1e-5)


def test_official_levels_first_and_second_to_last():
    sigmas = scheduler_sigmas(14)
    levels = sa_solver_sigmas(sigmas)
    assert levels.dtype == torch.float64 and levels.numel() == 15
    assert levels[0].item() == 1 - 1e-3 and levels[-1].item() == 0.0
    assert levels[-2].item() == sigmas[-3].double().item() / 2
    torch.testing.assert_close(levels[1:-2], sigmas[1:-2].double(), rtol=0, atol=0)
    # two steps: the second-to-last level is half the (original) first, 1.0
    assert sa_solver_sigmas(scheduler_sigmas(2)).tolist() == [0.999, 0.5, 0.0]
    with pytest.raises(ValueError, match="at least 2 steps"):
        sa_solver_sigmas([1.0, 0.0])
    with pytest.raises(ValueError, match="end at 0"):
        sa_solver_sigmas([1.0, 0.5, 0.1])


# ---------------------------------------------------------------------------------------------------------------------
# one step against a transcription of the official update
# ---------------------------------------------------------------------------------------------------------------------


def lam(sigma: float) -> float:
    return math.log((1 - sigma) / sigma)


def official_step(x, levels, data_predictions, nodes, tau, noise, modification):
    """The official update, written from its formulas: x_t = e^{-tau^2 h} (sigma_t / sigma_s) x_s +
    (1 + tau^2) sigma_t e^{-tau^2 lambda_t} sum_i b_i D_i + sigma_t sqrt(1 - e^{-2 tau^2 h}) xi, where b_i is the
    integral over [lambda_s, lambda_t] of e^{(1 + tau^2) lambda} times the Lagrange basis polynomial of node i
    (here by Gauss-Legendre quadrature), plus the official order-2 "few steps" term (+ on the first node, - on the
    second)."""
    sigma_s, sigma_t = levels
    lam_s, lam_t = lam(sigma_s), lam(sigma_t)
    h, c = lam_t - lam_s, 1 + tau**2
    points, weights = np.polynomial.legendre.leggauss(40)
    grid = lam_s + (points + 1) * h / 2
    coefficients = []
    for i, node in enumerate(nodes):
        basis = np.ones_like(grid)
        for j, other in enumerate(nodes):
            if j != i:
                basis *= (grid - other) / (node - other)
        coefficients.append(float(np.sum(weights * np.exp(c * grid) * basis) * h / 2))
    if len(nodes) == 2:
        if modification == "predictor":
            extra = math.exp(c * lam_t) * (h**2 / 2 - (h * c - 1 + math.exp(-c * h)) / c**2) / (nodes[0] - nodes[1])
        else:
            extra = math.exp(c * lam_t) * (h / 2 - (h * c - 1 + math.exp(-c * h)) / (c**2 * h))
        coefficients[0] += extra
        coefficients[1] -= extra
    out = math.exp(-(tau**2) * h) * sigma_t / sigma_s * x
    for b, d in zip(coefficients, data_predictions):
        out = out + c * sigma_t * math.exp(-(tau**2) * lam_t) * b * d
    return out + sigma_t * math.sqrt(1 - math.exp(-2 * tau**2 * h)) * noise


@pytest.mark.parametrize("tau", [0.0, 0.4, 1.3])
@pytest.mark.parametrize("levels", [(0.95, 0.8, 0.62), (0.999, 0.97, 0.9), (0.4, 0.3, 0.1)])
def test_single_steps_match_a_transcription_of_the_official_update(tau, levels):
    sigma_p, sigma_s, sigma_t = levels
    g = torch.Generator().manual_seed(7)
    x, d_p, d_s, d_t, noise = (torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(5))
    for order in (1, 2):
        ours = sa_predictor_step(x, sigma_s, sigma_t, d_s, tau, noise, d_p if order == 2 else None,
                                 sigma_p if order == 2 else None)
        nodes = [lam(sigma_s), lam(sigma_p)][:order]
        reference = official_step(x, (sigma_s, sigma_t), [d_s, d_p][:order], nodes, tau, noise, "predictor")
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)
        ours = sa_corrector_step(x, sigma_s, sigma_t, d_s, d_t, tau, noise, order)
        nodes = [lam(sigma_t), lam(sigma_s)][:order]
        reference = official_step(x, (sigma_s, sigma_t), [d_t, d_s][:order], nodes, tau, noise, "corrector")
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)


def test_deterministic_first_order_step_is_the_euler_step():
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 8, generator=g, dtype=torch.float64), torch.randn(2, 8, generator=g, dtype=torch.float64)
    for sigma, sigma_next in [(0.999, 0.9), (0.6, 0.55), (0.2, 0.01)]:
        ours = sa_predictor_step(x, sigma, sigma_next, x - sigma * v, 0.0, None)
        torch.testing.assert_close(ours, euler_step(x, v, sigma, sigma_next), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# the noise window, generators, errors
# ---------------------------------------------------------------------------------------------------------------------


def test_noise_enters_only_on_the_steps_that_end_inside_the_range():
    levels = sa_solver_sigmas(scheduler_sigmas(14))
    x = start()
    runs = [sa_solver_sample(velocity, x, levels, generator=torch.Generator().manual_seed(seed),
                             return_intermediates=True) for seed in (0, 1)]
    # 14 steps at shift 3: the steps to levels 0.871 .. 0.357 (steps 4 to 11) are stochastic
    assert runs[0].taus == [0.0] * 3 + [0.4] * 8 + [0.0] * 2
    assert runs[0].taus == [sa_solver_tau(s) for s in levels[1:-1].tolist()]
    for k in range(4):  # before the window, the trajectories of two generators coincide
        assert torch.equal(runs[0].intermediates[k], runs[1].intermediates[k])
    assert not torch.allclose(runs[0].intermediates[4], runs[1].intermediates[4])
    assert sa_solver_tau(0.3) == 0.4 and sa_solver_tau(0.9) == 0.4 and sa_solver_tau(0.95) == 0.0
    assert sa_solver_tau(0.5, 0.7, (0.6, 1.0)) == 0.0 and sa_solver_tau(0.7, 0.7, (0.6, 1.0)) == 0.7
    # tau = 0: a deterministic trajectory, whatever the generator
    calm = [sa_solver_sample(velocity, x, levels, tau=0.0, generator=torch.Generator().manual_seed(s)).sample
            for s in (0, 1)]
    assert torch.equal(calm[0], calm[1])


def test_per_sample_generators_give_each_sample_its_own_trajectory():
    levels = sa_solver_sigmas(scheduler_sigmas(8))
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))
    batch = sa_solver_sample(velocity, x, levels, generator=[torch.Generator().manual_seed(10 + i) for i in range(3)])
    for i in range(3):
        alone = sa_solver_sample(velocity, x[i:i + 1], levels, generator=[torch.Generator().manual_seed(10 + i)])
        torch.testing.assert_close(batch.sample[i:i + 1], alone.sample, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="one per sample"):
        sa_solver_sample(velocity, x, levels, generator=[torch.Generator()] * 2)


def test_bad_arguments_are_refused():
    levels = sa_solver_sigmas(scheduler_sigmas(6))
    x = start()
    with pytest.raises(ValueError, match="predictor_order=3"):
        sa_solver_sample(velocity, x, levels, predictor_order=3)
    with pytest.raises(ValueError, match="corrector_order=4"):
        sa_solver_sample(velocity, x, levels, corrector_order=4)
    with pytest.raises(ValueError, match="strictly inside"):  # the scheduler's own first level, 1, is not finite
        sa_solver_sample(velocity, x, scheduler_sigmas(6))
    with pytest.raises(ValueError, match="tau=-0.1"):
        sa_solver_sample(velocity, x, levels, tau=-0.1)
    with pytest.raises(ValueError, match="noise_range"):
        sa_solver_sample(velocity, x, levels, noise_range=(0.9, 0.3))
    with pytest.raises(ValueError, match="needs its noise"):
        sa_predictor_step(x, 0.6, 0.5, x, 0.4, None)


# ---------------------------------------------------------------------------------------------------------------------
# a Gaussian problem with the exact velocity
# ---------------------------------------------------------------------------------------------------------------------

# Data x0 ~ N(MU, S^2), x_sigma = (1 - sigma) x0 + sigma eps: the marginal at sigma is N((1 - sigma) MU, var(sigma)),
# var = (1 - sigma)^2 S^2 + sigma^2, and the exact velocity E[eps - x0 | x] is linear in x.
MU, S = 0.5, 1.0


def marginal(sigma: float) -> tuple[float, float]:
    alpha = 1 - sigma
    return alpha * MU, alpha**2 * S**2 + sigma**2


def gaussian_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    alpha = 1 - sigma
    mean, var = marginal(sigma)
    centred = x - mean
    return sigma / var * centred - (MU + alpha * S**2 / var * centred)


def marginal_errors(steps: int, samples: int = 50_000) -> tuple[float, float]:
    """The largest error of the mean and of the relative variance of the points the model is evaluated at, against
    the exact marginals, and the error of the final sample against its exact law: the data prediction at the
    second-to-last level, N(MU, (alpha S^2)^2 / var)."""
    levels = sa_solver_sigmas(scheduler_sigmas(steps))
    mean0, var0 = marginal(float(levels[0]))
    x = mean0 + math.sqrt(var0) * torch.randn(samples, generator=torch.Generator().manual_seed(0))
    errors = []

    def recording_velocity(z: torch.Tensor, sigma: float) -> torch.Tensor:
        mean, var = marginal(sigma)
        errors.append(max(abs(z.mean().item() - mean), abs(z.var().item() / var - 1)))
        return gaussian_velocity(z, sigma)

    final = sa_solver_sample(recording_velocity, x, levels, generator=torch.Generator().manual_seed(1)).sample
    sigma = float(levels[-2])
    alpha, (_, var) = 1 - sigma, marginal(sigma)
    final_error = max(abs(final.mean().item() - MU), abs(final.var().item() / ((alpha * S**2) ** 2 / var) - 1))
    return max(errors[1:]), final_error


def test_gaussian_marginals_are_preserved_as_the_step_count_grows():
    # 50k samples: the Monte Carlo error of a relative variance is about 0.006
    coarse, medium, fine = (marginal_errors(steps) for steps in (14, 56, 224))
    assert coarse[0] > 0.1 and coarse[1] > 0.1  # 14 steps at shift 3 on this problem: about 0.26 off
    assert medium[0] < coarse[0] / 5 and medium[1] < coarse[1] / 5
    assert fine[0] < 0.025 and fine[1] < 0.025


def test_deterministic_trajectory_converges_to_the_flow_map():
    x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)

    def error(steps: int) -> float:
        levels = sa_solver_sigmas(scheduler_sigmas(steps))
        (mean0, var0), (mean1, var1) = marginal(float(levels[0])), marginal(float(levels[-2]))
        state = mean1 + math.sqrt(var1 / var0) * (x - mean0)  # the flow's map to the second-to-last level
        exact = state - float(levels[-2]) * gaussian_velocity(state, float(levels[-2]))
        return (sa_solver_sample(gaussian_velocity, x, levels, tau=0.0).sample - exact).abs().max().item()

    coarse, fine = error(56), error(224)
    assert fine < coarse / 8 and fine < 2e-3


def test_tau_is_the_projects_noise_level_over_sqrt_2():
    assert sde_noise_level_for_tau(0.4) == pytest.approx(0.5657, abs=1e-4)
    assert tau_for_sde_noise_level(sde_noise_level_for_tau(0.3)) == pytest.approx(0.3)
    x, v = torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    for sigma in (0.85, 0.6, 0.35):
        ratios = []
        for dt in (1e-2, 1e-3, 1e-4):
            # the noise's coefficient of one SA-Solver step, against the std of the 'sde' step at a = sqrt(2) tau
            sa_std = (sa_predictor_step(x, sigma, sigma - dt, x, 0.4, one)
                      - sa_predictor_step(x, sigma, sigma - dt, x, 0.4, torch.zeros_like(one))).item()
            ours = sde_step_from_sigmas(v, x, sigma, sigma - dt, noise_level=sde_noise_level_for_tau(0.4)).std.item()
            ratios.append(sa_std / ours)
        assert abs(ratios[-1] - 1) < 1e-3 and abs(ratios[-1] - 1) < abs(ratios[0] - 1)
