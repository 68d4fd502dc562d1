"""One stochastic (or deterministic) flow-matching step with the exact Gaussian log-density of its result.

Notation (flow matching, ``x_sigma = (1 - sigma) x0 + sigma eps`` so the velocity is ``v = eps - x0``):
``sigma`` is the noise level at the current step (1 = pure noise, 0 = data), ``sigma'`` the one at the next
step, ``dt = sigma' - sigma`` (negative), ``a`` the ``noise_level``.

``sde_type="sde"`` (Flow-GRPO's reverse-time SDE, same marginals as the ODE)::

    sigma_t = a * sqrt(sigma / (1 - sigma))          # sigma == 1: the denominator uses sigma_max_fallback
    mean    = x * (1 + sigma_t^2 dt / (2 sigma)) + v * (1 + sigma_t^2 (1 - sigma) / (2 sigma)) * dt
    std     = sigma_t * sqrt(-dt)

``sde_type="cps"`` (coefficients-preserving sampling)::

    std     = sigma' * sin(a * pi / 2)
    x0_hat  = x - sigma v,   x1_hat = x + (1 - sigma) v
    mean    = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat

``sde_type="dance"`` (DanceGRPO's ``flux_step``, with ``a`` its ``eta``)::

    std     = a * sqrt(sigma - sigma')
    score   = -(x - (x - sigma v) (1 - sigma)) / sigma^2
    mean    = x + (sigma' - sigma) * (v - a^2 / 2 * score)

ODE (``a = 0``)::

    x' = x + v dt,   log_prob = 0,   std = 0

In both stochastic cases ``x' = mean + std * z`` with ``z ~ N(0, I)``, and the log-probability of ``x'`` is the
exact Gaussian log-density, per element

    log N(x'; mean, std^2) = -(x' - mean)^2 / (2 std^2) - log(std) - log(2 pi) / 2

reduced over every non-batch dimension by the mean (default, the convention published clip ranges were tuned for)
or the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

if TYPE_CHECKING:  # pragma: no cover
    from diffusers import FlowMatchEulerDiscreteScheduler

__all__ = [
    "CPS_LOG_PROB_MODES",
    "LOG_PROB_REDUCTIONS",
    "SDE_TYPES",
    "FlowMatchSDESchedulerOutput",
    "compute_dtype_for",
    "reduce_per_sample",
    "sde_step_from_sigmas",
    "sde_step_with_logprob",
]

SDE_TYPES = ("sde", "cps", "dance")
LOG_PROB_REDUCTIONS = ("mean", "sum")
CPS_LOG_PROB_MODES = ("exact", "reference")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class FlowMatchSDESchedulerOutput(BaseOutput):
    """Result of one SDE / CPS / ODE flow-matching step.

    Args:
        prev_sample (`torch.Tensor`, shape of the sample):
            The next sample ``x'``: drawn as ``mean + std * z``, or the ``prev_sample`` that was passed in.
            Sampled results come back in the input dtype (the sample's for the step functions, the model output's
            for ``FlowMatchSDEScheduler.step``, as in diffusers).
        log_prob (`torch.Tensor`, shape `(batch,)`):
            ``log N(prev_sample; prev_sample_mean, std^2)`` reduced over the non-batch dimensions; float32 (float64
            when an input is float64). Zero on deterministic steps (ODE, or ``std == 0``).
        prev_sample_mean (`torch.Tensor`, shape of the sample):
            The transition mean, in the compute dtype (float32, or float64).
        std (`torch.Tensor`, shape `(batch,)`):
            The transition's standard deviation per sample (``sigma_t * sqrt(-dt)`` for ``"sde"``,
            ``sigma' * sin(a pi / 2)`` for ``"cps"``, ``a * sqrt(sigma - sigma')`` for ``"dance"``, 0 for ODE
            steps), in the compute dtype.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std: torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# argument checks and small tensor helpers
# ----------------------------------------------------------------------------------------------------------------


def check_noise_level(noise_level: float, sde_type: str) -> float:
    """Validate and return ``noise_level`` as a float (``>= 0``; at most 1 for ``"cps"``)."""
    if isinstance(noise_level, torch.Tensor):
        if noise_level.numel() != 1:
            raise ValueError(f"noise_level must be a single number, got a tensor of shape {tuple(noise_level.shape)}.")
        noise_level = noise_level.item()
    try:
        value = float(noise_level)
    except (TypeError, ValueError):
        raise ValueError(f"noise_level must be a number, got {noise_level!r}.") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"noise_level={noise_level!r} must be a finite number >= 0 (0 = deterministic ODE step).")
    if sde_type == "cps" and value > 1:
        raise ValueError(
            f"noise_level={noise_level!r} is out of range for sde_type='cps': the CPS std is sigma' * sin(a * pi / 2), "
            "so use 0 <= noise_level <= 1 (1 = all of the next step's noise is fresh)."
        )
    return value


