r"""SA-Solver for flow matching: the stochastic Adams predictor-corrector that samples AWM's official rollouts.

SA-Solver (Xue et al., arXiv 2309.05019) in its data-prediction form, run as AWM's official code runs it
(``scxue/advantage_weighted_matching``: ``flow_grpo/diffusers_patch/sa_solver.py``, called from
``sd3_pipeline_with_logprob.py`` with a predictor of order 2, a corrector of order 2 in ``PEC`` mode,
tau(sigma) = 0.4 for 0.3 <= sigma <= 0.9 and 0 elsewhere, and its own first and second-to-last noise levels).

Notation: ``x = (1 - sigma) x0 + sigma eps`` (1 = pure noise), ``alpha = 1 - sigma``, the half log-SNR
``lambda = log(alpha / sigma)``, the data prediction ``D = x - sigma v`` of the velocity ``v`` at ``(x, sigma)``,
``tau >= 0`` the stochasticity of a step and ``c = 1 + tau^2``. One step goes from ``sigma_s`` to ``sigma_t < sigma_s``,
``h = lambda_t - lambda_s > 0``, with fresh noise ``xi ~ N(0, I)``::

    x_t = (sigma_t / sigma_s) e^{-tau^2 h} x_s + alpha_t G + sigma_t sqrt(1 - e^{-2 tau^2 h}) xi

The linear part and the noise are integrated exactly (SA-Solver's reverse SDE has the flow's marginals and the
diffusion ``tau^2 g^2``, see below); ``G`` integrates the data predictions, interpolated in lambda, against
``c e^{c (lambda - lambda_t)}``. With ``M0 = 1 - e^{-c h}`` and ``M1 = (c h - 1 + e^{-c h}) / c`` (the integrals of ``c e^{c u}`` and of
``c e^{c u} (h + u)`` over ``u`` in ``[-h, 0]``), and ``h' = lambda_s - lambda_p`` the previous step's::

    predictor, order 1   G = M0 D_s
    predictor, order 2   G = M0 D_s + c h^2 / (2 h') (D_s - D_p)
    corrector, order 1   G = M0 D_t
    corrector, order 2   G = M0 D_s + c h / 2 (D_t - D_s)

The order-2 rows are the official "few steps" forms: the Lagrange interpolant's coefficients plus the official
O(h^3) modification (UniPC's), which leaves exactly the forms above. ``D_t`` is the data prediction at the
predictor's result: the predictor moves ``x_s`` to ``x_p``, the model is evaluated once there (``D_t``), and the
corrector recomputes ``x_t`` from ``x_s`` with the same noise ``xi`` and ``tau`` (``PEC``: one model call a step).

The official trajectory over levels ``t_0 > t_1 > ... > t_N = 0`` (`sa_solver_sigmas`):

* ``D_0`` at ``(x_0, t_0)``;
* step ``k = 1 .. N - 1``, ``tau_k = tau(t_k)`` (the level the step goes to), predictor of order ``min(p, k)``,
  ``D_k`` at the predictor's result, corrector of order ``q``, except on step 1 when ``p = 2`` (the official
  ``disable_first_corrector``) and when ``q = 0``;
* the last step returns ``D_{N-1}``, the data prediction at the second-to-last level (``denoise_to_zero``): no
  model call, no noise.

With ``tau = 0`` the predictor of order 1 is DPM-Solver++ 1 (the Euler step of the flow); order 2 is a UniPC-like
multistep. **Relation to this project's SDE** (``sde_type="sde"``, ``noise_level`` a): both discretise a reverse
SDE with the flow's marginals; SA-Solver's diffusion is ``tau^2 g^2`` with ``g^2 = 2 sigma / (1 - sigma)`` per unit
sigma (for ``alpha = 1 - sigma``), ours is ``a^2 sigma / (1 - sigma)``, so the same SDE has ``a = sqrt(2) tau``
(`sde_noise_level_for_tau`): tau 0.4 is a ~= 0.566. The per-step variances agree to first order in the step:
``sigma_t^2 (1 - e^{-2 tau^2 h}) ~= 2 tau^2 sigma (-dt) / (1 - sigma) = a^2 sigma (-dt) / (1 - sigma)``.

Differences from the official function, none of which changes the distribution of a sample: it computes in the
latents' dtype (bf16 in its pipeline), here in float32 (float64 when the sample is float64); it draws one unused
noise before the first step and one at the last step from the global generator, here noise is drawn only where it
is used (steps 1 .. N - 1, whatever their tau), from the given generator(s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "SA_SOLVER_NOISE_RANGE",
    "SA_SOLVER_TAU",
    "SASolverOutput",
    "sa_corrector_step",
    "sa_predictor_step",
    "sa_solver_sample",
    "sa_solver_sigmas",
    "sa_solver_tau",
    "sde_noise_level_for_tau",
    "tau_for_sde_noise_level",
]

#: AWM's official stochasticity (``config/dgx_awm.py``: ``sample.noise_level = 0.4``, passed as tau)
SA_SOLVER_TAU = 0.4
#: the noise levels where AWM's official sampler is stochastic (``sd3_pipeline_with_logprob.py``: 0.3 <= t <= 0.9)
SA_SOLVER_NOISE_RANGE = (0.3, 0.9)
#: the official first level: 1 - 1e-3 instead of 1 (finite lambda)
FIRST_SIGMA = 1.0 - 1e-3


def sde_noise_level_for_tau(tau: float) -> float:
    """The ``noise_level`` a of this project's ``"sde"`` step whose SDE is SA-Solver's at ``tau``: ``sqrt(2) tau``."""
    return math.sqrt(2.0) * float(tau)


def tau_for_sde_noise_level(noise_level: float) -> float:
    """SA-Solver's tau of the SDE of this project's ``"sde"`` step at ``noise_level`` a: ``a / sqrt(2)``."""
    return float(noise_level) / math.sqrt(2.0)


def sa_solver_sigmas(sigmas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """AWM's own noise levels from a scheduler's ``N + 1`` levels ``sigmas`` (ending at 0, ``N >= 2``), as the
    official pipeline sets them: the second-to-last becomes half the third-to-last, then the first becomes
    ``1 - 1e-3``. In float64."""
    levels = torch.as_tensor(sigmas, dtype=torch.float64).detach().clone().reshape(-1)
    if levels.numel() < 3:
        raise ValueError(f"SA-Solver needs at least 2 steps (3 noise levels), got {levels.numel()} levels; raise "
                         "num_inference_steps.")
    if float(levels[-1]) != 0.0:
        raise ValueError(f"the noise levels must end at 0 (the last step returns the data prediction), got "
                         f"{float(levels[-1])}; pass the scheduler's sigmas after set_timesteps.")
    levels[-2] = levels[-3] / 2
    levels[0] = FIRST_SIGMA
    if not bool((levels[:-1] > levels[1:]).all()):
        raise ValueError(f"SA-Solver's noise levels must decrease, got {levels.tolist()}.")
    return levels


def sa_solver_tau(sigma: float, tau: float = SA_SOLVER_TAU,
                  noise_range: Sequence[float] = SA_SOLVER_NOISE_RANGE) -> float:
    """The stochasticity of a step that ends at ``sigma``: ``tau`` when ``lo <= sigma <= hi``, else 0."""
    lo, hi = noise_range
    return float(tau) if lo <= float(sigma) <= hi else 0.0


def _lambda(sigma: float) -> float:
    if not 0.0 < sigma < 1.0:
        raise ValueError(f"SA-Solver steps need noise levels strictly inside (0, 1), got {sigma}; the first level is "
                         "1 - 1e-3 and the final 0 is reached by the data prediction (sa_solver_sigmas).")
    return math.log1p(-sigma) - math.log(sigma)


def _moments(c: float, h: float) -> tuple[float, float]:
    """M0 = c int_{-h}^0 e^{c u} du and M1 = c int_{-h}^0 e^{c u} (h + u) du."""
    decay = math.exp(-c * h)
    return -math.expm1(-c * h), (c * h - 1.0 + decay) / c


def _linear_part(sample: torch.Tensor, sigma: float, sigma_next: float, tau: float,
                 noise: torch.Tensor | None) -> tuple[torch.Tensor, float, float, float]:
    """``(sigma_t / sigma_s) e^{-tau^2 h} x_s + sigma_t sqrt(1 - e^{-2 tau^2 h}) xi`` and (h, c, alpha_t)."""
    if tau < 0 or not math.isfinite(tau):
        raise ValueError(f"tau={tau} must be a finite number >= 0 (0: a deterministic step).")
    if not sigma_next < sigma:
        raise ValueError(f"a step goes from noise to data: sigma_next={sigma_next} must be below sigma={sigma}.")
    h = _lambda(sigma_next) - _lambda(sigma)
    out = sample * (sigma_next / sigma * math.exp(-tau**2 * h))
    if tau > 0:
        if noise is None:
            raise ValueError("a stochastic step (tau > 0) needs its noise.")
        out = out + noise * (sigma_next * math.sqrt(-math.expm1(-2.0 * tau**2 * h)))
    return out, h, 1.0 + tau**2, 1.0 - sigma_next


def sa_predictor_step(sample: torch.Tensor, sigma: float, sigma_next: float, data_prediction: torch.Tensor,
                      tau: float, noise: torch.Tensor | None, prev_data_prediction: torch.Tensor | None = None,
                      prev_sigma: float | None = None) -> torch.Tensor:
    """SA-Solver's predictor from ``sigma`` to ``sigma_next``: order 1 from ``D_s = data_prediction`` alone, order 2
    with the previous step's ``D_p = prev_data_prediction`` taken at ``prev_sigma`` (see the module docstring)."""
    out, h, c, alpha_next = _linear_part(sample, float(sigma), float(sigma_next), float(tau), noise)
    m0, _ = _moments(c, h)
    direction = data_prediction * m0
    if prev_data_prediction is not None:
        if prev_sigma is None or not float(prev_sigma) > float(sigma):
            raise ValueError(f"the order-2 predictor needs prev_sigma above sigma={sigma}, got {prev_sigma}.")
        h_prev = _lambda(float(sigma)) - _lambda(float(prev_sigma))
        direction = direction + (data_prediction - prev_data_prediction) * (c * h * h / (2.0 * h_prev))
    return out + alpha_next * direction


