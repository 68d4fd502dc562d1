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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4
REWARD_AGGREGATIONS = ("weighted_sum", "normalize_then_sum")


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
