"""Group-relative advantages (GRPO) from gathered rewards.

For image i of group g (the G images of one prompt):

    A_i = clip((r_i - mean_g) / (s + 1e-4), -adv_clip_max, adv_clip_max)

with s the std of group g (``scale_rewards="group"``), of the whole gathered batch (``"batch"``, Flow-GRPO's
global std) or 1 (``"none"``). Rewards that could not be computed (NaN, from a reward returning None) are left
out of every mean and std, and their images get advantage 0. A group whose valid rewards are all equal carries
no learning signal; ``frac_reward_zero_std`` reports the fraction of such groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4


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
