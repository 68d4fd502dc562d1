r"""Advantage Weighted Matching (AWM, arXiv 2509.25050; official ``scripts/train_sd3_awm.py``), as pure functions.

Notation: x0 a rollout's clean sample, A its advantage, T = ``train_timesteps`` noise levels t_1 .. t_T (shared by
the micro-batch, drawn by `sample_train_timesteps`), eps_k fresh noise per level and sample,
x_k = (1 - t_k) x0 + t_k eps_k, v_k = v_theta(x_k, t_k).

* Log-likelihood surrogate (`awm_log_prob`): e_k = mean((v_k - (eps_k - x0))^2) over the non-batch dimensions, in
  float64, and by ``weighting``

      Uniform: -e    t: -e t    t**2: -e t^2    huber: -(sqrt(e + 1e-10) - 1e-5) t
      ghuber:  -((e + 1e-10)^p - (1e-10)^p) t / p          (p = ``ghuber_power``)

* Advantages (`scale_advantages`): clipped to +-C (``adv_clip_max``), then A <- A / C * ``advantage_max``.
* Ratio and clipped loss (`awm_policy_loss`), with logp_old the same surrogate under the sampling policy (no
  gradient; on-policy it equals logp in value, so the ratio is 1):

      exp_first: r_k = exp(logp_k - logp_old_k) per (level, sample); loss = mean_{k,b} max(-A r, -A clip(r, 1 +- eps))
      sum_first: r = exp(mean_k logp_k - mean_k logp_old_k) per sample;  loss = mean_b max(-A r, -A clip(r, 1 +- eps))

* Velocity KL (`velocity_kl`) to the reference (and, with ``ema_beta``, to the EMA adapter):
  mean over levels and samples of mean((v_k - v_other_k)^2) (``Uniform``), or that divided by 2 s_k^2 with
  s_k = 0.7 sqrt(t_k / (1 - min(t_k, 0.99))) (``ELBO``).
* Loss = policy + beta KL_ref + ema_beta KL_ema (the official code adds the EMA term only when beta > 0).
* EMA adapter after optimizer step k (`ema_adapter_decay`): theta_ema <- d theta_ema + (1 - d) theta with
  d = min(``kl_ema_decay``, 0.001 k) (``linear``) or ``kl_ema_decay`` (``constant``).

On-policy with exp_first the gradient of the policy loss with respect to logp_k of sample b is -A_b / (T B): samples
better than average raise their weighted flow-matching likelihood at every trained level, worse ones lower it.
``tests/trainer/algorithms/test_awm.py`` checks loss and gradient against an independent computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...schedulers.flow_matching import flow_matching_error
from .flow_grpo_loss import gated_mean

#: AWM's std of the ``ELBO`` KL weight: 0.7 sqrt(t / (1 - min(t, 0.99))) (Flow-GRPO's SDE std at noise level 0.7)
ELBO_NOISE_LEVEL = 0.7

__all__ = ["AWMLoss", "awm_log_prob", "awm_loss", "awm_policy_loss", "ema_adapter_decay", "elbo_std",
           "sample_train_timesteps", "scale_advantages", "velocity_kl"]


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


def sample_train_timesteps(time_type: str, train_timesteps: int, batch: int, rollout_sigmas: torch.Tensor,
                           timestep_fraction: float, time_shift: float,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """The T = ``train_timesteps`` noise levels of one micro-batch of ``batch`` samples, level-major: shape
    ``(T * batch,)`` with entry ``k * batch + b`` the level of sample b at draw k (as the official code lays them).

    ``rollout_sigmas``: the rollout's noise levels, one per sampling step (``sigmas[:-1]``). The discrete types pick
    rollout levels, one uniformly inside each of T bins of the step indices (``discrete``: bins of [0, n],
    ``discrete_wo_init``: of [1, n], ``discrete_with_init``: step 0 plus T - 1 bins of [1, n];
    n = int(steps x timestep_fraction)), the same for every sample. ``uniform``: per sample, one level uniformly in
    each of T equal bins of [0.2, 1], the bins in random order, then shifted. ``logit_normal``: T levels shared by
    the micro-batch, stratified in the standard normal's quantiles, in random order, through a sigmoid and the shift,
    at least 0.01.
    """
    steps = rollout_sigmas.shape[0]
    count = int(steps * timestep_fraction)
    if time_type in ("discrete", "discrete_wo_init"):
        start = 0 if time_type == "discrete" else 1
        bounds = torch.linspace(start, count, steps=train_timesteps + 1)
        lower, upper = bounds[:-1].long(), bounds[1:].long()
        u = torch.rand(train_timesteps, generator=generator)
        index = lower + (u * (upper - lower)).long()
    elif time_type == "discrete_with_init":
        index = torch.zeros(1, dtype=torch.long)
        remaining = train_timesteps - 1
        if remaining > 0:
            bounds = torch.linspace(1, count, steps=remaining + 1)
            lower, upper = bounds[:-1].long(), bounds[1:].long()
            u = torch.rand(remaining, generator=generator)
            index = torch.cat([index, lower + (u * (upper - lower)).long()])
    elif time_type == "uniform":
        lo, hi = 0.20, 1.0
        u = torch.rand(train_timesteps, batch, generator=generator)
        strata = (torch.arange(train_timesteps).unsqueeze(1) + u) / train_timesteps
        matrix = lo + strata * (hi - lo)
        order = torch.rand(matrix.shape, generator=generator).argsort(dim=0)
        t = _shift(torch.gather(matrix, 0, order).flatten(), time_shift)
        return t.to(rollout_sigmas.device, torch.float32)
    elif time_type == "logit_normal":
        base = (torch.arange(train_timesteps) + torch.rand(train_timesteps, generator=generator)) / train_timesteps
        u = torch.distributions.Normal(0.0, 1.0).icdf(base)
        u = u[torch.randperm(train_timesteps, generator=generator)]
        t = _shift(torch.sigmoid(u), time_shift)
        t = torch.repeat_interleave(t, repeats=batch).clamp(min=0.01)
        return t.to(rollout_sigmas.device, torch.float32)
    else:
        raise ValueError(f"time_type={time_type!r} is not valid; choose one of 'discrete', 'discrete_with_init', "
                         "'discrete_wo_init', 'uniform', 'logit_normal'.")
    index = index.clamp(max=steps - 1).to(rollout_sigmas.device)
    return torch.repeat_interleave(rollout_sigmas[index].float(), repeats=batch)


def awm_log_prob(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, weighting: str,
                 ghuber_power: float = 0.25) -> torch.Tensor:
    """The weighted log-likelihood surrogate per (level, sample) row, in float64 (see the module docstring)."""
    log_prob = -flow_matching_error(v, noise, x0, dtype=torch.float64)
    t = t.reshape(-1).to(log_prob)
    if weighting == "Uniform":
        return log_prob
    if weighting == "t":
        return log_prob * t
    if weighting == "t**2":
        return log_prob * t**2
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=log_prob.dtype, device=log_prob.device)
        return -(torch.pow(-log_prob + 1e-10, ghuber_power) - torch.pow(floor, ghuber_power)) * t / ghuber_power
    raise ValueError(f"weighting={weighting!r} is not valid; choose one of 'Uniform', 't', 't**2', 'huber', 'ghuber'.")


def scale_advantages(advantages: torch.Tensor, adv_clip_max: float, advantage_max: float | None) -> torch.Tensor:
    """Clip to +-adv_clip_max, then rescale to +-advantage_max (``None``: no rescaling)."""
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        advantages = advantages / adv_clip_max * advantage_max
    return advantages


def awm_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                    loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped loss from ``(T, B)`` log-probs and ``(B,)`` advantages; returns (loss, ratio)."""
    old_log_prob = old_log_prob.detach()
    if loss_type == "sum_first":
        ratio = torch.exp(log_prob.mean(dim=0) - old_log_prob.mean(dim=0))
        adv = advantages.to(ratio)
    elif loss_type == "exp_first":
        ratio = torch.exp(log_prob - old_log_prob).reshape(-1)
        adv = advantages.to(ratio).unsqueeze(0).expand(log_prob.shape[0], -1).reshape(-1)
    else:
        raise ValueError(f"loss_type={loss_type!r} is not valid; choose 'sum_first' or 'exp_first'.")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


