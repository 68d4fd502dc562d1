r"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425; official ``Luo-Yihong/DGPO``
``scripts/train_sd3_dgpo.py``), as pure functions.

Notation: x0 a rollout's clean sample (deterministic ODE rollouts keep only x0), eps noise shared by the samples of
one group at one trained step (`group_shared_noise`), sigma the noise level of a rollout step,
x_t = (1 - sigma) x0 + sigma eps, v* = eps - x0 the flow-matching target, K = the group size (``num_generations``),
A_i the advantage of sample i clipped to +-C (C = ``adv_clip_max``), sg the stop-gradient.

* Denoising score-matching error, per sample (means over the non-batch dimensions):

      D_i = mean((v_theta,i - v*_i)^2),     D_i^ref = mean((v_ref,i - v*_i)^2)

  with v_ref the DGPO reference: the frozen base (LoRA off) or, with ``dgpo_use_ema_reference``, the EMA reference.
* Group score and weight, for group g:

      S_g = sum_{i in g} A_i beta_dpo (sg(D_i) - D_i^ref) / K,        w_g = sg(sigmoid(S_g))

  The sum runs over the group's samples in the whole micro-batch, i.e. over every process: `dgpo_policy_loss` sums
  its own samples into one value per group and hands that vector to ``reduce_group_sums`` (the caller's all-reduce
  sum, e.g. ``lambda t: accelerator.reduce(t, "sum")``; None on one process). K is the full group size even when only
  part of a group is in the micro-batch, as in the official code.
* Trust region on the DSM ratio rho_i = exp(D_i^old - D_i), D^old the error of the EMA reference (the "old" policy):
  sample i is clipped when rho_i leaves [1 - c, 1 + c] in the direction of its advantage,

      clip_i = (rho_i > 1 + c)  if A_i > 0,        clip_i = (rho_i < 1 - c)  otherwise (A_i <= 0, as published)

  and a clipped sample contributes sg(D_i) (no gradient; ``clip_dsm``) and, with ``clip_kl``, sg of its KL term.
* Loss over the B samples of this process:

      L = mean_i w_g(i) A_i D_i  +  beta mean_i mean((v_theta,i - v_kl,i)^2)

  with v_kl the base (LoRA off), at ``kl_guidance_scale`` when it is > 1.

Hand check (``tests/trainer/algorithms/test_dgpo_loss.py``): K = 2, A = (1, -1), beta_dpo 10, D = (0.50, 0.40),
D^ref = (0.45, 0.45): S = 0.5, w = sigmoid(0.5) = 0.62246, L = 0.031123, dL/dD = w A / B = (+0.31123, -0.31123).
A group whose samples are better than the reference gets w -> 0 (its preference is already satisfied); one that is
worse gets w -> 1. On the whole the gradient lowers D for positive advantages and raises it for negative ones.

Schedules (pure functions of the seed and the optimizer step, the same on every process):

* `dgpo_step_indices`: per inner epoch, ``dgpo_num_timesteps`` distinct rollout step indices drawn uniformly from
  0 .. ``dgpo_trunc_steps`` (the official ``random.sample(range(trunc_steps + 1), M)``: the candidates include
  index ``dgpo_trunc_steps`` itself).
* `dgpo_reference_decay`: after optimizer step k (counted from 0), theta_ema <- d theta_ema + (1 - d) theta with
  d = min(0.3, 0.001 k).
* `dgpo_rollouts_use_ema_reference`: rollouts are sampled by the EMA reference once more than
  ``dgpo_switch_ema_ref`` optimizer steps are done (official ``global_step > switch_ema_ref``).

Everything is computed in float32 at least (float64 inputs stay float64), whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..seeds import seed_for