def sa_corrector_step(sample: torch.Tensor, sigma: float, sigma_next: float, data_prediction: torch.Tensor,
                      next_data_prediction: torch.Tensor, tau: float, noise: torch.Tensor | None,
                      order: int = 2) -> torch.Tensor:
    """SA-Solver's corrector from ``sigma`` to ``sigma_next``: ``x_t`` recomputed from ``x_s = sample`` with
    ``D_s = data_prediction`` and ``D_t = next_data_prediction`` (the data prediction at the predictor's result),
    the same ``tau`` and ``noise`` as the predictor; ``order`` 1 (``D_t`` alone) or 2."""
    out, h, c, alpha_next = _linear_part(sample, float(sigma), float(sigma_next), float(tau), noise)
    m0, _ = _moments(c, h)
    if order == 1:
        direction = next_data_prediction * m0
    elif order == 2:
        direction = data_prediction * m0 + (next_data_prediction - data_prediction) * (c * h / 2.0)
    else:
        raise ValueError(f"corrector order {order!r} is not supported; use 1 or 2.")
    return out + alpha_next * direction


def _check_orders(predictor_order: int, corrector_order: int) -> None:
    if isinstance(predictor_order, bool) or predictor_order not in (1, 2):
        raise ValueError(f"predictor_order={predictor_order!r} is not supported; use 1 or 2 (AWM: 2).")
    if isinstance(corrector_order, bool) or corrector_order not in (0, 1, 2):
        raise ValueError(f"corrector_order={corrector_order!r} is not supported; use 0 (no corrector), 1 or 2 "
                         "(AWM: 2).")