def elbo_std(t: torch.Tensor) -> torch.Tensor:
    """0.7 sqrt(t / (1 - min(t, 0.99))), the std of the ``ELBO`` KL weight."""
    return torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99))) * ELBO_NOISE_LEVEL


def velocity_kl(v: torch.Tensor, v_other: torch.Tensor, t: torch.Tensor, weight: str,
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """mean over rows of mean((v - sg(v_other))^2) (``Uniform``), each row divided by 2 elbo_std(t)^2 (``ELBO``);
    computed in float64. ``gate`` (GARDO, ``(B,)`` booleans for level-major rows ``T * B``): the mean over the gated
    samples' rows only (0 when none is gated)."""
    diff = (v.to(torch.float64) - v_other.detach().to(torch.float64)) ** 2
    per_row = diff.mean(dim=tuple(range(1, diff.ndim)))
    if weight == "ELBO":
        per_row = per_row / (2 * elbo_std(t.reshape(-1).to(per_row)) ** 2)
    elif weight != "Uniform":
        raise ValueError(f"kl weight {weight!r} is not valid; choose 'Uniform' or 'ELBO'.")
    if gate is not None:
        gate = gate.reshape(-1).to(device=per_row.device, dtype=torch.bool).repeat(per_row.numel() // gate.numel())
    return gated_mean(per_row, gate)


def ema_adapter_decay(step: int, kl_ema_decay: float, decay_type: str) -> float:
    """d after optimizer step ``step``: ``min(kl_ema_decay, 0.001 step)`` (``linear``) or ``kl_ema_decay``."""
    if decay_type == "linear":
        return float(min(kl_ema_decay, 0.001 * step))
    if decay_type == "constant":
        return float(kl_ema_decay)
    raise ValueError(f"kl_ema_decay_type={decay_type!r} is not valid; choose 'linear' or 'constant'.")


@dataclass
class AWMLoss:
    """What `awm_loss` returns: the scalar ``loss`` to differentiate and its parts."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None
    ema_kl: torch.Tensor | None


def awm_loss(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, advantages: torch.Tensor,
             old_log_prob: torch.Tensor | None, *, train_timesteps: int, weighting: str = "ghuber",
             ghuber_power: float = 0.25, loss_type: str = "exp_first", clip_range: float = 1.0,
             adv_clip_max: float = 5.0, advantage_max: float | None = 1.0, v_ref: torch.Tensor | None = None,
             beta: float = 0.0, kl_weight: str = "Uniform", v_ema: torch.Tensor | None = None, ema_beta: float = 0.0,
             kl_ema_weight: str = "Uniform", kl_gate: torch.Tensor | None = None) -> AWMLoss:
    """AWM's loss for one micro-batch: rows of ``v``, ``noise``, ``x0`` and ``t`` are level-major (``T * B``);
    ``advantages`` ``(B,)``; ``old_log_prob`` ``(T, B)`` or ``None`` (on-policy: the current values, detached);
    ``kl_gate`` ``(B,)`` or ``None``: GARDO's gate on the KL to the reference (``regularizer: gardo``)."""
    log_prob = awm_log_prob(v, noise, x0, t, weighting, ghuber_power).reshape(train_timesteps, -1)
    old = log_prob.detach() if old_log_prob is None else old_log_prob.reshape(log_prob.shape).to(log_prob)
    adv = scale_advantages(advantages, adv_clip_max, advantage_max)
    policy_loss, ratio = awm_policy_loss(log_prob, old, adv, clip_range, loss_type)
    loss, kl, ema_kl = policy_loss, None, None
    if beta > 0 and v_ref is not None:
        kl = velocity_kl(v, v_ref, t, kl_weight, kl_gate)
        loss = loss + beta * kl
        if ema_beta > 0 and v_ema is not None:
            ema_kl = velocity_kl(v, v_ema, t, kl_ema_weight)
            loss = loss + ema_beta * ema_kl
    return AWMLoss(loss=loss, policy_loss=policy_loss, ratio=ratio, kl=kl, ema_kl=ema_kl)
