r"""CRD, Centered Reward Distillation (arXiv 2603.14128; the only code found is Flow-Factory's port,
``trainers/crd.py``), as pure functions.

Notation: x0 a rollout's clean sample (CFG-free ODE rollouts from a lagging *sampling* copy of the policy), eps fresh
noise per trained step and sample, sigma a rollout noise level, x_t = (1 - sigma) x0 + sigma eps, v* = eps - x0,
v_theta the trained policy, v_old the lagging *old* copy (or the frozen base), v_ref the base at
``kl_guidance_scale``, A the group advantage clipped to +-C (C = ``adv_clip_max``), beta = ``crd_beta``,
sg the stop-gradient; means without a subscript run over the non-batch dimensions.

* Reward in [0, 1] (`reward_weight`, DiffusionNFT's optimality probability): r = clamp(A / C / 2 + 0.5, 0, 1).
* Adaptive implicit reward (`implicit_reward`), per sample, with weights in float64:

      w = sg(max(mean|v_theta - v*|, 1e-5)),      w_old = max(mean|v_old - v*|, 1e-5)
      r_theta = -mean[(v_theta - v*)^2 / w - (v_old - v*)^2 / w_old]

  (``adaptive=False``: w = w_old = 1.) r_theta > 0 where the policy fits the sample better than the old copy.
* Centring (`centred`): R_i = r_i - mean(r), Q_i = r_theta,i - sg(mean(r_theta)), the means taken over the samples of
  i's prompt group (``centering="group"``, the paper) or over the whole micro-batch gathered from every process
  (``"batch"``, Flow-Factory's port). The means use the gathered values the caller passes (``*_all``); only the
  local r_theta carry gradient.
* Policy loss (`crd_policy_loss`):

      mse: L_pol = (C / beta) mean_i (beta Q_i - R_i)^2
      bce: L_pol = (C / beta) mean_i BCE(sigmoid(beta Q_i), sigmoid(R_i))       (the port's binary cross-entropy with
                                                                                 logits beta Q and soft targets)

* KL to the base, weighted by reward (`reward_weighted_kl`), m = ``kl_floor`` / beta_kl (the port: 1e-4 / beta_kl):

      L_kl = beta_kl mean_i[(m + r_i (1 - m)) mean((v_theta,i - v_ref,i)^2)]     (``reward_adaptive=False``: weight 1)

  so that the best samples are held near the base with the full weight and the worst with the floor only.
* Loss = L_pol + L_kl.

Centring per group and per micro-batch differ when a micro-batch holds several prompts: per group, each sample's
implicit reward is compared with its own prompt's samples only, so an easy prompt (all rewards high) teaches nothing
about a hard one; per micro-batch (the port), the mean mixes prompts, and a sample of an easy prompt is pushed up
merely for being above the batch's mean. With one group per micro-batch the two are the same. With advantages already
centred per group, the group mean of r is 1/2 unless clipping bites, so the group centring of the rewards changes
little; the centring of r_theta is what differs.

Hand check (``tests/trainer/algorithms/test_crd_loss.py``): beta 1, A = (2, -1, 0.5, -1.5) -> r = (.7, .4, .55, .35);
r_theta = (.01, -.02, 0, .03), one group -> L_pol = 0.096625.

Schedules: `crd_step_indices` (the trained rollout steps: ``num_timesteps`` stratified draws over the step indices
0 .. int(steps x timestep_fraction), shared by the micro-batch; the same draw as AWM's ``discrete`` time type) and
`crd_copy_decay` (the copies' decay after each generation: the old copy min(0.25 + 0.005 k, 0.999), the sampling
copy 0 (a copy of the policy) for k < 75 then min(0.0075 (k - 75), 0.999), k the optimizer steps done).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .nft_loss import reward_weight

#: Smallest adaptive weight of the implicit reward (the port's clip).
MIN_ADAPTIVE_WEIGHT = 1e-5
#: The KL weight of the worst samples is KL_FLOOR / beta_kl (the port's ``base_beta``).
KL_FLOOR = 1e-4
#: The old copy's decay schedule (start step, start value, slope, end value): the port's default, the paper's OCR.
CRD_OLD_DECAY = (0, 0.25, 0.005, 0.999)
#: The sampling copy's decay schedule: a copy of the policy until step 75, then a slow average.
CRD_SAMPLING_DECAY = (75, 0.0, 0.0075, 0.999)
CENTERINGS = ("group", "batch")
CRD_LOSS_TYPES = ("mse", "bce")

__all__ = ["CENTERINGS", "CRD_LOSS_TYPES", "CRD_OLD_DECAY", "CRD_SAMPLING_DECAY", "KL_FLOOR", "MIN_ADAPTIVE_WEIGHT",
           "CRDLoss", "centred", "crd_copy_decay", "crd_loss", "crd_policy_loss", "crd_step_indices",
           "implicit_reward", "reward_weight", "reward_weighted_kl"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def implicit_reward(v_theta: torch.Tensor, v_old: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, *,
                    adaptive: bool = True, min_weight: float = MIN_ADAPTIVE_WEIGHT) -> torch.Tensor:
    """r_theta per sample, shape ``(B,)``, with gradient through ``v_theta`` only (see the module docstring). The
    adaptive weights are computed in float64, so the result is float64 when ``adaptive``."""
    dtype = _compute_dtype(v_theta, v_old, noise, x0)
    target = noise.detach().to(dtype) - x0.detach().to(dtype)
    err = v_theta.to(dtype) - target
    err_old = v_old.detach().to(dtype) - target
    dims = tuple(range(1, err.ndim))
    if adaptive:
        with torch.no_grad():
            w = err.abs().to(torch.float64).mean(dim=dims, keepdim=True).clamp(min=min_weight)
            w_old = err_old.abs().to(torch.float64).mean(dim=dims, keepdim=True).clamp(min=min_weight)
        per_element = -(err.square() / w - err_old.square() / w_old)
    else:
        per_element = -(err.square() - err_old.square())
    return per_element.mean(dim=dims)


def centred(values: torch.Tensor, values_all: torch.Tensor | None = None, group_index: torch.Tensor | None = None,
            group_index_all: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` minus the mean of ``values_all`` (default: ``values``) over the samples of the same group
    (``group_index`` against ``group_index_all``), or over all of ``values_all`` when ``group_index`` is None. The
    mean carries no gradient. A group absent from ``values_all`` is an error."""
    values_all = values if values_all is None else values_all
    pool = values_all.detach().to(values.dtype).reshape(-1)
    if group_index is None:
        return values - pool.mean()
    group_index = group_index.reshape(-1).to(device=values.device, dtype=torch.long)
    group_index_all = group_index if group_index_all is None else group_index_all
    group_index_all = group_index_all.reshape(-1).to(device=values.device, dtype=torch.long)
    if group_index_all.shape != pool.shape or group_index.shape != values.reshape(-1).shape:
        raise ValueError(f"group indices {tuple(group_index.shape)} / {tuple(group_index_all.shape)} must match the "
                         f"values {tuple(values.reshape(-1).shape)} / {tuple(pool.shape)}.")
    size = int(max(int(group_index.max()), int(group_index_all.max()))) + 1
    sums = torch.zeros(size, dtype=pool.dtype, device=pool.device).index_add_(0, group_index_all, pool)
    counts = torch.zeros(size, dtype=pool.dtype, device=pool.device).index_add_(0, group_index_all,
                                                                                 torch.ones_like(pool))
    if bool((counts[group_index] == 0).any()):
        missing = sorted({int(g) for g in group_index[counts[group_index] == 0]})
        raise ValueError(f"groups {missing} of the local samples are missing from the gathered values; pass the "
                         "gathered values of every process (they include the local ones).")
    return values - (sums / counts.clamp_min(1))[group_index].reshape(values.shape)