def _draw_noise(shape: torch.Size, generator: torch.Generator | list[torch.Generator] | None,
                device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"Got a list of {len(generator)} generators for a batch of {shape[0]} samples; pass one "
                             "generator, or exactly one per sample.")
        generator = list(generator)
    from diffusers.utils.torch_utils import randn_tensor  # diffusers' per-sample generator handling

    return randn_tensor(tuple(shape), generator=generator, device=device, dtype=dtype)


@dataclass
class SASolverOutput:
    """What `sa_solver_sample` returns: the final ``sample`` (``D_{N-1}``, in the input's dtype) and, when asked
    for, the ``intermediates`` ``x_0, x_1, ..., x_{N-1}, D_{N-1}`` in the compute dtype (as the official
    ``return_intermediate``) and the ``taus`` of steps 1 .. N - 1."""

    sample: torch.Tensor
    intermediates: list[torch.Tensor] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)


def sa_solver_sample(velocity_fn: Callable[[torch.Tensor, float], torch.Tensor], sample: torch.Tensor,
                     sigmas: Sequence[float] | torch.Tensor, *, tau: float = SA_SOLVER_TAU,
                     noise_range: Sequence[float] = SA_SOLVER_NOISE_RANGE, predictor_order: int = 2,
                     corrector_order: int = 2,
                     generator: torch.Generator | list[torch.Generator] | None = None,
                     return_intermediates: bool = False) -> SASolverOutput:
    """Sample a trajectory with SA-Solver over the noise levels ``sigmas`` (``N + 1`` decreasing levels ending at 0,
    the first below 1: use `sa_solver_sigmas` on a scheduler's levels for AWM's own), ``N`` model calls.

    Args:
        velocity_fn: ``(x, sigma) -> v`` (e.g. a transformer call at timestep ``sigma * 1000``, with CFG if wanted).
        sample: ``x`` at ``sigmas[0]``, shape ``(batch, ...)``.
        tau, noise_range: a step that ends at level ``s`` has stochasticity ``tau`` when ``lo <= s <= hi``, else 0
            (AWM: 0.4 inside [0.3, 0.9]).
        predictor_order, corrector_order: AWM: 2 and 2 (``corrector_order=0``: predictor only).
        generator: one generator, or one per sample, for the noise of steps 1 .. N - 1 (one draw per step).
        return_intermediates: also return the states and the steps' tau.
    """
    _check_orders(predictor_order, corrector_order)
    levels = [float(s) for s in torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1).tolist()]
    steps = len(levels) - 1
    if steps < 2:
        raise ValueError(f"SA-Solver needs at least 2 steps, got noise levels {levels}.")
    if levels[-1] != 0.0:
        raise ValueError(f"the noise levels must end at 0, got {levels[-1]}.")
    if len(noise_range) != 2 or not 0.0 <= noise_range[0] <= noise_range[1]:
        raise ValueError(f"noise_range={list(noise_range)} must be [lo, hi] with 0 <= lo <= hi.")
    if sample.ndim < 1:
        raise ValueError("sample must have a leading batch dimension, got a 0-d tensor.")
    dtype = torch.float64 if sample.dtype == torch.float64 else torch.float32
    x = sample.to(dtype)

    def data_prediction(state: torch.Tensor, sigma: float) -> torch.Tensor:
        v = velocity_fn(state, sigma)
        if v.shape != state.shape:
            raise ValueError(f"velocity_fn returned shape {tuple(v.shape)} for a state of shape {tuple(state.shape)}.")
        return state - sigma * v.to(dtype)

    out = SASolverOutput(sample=sample)
    if return_intermediates:
        out.intermediates.append(x)
    history = [data_prediction(x, levels[0])]  # D_{k-1} last, D_{k-2} before it
    for k in range(1, steps):
        s_prev, s, s_next = (levels[k - 2] if k >= 2 else None), levels[k - 1], levels[k]
        step_tau = sa_solver_tau(s_next, tau, noise_range)
        noise = _draw_noise(x.shape, generator, x.device, dtype)
        use_second = predictor_order == 2 and k >= 2
        x_p = sa_predictor_step(x, s, s_next, history[-1], step_tau, noise,
                                history[-2] if use_second else None, s_prev if use_second else None)
        d_next = data_prediction(x_p, s_next)
        if corrector_order == 0 or (k == 1 and predictor_order == 2):
            x = x_p
        else:
            x = sa_corrector_step(x, s, s_next, history[-1], d_next, step_tau, noise, corrector_order)
        history = [history[-1], d_next]
        if return_intermediates:
            out.intermediates.append(x)
            out.taus.append(step_tau)
    final = history[-1]
    if return_intermediates:
        out.intermediates.append(final)
    out.sample = final.to(sample.dtype)
    return out
