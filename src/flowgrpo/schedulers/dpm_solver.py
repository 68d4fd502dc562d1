"""Deterministic flow-matching solvers: Euler and DPM-Solver++ 2M, one step or a whole trajectory.

Flow matching writes ``x_sigma = alpha x0 + sigma eps`` with ``alpha = 1 - sigma``, so the velocity ``v = eps - x0``
gives the data prediction ``x0_hat = x - sigma v``. The probability-flow ODE ``dx/dsigma = v`` is solved from
``sigma_s`` to ``sigma_t < sigma_s``:

**Euler** (first order)::

    x_t = x_s + (sigma_t - sigma_s) v

**DPM-Solver++ 2M** (Lu et al. 2022, multistep, data prediction) in the half log-SNR
``lambda = log(alpha / sigma) = log((1 - sigma) / sigma)``, with ``h = lambda_t - lambda_s`` and ``D0 = x0_hat``
at the current step::

    x_t = (sigma_t / sigma_s) x_s - alpha_t (exp(-h) - 1) (D0 + D1 / 2)
    D1  = (D0 - D0_prev) / r0,   r0 = h_prev / h,   h_prev = lambda_s - lambda_prev

where ``D0_prev`` is the data prediction of the previous step (taken at ``sigma_prev``). Without a previous step
(the first step of a trajectory), and on the final step (to ``sigma_t = 0`` the step is infinite in lambda),
the step is first order: ``D1 = 0``. Since ``exp(-h) = alpha_s sigma_t / (sigma_s alpha_t)`` the coefficient
``-alpha_t (exp(-h) - 1)`` equals ``alpha_t - alpha_s sigma_t / sigma_s``, which stays finite at ``sigma_s = 1``
(pure noise) and at ``sigma_t = 0``; the step is computed in that form. The first-order step is then exactly
the Euler step (its ``x`` coefficient is ``sigma_t + alpha_t = 1``, its ``v`` coefficient ``sigma_t - sigma_s``).
A previous step that started at ``sigma_prev = 1`` has ``h_prev = inf``, so ``D1 = 0`` there as well (the limit
of the formula).

The error of DPM-Solver++ 2M against the exact ODE solution falls as the square of the step size (Euler's as the
step size); ``tests/schedulers/test_algorithm_variants.py`` checks both orders on a Gaussian problem with the exact velocity.

``compress_sigmas`` makes a coarser schedule over the same range (MixGRPO-Flash solves the steps after the SDE
window with fewer solver steps); ``solve_flow_ode`` integrates a trajectory over a list of noise levels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ODE_SOLVERS",
    "FlowODESolver",
    "compress_sigmas",
    "dpmpp_2m_step",
    "euler_step",
    "solve_flow_ode",
]

ODE_SOLVERS = ("euler", "dpmpp_2m")


def check_ode_solver(solver: str, name: str = "ode_solver") -> str:
    if solver not in ODE_SOLVERS:
        raise ValueError(f"{name}={solver!r} is not valid; choose one of {', '.join(map(repr, ODE_SOLVERS))}.")
    return solver


def _as_float(value: float | torch.Tensor, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one noise level for the whole batch, got shape {tuple(value.shape)}.")
        return float(value.item())
    return float(value)


def _lambda(sigma: float) -> float:
    """Half log-SNR ``log((1 - sigma) / sigma)``; ``-inf`` at ``sigma = 1``, ``+inf`` at ``sigma = 0``."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log1p(-sigma) - math.log(sigma)


def euler_step(sample: torch.Tensor, model_output: torch.Tensor, sigma: float | torch.Tensor,
               sigma_next: float | torch.Tensor) -> torch.Tensor:
    """``x' = x + (sigma' - sigma) v`` (the flow-matching Euler step)."""
    return sample + (_as_float(sigma_next, "sigma_next") - _as_float(sigma, "sigma")) * model_output


@dataclass
class DPMSolverStepOutput:
    """Result of one DPM-Solver++ step: the next sample and this step's data prediction ``x0_hat = x - sigma v``
    (pass it as ``prev_data_prediction`` to the next step)."""

    prev_sample: torch.Tensor
    data_prediction: torch.Tensor


