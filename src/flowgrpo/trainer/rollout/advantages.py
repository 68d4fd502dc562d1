"""Group-relative advantages (GRPO) from gathered rewards.

For image i of group g (the G images of one prompt):

    A_i = clip((r_i - mean_g) / (s + 1e-4), -adv_clip_max, adv_clip_max)

with s the std of group g (``scale_rewards="group"``), of the whole gathered batch (``"batch"``, Flow-GRPO's
global std) or 1 (``"none"``). Rewards that could not be computed (NaN, from a reward returning None) are left
out of every mean and std, and their images get advantage 0. A group whose valid rewards are all equal carries
no learning signal; ``frac_reward_zero_std`` reports the fraction of such groups.

With several rewards ``r^(1..K)`` and weights ``w_k``, `compute_reward_advantages` combines them in one of two
ways (``reward_aggregation``):

- ``"weighted_sum"``: the advantage of the weighted sum ``r_i = sum_k w_k r_i^(k)`` as above;
- ``"normalize_then_sum"``: each reward normalised within its group first, then the weighted sum of those
  advantages, ``A_i = clip(sum_k w_k (r_i^(k) - mean_g^(k)) / (s^(k) + 1e-4), +-adv_clip_max)`` (``s^(k)`` as
  ``scale_rewards`` says, for reward ``k`` alone). A reward with a small spread then weighs as much as one with a
  large spread, so a hard reward is not drowned by an easy one. An image that reward ``k`` could not score gets 0
  from that reward (its valid rewards still count); weight-0 rewards are left out.

With reward constraints (``reward_constraints``, ``health/constraints.py``), multipliers ``lambda_i >= 0`` and each
constrained reward's own group-normalised advantage ``A_i`` (as above, before clipping), the advantage the loss
reads is, for every advantage-based trainer (`combine_constrained_advantages`, also used by BranchGRPO's depth-wise
advantages):

    A = clip((A_0 + sum_i lambda_i A_i) / (1 + sum_i lambda_i), -adv_clip_max, adv_clip_max)

with ``A_0`` the objective's advantage. The division keeps the scale: the result is a convex combination of
advantages of unit scale, so the losses' step sizes (the clip ranges, DGPO's sigmoid weights, CRD's map of A to
[0, 1], AWM's advantage_max) keep the meaning they were tuned with however large the multipliers grow; it is what
PPO-Lagrangian's reference implementation does. With every multiplier 0 it is exactly ``A_0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4
REWARD_AGGREGATIONS = ("weighted_sum", "normalize_then_sum")

__all__ = ["REWARD_AGGREGATIONS", "STD_EPS", "AdvantageStats", "ConstraintTerms", "combine_constrained_advantages",
           "compute_constrained_advantages", "compute_group_advantages", "compute_reward_advantages"]


@dataclass
class AdvantageStats:
    reward_mean: float
    reward_std: float
    frac_reward_zero_std: float
    num_valid: int


def compute_group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_rewards: str = "batch", adv_clip_max: float = 5.0,
) -> tuple[torch.Tensor, AdvantageStats]:
    """Advantages for 1-D ``rewards`` (NaN = unscored) grouped by integer ``group_ids`` (same shape).

    Stds are population stds (divide by n), matching numpy's default used by the reference implementation.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    if scale_rewards not in ("batch", "group", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}; choose 'batch', 'group' or 'none'")
    r = rewards.double()
    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, inverse, valid.to(r.dtype))
    sums = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, inverse, r0)
    group_mean = sums / counts.clamp_min(1)
    centred = torch.where(valid, r - group_mean[inverse], torch.zeros_like(r))
    group_var = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, inverse, centred**2) / counts.clamp_min(1)
    group_std = group_var.sqrt()

    n_valid = int(valid.sum().item())
    if n_valid:
        batch_mean = r0.sum() / n_valid
        batch_std = (((r0 - batch_mean) ** 2) * valid).sum().div(n_valid).sqrt()
    else:
        batch_mean = batch_std = torch.tensor(0.0, dtype=r.dtype)

    if scale_rewards == "group":
        scale = group_std[inverse] + STD_EPS
    elif scale_rewards == "batch":
        scale = batch_std + STD_EPS
    else:
        scale = torch.ones_like(r)
    adv = torch.where(valid, centred / scale, torch.zeros_like(r)).clamp(-adv_clip_max, adv_clip_max)

    present = counts > 0
    zero_std = (group_std <= 1e-12) & present
    frac_zero = float(zero_std.sum().item() / max(int(present.sum().item()), 1))
    stats = AdvantageStats(float(batch_mean), float(batch_std), frac_zero, n_valid)
    return adv.to(torch.float32), stats


