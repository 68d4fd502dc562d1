r"""TempFlow-GRPO's layout and weights as pure functions (arXiv 2508.04324; official ``Shredded-Pork/TempFlow-GRPO``
``scripts/train_sd3_pr.py`` with ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_perstep.py``).

The rollout of one group: one ODE trajectory (the *trunk*) from the group's initial noise; at each branch step j
(the official code: every step but the last, 0 .. T-2) C *children* (official C = 6) leave the trunk state x_j by one
SDE step, x'_{j,c} = mu_theta(x_j) + std_j eps_{j,c}, and each continues to the clean sample by ODE (Euler) steps;
each child is decoded and scored. So a child has exactly one stochastic step, and its reward is credited to it:

    rows of a group (G = C x |branch steps| of them):  row k  ->  branch step j = steps[k // C], child c = k % C
    per-step advantage:  A_{j,c} = (r_{j,c} - mean_c r_{j,.}) / (std_c r_{j,.} + 1e-4)   (the C siblings at step j)
    loss at step j:       -w_j A_{j,c} ratio  clipped as Flow-GRPO's,  w_j = 2.25 std_j,   std_j = a sqrt(sigma_j /
                          (1 - sigma_j)) sqrt(sigma_j - sigma_{j+1})   (the transition's std, a = noise_level)

The advantages are the group advantages of ``flowgrpo.trainer.rollout.advantages`` over the sibling groups
(`advantage_groups`: every row's (group, branch step)), so ``scale_rewards``, ``adv_clip_max`` and every other
shaping of advantages apply to them as to any group. Since w_j > 0, the weighted clipped objective is Flow-GRPO's
clipped objective with advantages w_j A (`weighted_advantages`). Hand check: a = 0.7, sigma_j = 0.5, sigma_{j+1} =
0.25 -> std_j = 0.7 x 1 x 0.5 = 0.35, w_j = 0.7875.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["TEMPFLOW_NOISE_WEIGHT", "advantage_group_of", "default_branch_steps", "tempflow_cost", "tempflow_row",
           "tempflow_weight", "weighted_advantages"]

#: the factor of the noise-level weight of the official loss, ``-2.25 * std_dev_t * advantages * ratio``
TEMPFLOW_NOISE_WEIGHT = 2.25


def default_branch_steps(num_steps: int) -> list[int]:
    """The official branch steps: every sampling step but the last, 0 .. T - 2 (the last step is the deterministic
    step to the clean sample)."""
    return list(range(max(0, num_steps - 1)))


def tempflow_row(position: int, num_generations: int, children: int, branch_steps: Sequence[int]
                 ) -> tuple[int, int, int]:
    """Row ``position`` of a generation (over every process, in order) as ``(group, branch step, child)``: group g's
    rows are positions g G .. g G + G - 1; within a group, row k branches at ``branch_steps[k // children]`` as child
    ``k % children``."""
    group, k = divmod(int(position), int(num_generations))
    return group, int(branch_steps[k // children]), k % children


def advantage_group_of(position: int, num_generations: int, children: int, branch_steps: Sequence[int]) -> int:
    """The sibling group of row ``position`` (its group and branch step), numbered densely: the group advantages are
    normalised within it."""
    group, k = divmod(int(position), int(num_generations))
    return group * len(branch_steps) + k // children


def tempflow_weight(std: float, factor: float = TEMPFLOW_NOISE_WEIGHT) -> float:
    """The noise-level weight of the loss at a step whose transition std is ``std``: ``factor * std``."""
    return float(factor) * float(std)


def weighted_advantages(advantages, std, factor: float = TEMPFLOW_NOISE_WEIGHT):
    """The advantages the clipped objective reads at a branch step: ``factor * std * A`` per row (``std`` the rows'
    transition stds, taken without gradient: the weight is a constant of the step)."""
    return advantages * (float(factor) * std.detach())


def tempflow_cost(num_steps: int, branch_steps: Sequence[int], children: int, micro_batch: int) -> tuple[float, float]:
    """``(transformer rows per sample, trained parts per micro-batch)`` of a generation whose micro-batches are
    consecutive runs of ``micro_batch`` rows (groups aligned with them): each micro-batch samples the trunk of each of
    its groups up to the latest branch step it needs (those steps once per group, batched), and each child its own
    T - j steps (the SDE step and the ODE steps after it); it trains one part per distinct branch step among its rows.
    """
    group = children * len(branch_steps)
    rows = math.lcm(group, micro_batch)  # a period of the layout
    passes = parts = 0
    batches = 0
    for start in range(0, rows, micro_batch):
        trunk: dict[int, int] = {}
        steps_here = set()
        for position in range(start, start + micro_batch):
            g, j, _ = tempflow_row(position, group, children, branch_steps)
            trunk[g] = max(trunk.get(g, 0), j)
            steps_here.add(j)
            passes += num_steps - j
        passes += sum(trunk.values())
        parts += len(steps_here)
        batches += 1
    return passes / rows, parts / batches