def crd_policy_loss(r_theta: torch.Tensor, rewards: torch.Tensor, *, crd_beta: float, loss_type: str = "mse",
                    adv_clip_max: float = 5.0, group_index: torch.Tensor | None = None,
                    r_theta_all: torch.Tensor | None = None, rewards_all: torch.Tensor | None = None,
                    group_index_all: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L_pol from the local implicit rewards ``r_theta`` (with gradient) and rewards ``r`` in [0, 1], both ``(B,)``;
    returns (L_pol, R, Q). ``group_index`` None centres over the micro-batch (the port), else within each group
    (the paper); ``*_all`` are the values gathered from every process (default: the local ones)."""
    if not crd_beta > 0:
        raise ValueError(f"crd_beta={crd_beta} must be > 0 (CRD: 1.0).")
    if loss_type not in CRD_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not valid; choose 'mse' or 'bce'.")
    dtype = _compute_dtype(r_theta, rewards)
    r_theta = r_theta.to(dtype).reshape(-1)
    rewards = rewards.detach().to(dtype=dtype, device=r_theta.device).reshape(-1)
    r_theta_all = r_theta.detach() if r_theta_all is None else r_theta_all.detach().to(dtype).reshape(-1)
    rewards_all = rewards if rewards_all is None else rewards_all.detach().to(dtype).reshape(-1)
    big_r = centred(rewards, rewards_all, group_index, group_index_all)
    q = centred(r_theta, r_theta_all, group_index, group_index_all)
    logits = crd_beta * q
    if loss_type == "mse":
        raw = (logits - big_r).square().mean()
    else:
        raw = F.binary_cross_entropy_with_logits(logits, torch.sigmoid(big_r), reduction="mean")
    return raw * adv_clip_max / crd_beta, big_r, q


def reward_weighted_kl(v_theta: torch.Tensor, v_ref: torch.Tensor, rewards: torch.Tensor, *, beta_kl: float,
                       reward_adaptive: bool = True, kl_floor: float = KL_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_kl, the per-sample KL mean((v_theta - v_ref)^2)): beta_kl mean_i (m + r_i (1 - m)) KL_i with
    m = kl_floor / beta_kl, or beta_kl mean_i KL_i when not ``reward_adaptive``."""
    dtype = _compute_dtype(v_theta, v_ref)
    diff = v_theta.to(dtype) - v_ref.detach().to(dtype)
    per_sample = diff.square().mean(dim=tuple(range(1, diff.ndim)))
    if beta_kl <= 0:
        return per_sample.sum() * 0.0, per_sample
    if not reward_adaptive:
        return beta_kl * per_sample.mean(), per_sample
    floor = kl_floor / beta_kl
    r = rewards.detach().to(dtype=dtype, device=per_sample.device).reshape(-1)
    return beta_kl * ((floor + r * (1 - floor)) * per_sample).mean(), per_sample


@dataclass
class CRDLoss:
    """What `crd_loss` returns: the scalar ``loss`` to differentiate, its parts and per-sample terms for logging."""

    loss: torch.Tensor             # policy_loss + kl_loss
    policy_loss: torch.Tensor      # L_pol
    kl_loss: torch.Tensor          # L_kl (0 without a reference)
    kl: torch.Tensor | None        # per-sample mean((v_theta - v_ref)^2), None without a reference
    implicit_reward: torch.Tensor  # r_theta per sample, with gradient
    centred_reward: torch.Tensor   # R per sample
    centred_implicit: torch.Tensor # Q per sample


def crd_loss(v_theta: torch.Tensor, v_old: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor,
             rewards: torch.Tensor, *, crd_beta: float = 1.0, loss_type: str = "mse", adv_clip_max: float = 5.0,
             adaptive: bool = True, group_index: torch.Tensor | None = None,
             gather: Callable[[torch.Tensor], torch.Tensor] | None = None, v_ref: torch.Tensor | None = None, beta_kl: float = 0.0,
             reward_adaptive_kl: bool = True, kl_floor: float = KL_FLOOR) -> CRDLoss:
    """CRD's loss for one trained step of a micro-batch (the formulas are the module docstring's).

    Args:
        v_theta: the policy's velocity at x_t, with gradient; v_old: the old copy's (or the base's).
        noise, x0: eps and the clean samples.
        rewards: r in [0, 1] per sample (`reward_weight` of the advantages).
        group_index: each sample's prompt group (centring within groups, the paper), or None (over the
            micro-batch, the port). Gathered with ``gather`` too, so it must number groups the same way on every
            process (e.g. the prompts' dataset indices).
        gather: the all-gather of a ``(B,)`` tensor over processes (e.g. ``accelerator.gather``), or None on one
            process; applied to detached values only.
        v_ref: the base's velocity at ``kl_guidance_scale`` for the KL term, or None; beta_kl its weight.
    """
    r_theta = implicit_reward(v_theta, v_old, noise, x0, adaptive=adaptive)
    rewards = rewards.detach().to(r_theta.dtype).reshape(-1)
    if gather is None:
        r_theta_all, rewards_all, group_all = None, None, None
    else:
        r_theta_all, rewards_all = gather(r_theta.detach()), gather(rewards)
        group_all = None if group_index is None else gather(group_index.reshape(-1))
    policy, big_r, q = crd_policy_loss(r_theta, rewards, crd_beta=crd_beta, loss_type=loss_type,
                                       adv_clip_max=adv_clip_max, group_index=group_index, r_theta_all=r_theta_all,
                                       rewards_all=rewards_all, group_index_all=group_all)
    kl = None
    kl_loss = policy.new_zeros(())
    if v_ref is not None:
        kl_loss, kl = reward_weighted_kl(v_theta, v_ref, rewards, beta_kl=beta_kl, reward_adaptive=reward_adaptive_kl,
                                         kl_floor=kl_floor)
        kl_loss = kl_loss.to(policy.dtype)
    return CRDLoss(loss=policy + kl_loss, policy_loss=policy, kl_loss=kl_loss, kl=kl, implicit_reward=r_theta,
                   centred_reward=big_r, centred_implicit=q)


# ---- schedules ---------------------------------------------------------------------------------------------------

def crd_step_indices(num_timesteps: int, num_inference_steps: int, timestep_fraction: float = 0.99,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """The rollout step indices trained on one micro-batch: stratum k of ``num_timesteps`` equal strata of
    [0, n], n = int(num_inference_steps x timestep_fraction), gives floor(lo_k) + floor(u (floor(hi_k) - floor(lo_k))),
    u ~ U(0, 1) (the port's ``discrete`` draw; AWM's ``discrete`` time type draws the same). Index n itself is never
    drawn; with more strata than steps an index repeats. Shape ``(num_timesteps,)``, long."""
    if num_timesteps < 1:
        raise ValueError(f"num_timesteps={num_timesteps} must be >= 1 (CRD: 20).")
    count = int(num_inference_steps * timestep_fraction)
    if count < 1:
        raise ValueError(f"int(num_inference_steps={num_inference_steps} x timestep_fraction={timestep_fraction}) = "
                         f"{count} leaves no step to train; raise timestep_fraction.")
    bounds = torch.linspace(0, count, steps=num_timesteps + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(num_timesteps, generator=generator)
    return (lower + (u * (upper - lower)).long()).clamp(max=num_inference_steps - 1)


def crd_copy_decay(step: int, start_step: int, start_value: float, slope: float, end_value: float) -> float:
    """Decay d of a copy's update theta_copy <- d theta_copy + (1 - d) theta after ``step`` optimizer steps (the
    port's ``start_step-start_value-slope-end_value``): ``start_value`` before ``start_step``, then
    ``min(start_value + slope (step - start_step), end_value)``. d <= 0 copies the policy; d >= 1 freezes the copy."""
    if step < start_step:
        return float(start_value)
    return float(min(start_value + slope * (step - start_step), end_value))