__all__ = ["DGPOLoss", "dense_group_index", "dgpo_loss", "dgpo_policy_loss", "dgpo_reference_decay",
           "dgpo_rollouts_use_ema_reference", "dgpo_step_indices", "dsm_clip_mask", "dsm_error",
           "group_shared_noise"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def dsm_error(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """D = mean((v - (eps - x0))^2) over the non-batch dimensions, shape ``(B,)``, in float32 at least."""
    dtype = _compute_dtype(v, noise, x0)
    err = (v.to(dtype) - (noise.to(dtype) - x0.to(dtype))) ** 2
    return err.mean(dim=tuple(range(1, err.ndim)))


def dense_group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer group labels (e.g. prompt indices, gathered from every process) to 0 .. n - 1 by
    sorted label, so that every process that sees the same labels gets the same index; returns (index, n)."""
    _, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def dsm_clip_mask(dsm: torch.Tensor, old_dsm: torch.Tensor, advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """Which samples leave the trust region in the direction of their advantage: rho = exp(D^old - D),
    ``(rho > 1 + clip) if A > 0 else (rho < 1 - clip)``; booleans, shape ``(B,)``."""
    rho = torch.exp(old_dsm.detach() - dsm.detach())
    return torch.where(advantages > 0, rho > 1.0 + clip, rho < 1.0 - clip)


@dataclass
class DGPOLoss:
    """What `dgpo_loss` / `dgpo_policy_loss` return: the scalar ``loss`` to differentiate, its parts, and per-sample
    and per-group terms for logging."""

    loss: torch.Tensor                 # policy_loss + beta * kl
    policy_loss: torch.Tensor          # mean_i w_g(i) A_i D_i (clipped samples detached)
    dsm: torch.Tensor                  # D_i, shape (B,), with gradient
    ref_dsm: torch.Tensor              # D_i^ref, shape (B,)
    group_scores: torch.Tensor         # S_g after the cross-process sum, shape (num_groups,)
    sample_weights: torch.Tensor       # w_g(i), shape (B,)
    clip_mask: torch.Tensor | None     # clipped samples, shape (B,); None without an old policy
    kl: torch.Tensor | None            # mean_i mean((v_theta - v_kl)^2); None without a KL term

    @property
    def clip_frac(self) -> torch.Tensor | None:
        """Share of clipped samples (None without an old policy)."""
        return None if self.clip_mask is None else self.clip_mask.float().mean()


def dgpo_policy_loss(dsm: torch.Tensor, ref_dsm: torch.Tensor, advantages: torch.Tensor, group_index: torch.Tensor,
                     num_groups: int, *, beta_dpo: float, group_size: int, adv_clip_max: float = 5.0,
                     old_dsm: torch.Tensor | None = None, clip: float = 0.01, clip_dsm: bool = True,
                     reduce_group_sums: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DGPOLoss:
    """DGPO's group-weighted DSM loss from per-sample errors (the formulas are the module docstring's).

    Args:
        dsm: D_i of the trained policy, with gradient, shape (B,).
        ref_dsm: D_i^ref of the DGPO reference (no gradient), shape (B,).
        advantages: A_i, shape (B,); clipped to +-adv_clip_max here.
        group_index: each sample's group in 0 .. num_groups - 1, the same numbering on every process
            (`dense_group_index` of the gathered labels).
        num_groups: the number of groups in the micro-batch over all processes.
        beta_dpo: DGPO's beta (> 0).
        group_size: K, the images per prompt (``num_generations``).
        old_dsm: D_i of the EMA reference for the trust region, or None (no clipping).
        clip: c, the half-width of the trust region on rho.
        clip_dsm: detach the DSM of clipped samples (the official ``clip_dsm``).
        reduce_group_sums: the cross-process sum of a ``(num_groups,)`` tensor (an all-reduce), or None on one
            process. Its input never carries gradient.
    """
    if not beta_dpo > 0:
        raise ValueError(f"beta_dpo={beta_dpo} must be > 0 (official: 100 for OCR and GenEval, 10 for PickScore).")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (the images per prompt, num_generations).")
    dtype = _compute_dtype(dsm, ref_dsm, old_dsm)
    dsm = dsm.to(dtype).reshape(-1)
    ref_dsm = ref_dsm.detach().to(dtype).reshape(-1)
    adv = advantages.detach().to(dtype=dtype, device=dsm.device).reshape(-1).clamp(-adv_clip_max, adv_clip_max)
    group_index = group_index.to(device=dsm.device, dtype=torch.long).reshape(-1)
    if not dsm.shape == ref_dsm.shape == adv.shape == group_index.shape:
        raise ValueError(f"dsm {tuple(dsm.shape)}, ref_dsm {tuple(ref_dsm.shape)}, advantages {tuple(adv.shape)} and "
                         f"group_index {tuple(group_index.shape)} must hold one value per sample.")
    if group_index.numel() and (int(group_index.min()) < 0 or int(group_index.max()) >= num_groups):
        raise ValueError(f"group_index must lie in 0 .. num_groups - 1 = {num_groups - 1}; got values "
                         f"{int(group_index.min())} .. {int(group_index.max())}.")

    terms = adv * beta_dpo * (dsm.detach() - ref_dsm) / group_size
    local_sums = torch.zeros(num_groups, dtype=dtype, device=dsm.device).index_add_(0, group_index, terms)
    scores = local_sums if reduce_group_sums is None else reduce_group_sums(local_sums.detach())
    scores = scores.to(dtype)
    weights = torch.sigmoid(scores)[group_index].detach()

    clip_mask = None
    trained_dsm = dsm
    if old_dsm is not None:
        clip_mask = dsm_clip_mask(dsm, old_dsm.to(dtype).reshape(-1), adv, clip)
        if clip_dsm:
            trained_dsm = torch.where(clip_mask, dsm.detach(), dsm)
    policy = (weights * adv * trained_dsm).mean()
    return DGPOLoss(loss=policy, policy_loss=policy, dsm=dsm, ref_dsm=ref_dsm, group_scores=scores,
                    sample_weights=weights, clip_mask=clip_mask, kl=None)


def dgpo_loss(v_theta: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, advantages: torch.Tensor,
              group_index: torch.Tensor, num_groups: int, *, v_dgpo_ref: torch.Tensor, beta_dpo: float,
              group_size: int, adv_clip_max: float = 5.0, v_old: torch.Tensor | None = None, clip: float = 0.01,
              clip_dsm: bool = True, clip_kl: bool = False, v_kl_ref: torch.Tensor | None = None, beta: float = 0.0,
              reduce_group_sums: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DGPOLoss:
    """DGPO's loss for one trained step of a micro-batch, from velocities at x_t = (1 - sigma) x0 + sigma eps.

    Args:
        v_theta: the trained policy's velocity, with gradient, shape (B, ...).
        noise, x0: eps and the clean samples (v* = eps - x0).
        v_dgpo_ref: the DGPO reference's velocity (base with the LoRA off, or the EMA reference).
        v_old: the EMA reference's velocity for the DSM-ratio trust region, or None (no clipping).
        v_kl_ref: the base's velocity for the KL term (at ``kl_guidance_scale``), or None (no KL).
        beta: the KL term's weight.
        clip_kl: also detach the KL term of clipped samples (the official ``clip_kl``).
        The others as in `dgpo_policy_loss`.
    """
    dsm = dsm_error(v_theta, noise, x0)
    with torch.no_grad():
        ref_dsm = dsm_error(v_dgpo_ref.detach(), noise, x0)
        old_dsm = None if v_old is None else dsm_error(v_old.detach(), noise, x0)
    out = dgpo_policy_loss(dsm, ref_dsm, advantages, group_index, num_groups, beta_dpo=beta_dpo,
                           group_size=group_size, adv_clip_max=adv_clip_max, old_dsm=old_dsm, clip=clip,
                           clip_dsm=clip_dsm, reduce_group_sums=reduce_group_sums)
    if v_kl_ref is not None and beta > 0:
        dtype = out.dsm.dtype
        diff = v_theta.to(dtype) - v_kl_ref.detach().to(dtype)
        per_sample = diff.square().mean(dim=tuple(range(1, diff.ndim)))
        if clip_kl and out.clip_mask is not None:
            per_sample = torch.where(out.clip_mask, per_sample.detach(), per_sample)
        out.kl = per_sample.mean()
        out.loss = out.policy_loss + beta * out.kl
    return out


# ---- schedules ---------------------------------------------------------------------------------------------------

def dgpo_step_indices(seed: int, step: int, inner_epoch: int, num_timesteps: int, trunc_steps: int) -> list[int]:
    """The ``num_timesteps`` distinct rollout step indices trained in one inner epoch, drawn uniformly without
    replacement from 0 .. ``trunc_steps`` (inclusive, as the official code), in draw order. A pure function of the
    run seed, the optimizer step at which the epoch starts and the inner epoch: every process draws the same."""
    if trunc_steps < 0:
        raise ValueError(f"trunc_steps={trunc_steps} must be >= 0.")
    if not 1 <= num_timesteps <= trunc_steps + 1:
        raise ValueError(f"num_timesteps={num_timesteps} must be in 1 .. trunc_steps + 1 = {trunc_steps + 1} (the "
                         "draw is without replacement from step indices 0 .. trunc_steps).")
    gen = torch.Generator().manual_seed(seed_for("dgpo-steps", seed, step, inner_epoch))
    return [int(i) for i in torch.randperm(trunc_steps + 1, generator=gen)[:num_timesteps]]


def group_shared_noise(like: torch.Tensor, group_keys: Sequence[int] | torch.Tensor, *seed_parts: int) -> torch.Tensor:
    """Noise of ``like``'s shape where the samples with equal group key share one draw: sample b gets the normal
    draw seeded by (``seed_parts``, group key of b), e.g. ``(seed, step, inner_epoch, micro_batch, trained_step)``.
    The same on every process and independent of which samples a process holds."""
    keys = [int(k) for k in (group_keys.tolist() if isinstance(group_keys, torch.Tensor) else group_keys)]
    if len(keys) != like.shape[0]:
        raise ValueError(f"group_keys has {len(keys)} entries for a batch of {like.shape[0]}.")
    cache: dict[int, torch.Tensor] = {}
    rows = []
    for key in keys:
        if key not in cache:
            gen = torch.Generator().manual_seed(seed_for("dgpo-noise", *seed_parts, key))
            cache[key] = torch.randn(tuple(like.shape[1:]), generator=gen, dtype=torch.float32)
        rows.append(cache[key])
    return torch.stack(rows).to(device=like.device, dtype=like.dtype)


def dgpo_reference_decay(step: int, rate: float = 0.001, maximum: float = 0.3) -> float:
    """Decay d of the EMA reference's update after optimizer step ``step`` (counted from 0, the official
    ``global_step`` at the update): ``min(maximum, rate * step)``; theta_ema <- d theta_ema + (1 - d) theta."""
    return float(min(maximum, rate * step))


def dgpo_rollouts_use_ema_reference(step: int, switch_step: int) -> bool:
    """Whether the rollouts sampled after ``step`` completed optimizer steps come from the EMA reference:
    ``step > switch_step`` (official ``switch_ema_ref``: 200 for OCR and PickScore, 500 for GenEval)."""
    return step > switch_step