def check_sde_type(sde_type: str) -> str:
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type={sde_type!r} is not supported; use one of {list(SDE_TYPES)}.")
    return sde_type


def check_reduction(reduction: str, name: str = "log_prob_reduction") -> str:
    if reduction not in LOG_PROB_REDUCTIONS:
        raise ValueError(f"{name}={reduction!r} is not supported; use one of {list(LOG_PROB_REDUCTIONS)}.")
    return reduction


def check_cps_log_prob(mode: str) -> str:
    if mode not in CPS_LOG_PROB_MODES:
        raise ValueError(
            f"cps_log_prob={mode!r} is not supported; use 'exact' (the Gaussian log-density, default) or "
            "'reference' (the reference implementation's constant-free -(x' - mean)^2, for reproducing its numbers)."
        )
    return mode


def compute_dtype_for(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32 (bf16 / fp16 / fp32 are all computed in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def reduce_per_sample(values: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce every dimension but the first (batch) by ``"mean"`` or ``"sum"``; shape ``(batch,)``."""
    if values.ndim <= 1:
        return values
    dims = tuple(range(1, values.ndim))
    return values.mean(dim=dims) if reduction == "mean" else values.sum(dim=dims)


def per_sample_values(
    value: float | torch.Tensor, batch: int, name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A scalar, a 0-d tensor or a tensor holding one value per sample -> a 1-D tensor of shape ``(batch,)``."""
    if not isinstance(value, torch.Tensor):
        try:
            return torch.full((batch,), float(value), dtype=dtype, device=device)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number or a tensor, got {value!r}.") from None
    t = value.detach().to(device=device, dtype=dtype)
    if t.numel() == 1:
        return t.reshape(1).expand(batch)
    if t.numel() == batch and t.shape[0] == batch:
        return t.reshape(batch)
    raise ValueError(
        f"{name} must be a scalar or hold one value per sample (batch size {batch}); got shape {tuple(value.shape)}."
    )


def _broadcast_shape(batch: int, ndim: int) -> tuple[int, ...]:
    return (batch,) + (1,) * (ndim - 1)


def _draw_noise(
    shape: torch.Size,
    generator: torch.Generator | list[torch.Generator] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(
                f"Got a list of {len(generator)} generators for a batch of {shape[0]} samples; pass one generator, "
                "or exactly one per sample."
            )
        generator = list(generator)
    return randn_tensor(tuple(shape), generator=generator, device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# the step
# ----------------------------------------------------------------------------------------------------------------


def flow_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    prev_sample: torch.Tensor | None,
    noise_level: float,
    sde_type: str,
    generator,
    log_prob_reduction: str,
    sigma_max_fallback: float | torch.Tensor | None,
    cps_log_prob: str,
    out_dtype: torch.dtype,
) -> FlowMatchSDESchedulerOutput:
    """Shared implementation; ``out_dtype`` is the dtype a freshly sampled ``prev_sample`` is returned in."""
    sde_type = check_sde_type(sde_type)
    noise_level = check_noise_level(noise_level, sde_type)
    check_reduction(log_prob_reduction)
    check_cps_log_prob(cps_log_prob)
    if sample.ndim < 1:
        raise ValueError("sample must have a leading batch dimension, got a 0-d tensor.")
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output has shape {tuple(model_output.shape)} but sample has shape {tuple(sample.shape)}; "
            "they must match."
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample has shape {tuple(prev_sample.shape)} but sample has shape {tuple(sample.shape)}; "
            "they must match."
        )

    batch, device = sample.shape[0], sample.device
    dtype = compute_dtype_for(sample, model_output, prev_sample)
    bshape = _broadcast_shape(batch, sample.ndim)

    x = sample.to(dtype)
    v = model_output.to(dtype)
    s = per_sample_values(sigma, batch, "sigma", dtype, device)
    s_next = per_sample_values(sigma_next, batch, "sigma_next", dtype, device)
    s_b, s_next_b = s.view(bshape), s_next.view(bshape)
    dt = s_next_b - s_b

    if noise_level == 0.0:  # deterministic Euler (ODE) step
        mean = x + dt * v
        if prev_sample is None:
            prev_sample = mean.to(out_dtype)
        zeros = torch.zeros(batch, dtype=dtype, device=device)
        return FlowMatchSDESchedulerOutput(
            prev_sample=prev_sample, log_prob=zeros, prev_sample_mean=mean, std=torch.zeros_like(zeros)
        )

    if sde_type == "sde":
        # sigma == 1 would divide by zero in sigma / (1 - sigma): use the fallback value in the denominator there.
        if sigma_max_fallback is None:
            fallback = s_next
        else:
            fallback = per_sample_values(sigma_max_fallback, batch, "sigma_max_fallback", dtype, device)
        sigma_denominator = torch.where(s >= 1, fallback, s)
        one_minus = (1 - sigma_denominator).clamp_min(torch.finfo(dtype).tiny)
        sigma_t = noise_level * torch.sqrt(s.clamp_min(0) / one_minus)
        # sigma_t^2 / (2 sigma) simplifies to a^2 / (2 (1 - sigma)); this form stays finite as sigma -> 0.
        half_var_over_sigma = ((noise_level**2) / (2 * one_minus)).view(bshape)
        mean = x * (1 + half_var_over_sigma * dt) + v * (1 + half_var_over_sigma * (1 - s_b)) * dt
        std = sigma_t * torch.sqrt((s - s_next).clamp_min(0))
    elif sde_type == "dance":
        return _dance_step(x, model_output, s, s_next, prev_sample, noise_level, generator, log_prob_reduction,
                           dtype, out_dtype)
    else:  # "cps"
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s_b * v
        x1_hat = x + (1 - s_b) * v
        x1_coef = torch.sqrt((s_next_b**2 - std.view(bshape) ** 2).clamp_min(0))
        mean = (1 - s_next_b) * x0_hat + x1_coef * x1_hat

    std_b = std.view(bshape)
    if prev_sample is None:
        noise = _draw_noise(sample.shape, generator, device, dtype)
        prev_sample = (mean + std_b * noise).to(out_dtype)
    # The density is that of the sample as returned (after any rounding to the input dtype), so recomputing it
    # later from the stored sample gives exactly the same number. The sample itself is a constant here.
    target = prev_sample.detach().to(dtype)

    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std)).view(bshape)
    sq_err = (target - mean) ** 2
    if sde_type == "cps" and cps_log_prob == "reference":
        log_density = -sq_err
    else:
        log_density = -sq_err / (2 * safe_std**2) - torch.log(safe_std) - _HALF_LOG_2PI
    log_prob = torch.where(stochastic, reduce_per_sample(log_density, log_prob_reduction), torch.zeros_like(std))
    return FlowMatchSDESchedulerOutput(prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=mean, std=std)


def _scaled_velocity(scale: torch.Tensor, model_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * v`` as DanceGRPO's ``flux_step`` computes it: a float32 noise level (a 0-d tensor there) times a
    bf16 / fp16 model output is a product in the model output's dtype, the noise level rounded to that dtype first;
    the product is then added to float32 states."""
    if model_output.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32:
        return (scale.to(model_output.dtype) * model_output).to(dtype)
    return scale * model_output.to(dtype)


def _dance_step(
    x: torch.Tensor,
    model_output: torch.Tensor,
    s: torch.Tensor,
    s_next: torch.Tensor,
    prev_sample: torch.Tensor | None,
    eta: float,
    generator,
    log_prob_reduction: str,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> FlowMatchSDESchedulerOutput:
    """DanceGRPO's step (official ``fastvideo/train_grpo_flux.py``, ``flux_step`` with ``sde_solver=True``).

    ``std = eta sqrt(sigma - sigma')``; ``x0_hat = x - sigma v``; ``score = -(x - (1 - sigma) x0_hat) / sigma^2``;
    ``mean = x + (sigma' - sigma) v - eta^2 / 2 score (sigma' - sigma)``; the exact Gaussian log-density of ``x'``.

    The arithmetic follows the official function operation by operation: the state in float32, the products of a
    noise level and a bf16 / fp16 velocity rounded to the velocity's dtype, ``std`` in double precision from the
    float32 noise-level difference, and the ``log sqrt(2 pi)`` constant computed in float32. The log-density is
    reduced over the non-batch dimensions as for the other types (the official function takes the mean).
    """
    batch = x.shape[0]
    bshape = _broadcast_shape(batch, x.ndim)
    s_b, s_next_b = s.view(bshape), s_next.view(bshape)
    dsigma = s_next_b - s_b
    mean = x + _scaled_velocity(dsigma, model_output, dtype)
    x0_hat = x - _scaled_velocity(s_b, model_output, dtype)
    score = -(x - x0_hat * (1 - s_b)) / s_b**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    # std_dev_t = eta * math.sqrt(sigma - sigma'): the difference in the compute dtype, the root in double precision
    std64 = eta * torch.sqrt((s - s_next).clamp_min(0).to(torch.float64))
    std = std64.to(dtype)
    std_b = std.view(bshape)
    if prev_sample is None:
        noise = _draw_noise(x.shape, generator, x.device, dtype)
        prev_sample = (mean + noise * std_b).to(out_dtype)
    target = prev_sample.detach().to(dtype)
    stochastic = std64 > 0
    safe_std64 = torch.where(stochastic, std64, torch.ones_like(std64))
    two_var = (2 * safe_std64**2).to(dtype).view(bshape)
    log_std = torch.log(safe_std64).to(dtype).view(bshape)
    log_sqrt_2pi = torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=dtype))).to(x.device)
    log_density = -((target - mean) ** 2) / two_var - log_std - log_sqrt_2pi
    log_prob = torch.where(stochastic, reduce_per_sample(log_density, log_prob_reduction),
                           torch.zeros_like(std))
    return FlowMatchSDESchedulerOutput(prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=mean, std=std)


def sde_step_from_sigmas(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    generator: torch.Generator | list[torch.Generator] | None = None,
    log_prob_reduction: str = "mean",
    sigma_max_fallback: float | torch.Tensor | None = None,
    *,
    cps_log_prob: str = "exact",
) -> FlowMatchSDESchedulerOutput:
    r"""One flow-matching step from ``sigma`` to ``sigma_next`` with the log-probability of its result.

    Formulas (``dt = sigma' - sigma``, ``a = noise_level``, ``v = model_output``, ``x = sample``):

    - ``"sde"``: ``sigma_t = a sqrt(sigma / (1 - sigma))``,
      ``mean = x (1 + sigma_t^2 dt / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt``,
      ``std = sigma_t sqrt(-dt)``.
    - ``"cps"``: ``std = sigma' sin(a pi / 2)``, ``mean = (1 - sigma') (x - sigma v) + sqrt(sigma'^2 - std^2)
      (x + (1 - sigma) v)``.
    - ``"dance"`` (DanceGRPO): ``std = a sqrt(sigma - sigma')``, ``score = -(x - (x - sigma v)(1 - sigma)) /
      sigma^2``, ``mean = x + dt (v - a^2 / 2 score)``.
    - ``noise_level == 0``: the ODE step ``x' = x + v dt`` with ``log_prob = 0`` and ``std = 0``.

    ``x' = mean + std z``, ``z ~ N(0, I)``, and ``log_prob`` is the exact Gaussian log-density
    ``-(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2`` reduced over the non-batch dimensions. Samples whose
    ``std`` is 0 (ODE steps, ``sigma' == sigma``, or ``"cps"`` stepping to ``sigma' = 0``) are deterministic and get
    ``log_prob = 0``. Everything is computed in float32 (float64 when any input is float64); no gradient flows
    through ``prev_sample`` in the log-density, only through the mean (i.e. through ``model_output``).

    Args:
        model_output: velocity prediction ``v`` (after guidance), same shape as ``sample``.
        sample: current sample ``x``, shape ``(batch, ...)``.
        sigma, sigma_next: noise levels of this step and the next, each a number, a 0-d tensor or a tensor with one
            value per sample (``(batch,)``, or ``(batch, 1, ...)``).
        prev_sample: if given, nothing is sampled: the log-probability of this next sample is returned (the
            training path), and it is returned unchanged as ``prev_sample``.
        noise_level: ``a >= 0`` (``<= 1`` for ``"cps"``); 0 gives the ODE step.
        sde_type: ``"sde"``, ``"cps"`` or ``"dance"``.
        generator: a ``torch.Generator`` or a list with one per sample, as in diffusers' ``randn_tensor``.
        log_prob_reduction: ``"mean"`` (default) or ``"sum"`` over the non-batch dimensions.
        sigma_max_fallback: for ``"sde"``, the value used in the ``1 - sigma`` denominator of ``sigma_t`` where
            ``sigma == 1`` (pure noise), normally the schedule's ``sigmas[1]``. When ``None``, ``sigma_next`` is used
            there, which equals ``sigmas[1]`` whenever the step starts at the schedule's first noise level
            ``sigmas[0] = 1``; pass the schedule's value when steps from ``sigma = 1`` can go elsewhere (custom
            schedules). A number, a 0-d tensor or one value per sample.
        cps_log_prob: ``"exact"`` (default) or ``"reference"``: the reference implementation's CPS log-prob
            ``-(x' - mean)^2`` without the variance and constants, only for reproducing published numbers. It is
            not a log-density, and its scale differs from the ``"sde"`` one.

    Returns:
        `FlowMatchSDESchedulerOutput` with ``prev_sample`` (the sample's dtype when drawn here), ``log_prob``
        ``(batch,)``, ``prev_sample_mean`` and ``std`` ``(batch,)``.
    """
    return flow_step(
        model_output,
        sample,
        sigma,
        sigma_next,
        prev_sample,
        noise_level,
        sde_type,
        generator,
        log_prob_reduction,
        sigma_max_fallback,
        cps_log_prob,
        out_dtype=sample.dtype,
    )


def step_indices_for_timesteps(
    scheduler: FlowMatchEulerDiscreteScheduler, timestep: float | torch.Tensor, batch: int
) -> torch.Tensor:
    """Indices into ``scheduler.timesteps`` of a scalar or per-sample timestep, vectorised; shape ``(batch,)``.

    Each timestep is matched to the nearest schedule timestep; one further from every schedule timestep than
    ``1e-3 * num_train_timesteps`` raises a ValueError (that check reads one number back from the device).
    """
    schedule = getattr(scheduler, "timesteps", None)
    if schedule is None or getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError("The scheduler has no timesteps yet; call scheduler.set_timesteps(...) first.")
    lookup_dtype = torch.float32 if schedule.device.type == "mps" else torch.float64  # mps has no float64
    schedule = schedule.detach().to(lookup_dtype)
    t = torch.as_tensor(timestep).detach().to(device=schedule.device, dtype=lookup_dtype).reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch)
    elif t.numel() != batch:
        raise ValueError(
            f"timestep must be a scalar or a 1-D tensor with one timestep per sample (batch size {batch}); "
            f"got {t.numel()} values."
        )
    distance = (t[:, None] - schedule[None, :]).abs()
    nearest, indices = distance.min(dim=1)
    tolerance = 1e-3 * float(getattr(scheduler.config, "num_train_timesteps", 1000))
    worst = float(nearest.max())
    if worst > tolerance:
        bad = t[int(nearest.argmax())].item()
        raise ValueError(
            f"timestep {bad:.6g} is not one of the scheduler's timesteps (nearest is {worst:.4g} away); pass values "
            "from scheduler.timesteps (in float32, not rounded to bf16/fp16) after the same set_timesteps call."
        )
    return indices


def sde_step_with_logprob(
    scheduler: FlowMatchEulerDiscreteScheduler,
    model_output: torch.Tensor,
    timestep: float | torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    noise_level: float = 0.7,
    sde_type: str = "sde",
    generator: torch.Generator | list[torch.Generator] | None = None,
    *,
    log_prob_reduction: str | None = None,
    cps_log_prob: str | None = None,
) -> FlowMatchSDESchedulerOutput:
    r"""`sde_step_from_sigmas` at the scheduler's timestep(s): SDE / CPS / ODE step with log-probability.

    ``timestep`` is a scalar or a 1-D tensor of per-sample timesteps taken from ``scheduler.timesteps``. The
    current and next noise levels are looked up vectorised: ``sigma = scheduler.sigmas[i]``,
    ``sigma' = scheduler.sigmas[i + 1]`` where ``scheduler.timesteps[i]`` is the timestep. At pure noise
    (``sigma == 1``) the ``"sde"`` std uses ``scheduler.sigmas[1]`` in its denominator. The scheduler's own step
    counter is neither read nor advanced, and its SDE window is ignored: ``noise_level`` decides (0 = ODE).

    See `sde_step_from_sigmas` for the formulas and the other arguments. ``log_prob_reduction`` and
    ``cps_log_prob`` default to the scheduler's config values when it has them (``FlowMatchSDEScheduler``),
    otherwise to ``"mean"`` and ``"exact"``.
    """
    config = getattr(scheduler, "config", {})
    if log_prob_reduction is None:
        log_prob_reduction = config.get("log_prob_reduction", "mean")
    if cps_log_prob is None:
        cps_log_prob = config.get("cps_log_prob", "exact")
    if sample.ndim < 1:
        raise ValueError("sample must have a leading batch dimension, got a 0-d tensor.")
    indices = step_indices_for_timesteps(scheduler, timestep, sample.shape[0])
    sigmas = scheduler.sigmas.to(device=indices.device)
    sigma = sigmas[indices]
    sigma_next = sigmas[indices + 1]
    fallback = scheduler.sigmas[1] if scheduler.sigmas.numel() > 1 else None
    return flow_step(
        model_output,
        sample,
        sigma,
        sigma_next,
        prev_sample,
        noise_level,
        sde_type,
        generator,
        log_prob_reduction,
        fallback,
        cps_log_prob,
        out_dtype=sample.dtype,
    )