def dpmpp_2m_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    prev_data_prediction: torch.Tensor | None = None,
    sigma_prev: float | torch.Tensor | None = None,
    first_order: bool = False,
) -> DPMSolverStepOutput:
    r"""One DPM-Solver++ 2M step from ``sigma`` to ``sigma_next`` (see the module docstring for the formulas).

    Args:
        sample: ``x_s``, shape ``(batch, ...)``.
        model_output: the velocity ``v`` at ``(x_s, sigma)``, same shape.
        sigma, sigma_next: the step's noise levels (one for the whole batch), ``1 >= sigma > sigma_next >= 0``.
        prev_data_prediction: ``D0`` of the previous step (``None``: first order).
        sigma_prev: the noise level the previous step started from (needed with ``prev_data_prediction``).
        first_order: force the first-order step (the final step of a trajectory).

    Returns:
        `DPMSolverStepOutput` with ``prev_sample`` (the sample's dtype) and ``data_prediction``.
    """
    s, t = _as_float(sigma, "sigma"), _as_float(sigma_next, "sigma_next")
    if not 0.0 <= t < s <= 1.0:
        raise ValueError(f"a DPM-Solver step needs 1 >= sigma > sigma_next >= 0, got sigma={s}, sigma_next={t}.")
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output has shape {tuple(model_output.shape)} but sample has {tuple(sample.shape)}.")
    alpha_s, alpha_t = 1.0 - s, 1.0 - t
    d0 = sample - s * model_output
    # -alpha_t (exp(-h) - 1) written without lambdas: finite at sigma = 1 and at sigma_next = 0.
    coef = alpha_t - alpha_s * t / s
    x_coef = t / s
    direction = d0
    use_history = prev_data_prediction is not None and not first_order and t > 0.0
    if use_history:
        if sigma_prev is None:
            raise ValueError("prev_data_prediction needs sigma_prev, the noise level the previous step started at.")
        p = _as_float(sigma_prev, "sigma_prev")
        if not p > s:
            raise ValueError(f"sigma_prev={p} must be larger than sigma={s} (steps go from noise to data).")
        h = _lambda(t) - _lambda(s)
        h_prev = _lambda(s) - _lambda(p)
        if math.isfinite(h_prev):  # h_prev = inf (previous step from pure noise): D1 = 0, the formula's limit
            r0 = h_prev / h
            direction = d0 + (d0 - prev_data_prediction) / (2.0 * r0)
    prev_sample = x_coef * sample + coef * direction
    return DPMSolverStepOutput(prev_sample=prev_sample.to(sample.dtype), data_prediction=d0)


class FlowODESolver:
    """Stateful deterministic solver for a trajectory walked step by step (``"euler"`` or ``"dpmpp_2m"``).

    ``step(x, v, sigma, sigma_next, final=...)`` returns the next sample and keeps what the multistep method needs
    (the previous data prediction and noise level). Call `reset` where the deterministic trajectory is broken
    (after stochastic steps): the next step is then first order again. ``final=True`` marks the trajectory's last
    step (first order for DPM-Solver++).
    """

    def __init__(self, solver: str = "dpmpp_2m"):
        self.solver = check_ode_solver(solver, "solver")
        self.reset()

    def reset(self) -> None:
        self._prev_d0: torch.Tensor | None = None
        self._prev_sigma: float | None = None

    def step(self, sample: torch.Tensor, model_output: torch.Tensor, sigma: float | torch.Tensor,
             sigma_next: float | torch.Tensor, final: bool = False) -> torch.Tensor:
        if self.solver == "euler":
            return euler_step(sample, model_output, sigma, sigma_next)
        out = dpmpp_2m_step(sample, model_output, sigma, sigma_next, self._prev_d0, self._prev_sigma,
                            first_order=final)
        self._prev_d0, self._prev_sigma = out.data_prediction, _as_float(sigma, "sigma")
        return out.prev_sample


def compress_sigmas(sigmas: Sequence[float] | torch.Tensor, ratio: float) -> list[float]:
    """A coarser schedule over the same range: ``max(1, int(n * ratio))`` steps instead of ``n = len(sigmas) - 1``.

    The new noise levels sit at evenly spaced fractional positions ``u_k = k n / m`` (``k = 0 .. m``) of the given
    schedule, read by linear interpolation between its neighbouring entries; so the first and last levels are
    kept, the schedule's shape (its shift) is followed, and ``ratio = 1`` returns the schedule unchanged.

    Args:
        sigmas: ``n + 1`` decreasing noise levels (``n >= 1``).
        ratio: in ``(0, 1]``.
    """
    values = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    n = len(values) - 1
    if n < 1:
        raise ValueError(f"compress_sigmas needs at least two noise levels, got {values}.")
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise ValueError(f"ratio={ratio!r} must be in (0, 1].")
    m = max(1, int(n * ratio))
    if m == n:
        return values
    out = []
    for k in range(m + 1):
        u = k * n / m
        i = min(int(math.floor(u)), n - 1)
        frac = u - i
        out.append(values[i] + frac * (values[i + 1] - values[i]))
    out[-1] = values[-1]
    return out


def solve_flow_ode(
    velocity_fn: Callable[[torch.Tensor, float], torch.Tensor],
    sample: torch.Tensor,
    sigmas: Sequence[float] | torch.Tensor,
    solver: str = "dpmpp_2m",
    lower_order_final: bool = True,
) -> torch.Tensor:
    """Integrate ``dx/dsigma = v(x, sigma)`` from ``sigmas[0]`` to ``sigmas[-1]`` deterministically.

    Args:
        velocity_fn: ``(x, sigma) -> v`` (e.g. a transformer call at timestep ``sigma * 1000``).
        sample: the starting point ``x`` at ``sigmas[0]``.
        sigmas: decreasing noise levels, ``len(sigmas) - 1`` steps.
        solver: ``"euler"`` or ``"dpmpp_2m"`` (first order on the first step; see the module docstring).
        lower_order_final: take the last step first order (needed when it ends at ``sigma = 0``).
    """
    values = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    ode = FlowODESolver(solver)
    x = sample
    for i in range(len(values) - 1):
        v = velocity_fn(x, values[i])
        x = ode.step(x, v, values[i], values[i + 1], final=lower_order_final and i == len(values) - 2)
    return x