def compute_reward_advantages(
    totals: torch.Tensor,
    per_reward: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_ids: torch.Tensor,
    scale_rewards: str = "batch",
    adv_clip_max: float = 5.0,
    reward_aggregation: str = "weighted_sum",
) -> tuple[torch.Tensor, AdvantageStats]:
    """Advantages from the weighted total (``"weighted_sum"``) or from each reward normalised first
    (``"normalize_then_sum"``); see the module docstring. The statistics always describe ``totals``.

    Args:
        totals: the weighted sum per image (NaN = unscored), 1-D.
        per_reward: each reward's scores per image (NaN = unscored), aligned with ``totals``.
        weights: each reward's weight (same keys as ``per_reward``).
        group_ids, scale_rewards, adv_clip_max: as in `compute_group_advantages`.
        reward_aggregation: ``"weighted_sum"`` or ``"normalize_then_sum"``.
    """
    if reward_aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"reward_aggregation={reward_aggregation!r} is not valid; choose one of "
                         f"{', '.join(map(repr, REWARD_AGGREGATIONS))}.")
    advantages, stats = compute_group_advantages(totals, group_ids, scale_rewards, adv_clip_max)
    if reward_aggregation == "weighted_sum":
        return advantages, stats
    missing = [name for name in per_reward if name not in weights]
    if missing:
        raise ValueError(f"no weight for reward(s) {missing}; weights are given for {sorted(weights)}.")
    combined = torch.zeros(totals.shape, dtype=torch.float64)
    for name, scores in per_reward.items():
        weight = float(weights[name])
        if weight == 0.0:
            continue
        adv_k, _ = compute_group_advantages(scores, group_ids, scale_rewards, adv_clip_max=float("inf"))
        combined += weight * adv_k.double()
    return combined.clamp(-adv_clip_max, adv_clip_max).to(torch.float32), stats


@dataclass
class ConstraintTerms:
    """What the constrained part of the advantage needs: each constraint's multiplier and its reward's gathered
    scores (NaN = unscored), in the generation's order."""

    multipliers: dict[str, float]
    rewards: dict[str, torch.Tensor]

    @property
    def active(self) -> bool:
        return any(m > 0 for m in self.multipliers.values())


def combine_constrained_advantages(objective: torch.Tensor, constrained: dict[str, torch.Tensor],
                                   multipliers: dict[str, float], adv_clip_max: float) -> torch.Tensor:
    """``clip((A_0 + sum_i lambda_i A_i) / (1 + sum_i lambda_i), +-adv_clip_max)`` (module docstring) for advantages
    of any shape: ``objective`` is A_0, ``constrained[name]`` is A_i (the same shape), ``multipliers[name]`` is
    lambda_i >= 0. Returns ``objective``'s dtype."""
    if any(m < 0 for m in multipliers.values()):
        raise ValueError(f"multipliers {multipliers} must be >= 0.")
    total = objective.double()
    weight = 1.0
    for name, adv in constrained.items():
        lam = float(multipliers[name])
        if lam == 0.0:
            continue
        total = total + lam * adv.double()
        weight += lam
    return (total / weight).clamp(-adv_clip_max, adv_clip_max).to(objective.dtype)


def compute_constrained_advantages(objective: torch.Tensor, terms: ConstraintTerms, group_ids: torch.Tensor,
                                   scale_rewards: str = "batch", adv_clip_max: float = 5.0) -> torch.Tensor:
    """The per-image advantage of the module docstring: each constrained reward's own group advantage (as
    `compute_group_advantages`, unclipped) combined with the objective's by `combine_constrained_advantages`."""
    constrained = {name: compute_group_advantages(scores, group_ids, scale_rewards, adv_clip_max=float("inf"))[0]
                   for name, scores in terms.rewards.items() if terms.multipliers[name] > 0}
    return combine_constrained_advantages(objective, constrained, terms.multipliers, adv_clip_max)
