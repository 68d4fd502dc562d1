r"""BranchGRPO's tree rollouts, node rewards, depth-wise advantages and pruning (arXiv 2509.06040; official
``Fredreic1849/BranchGRPO`` ``fastvideo/train_branchgrpo_flux.py``), as pure functions.

**The tree.** One prompt, T = ``num_inference_steps`` SDE steps, split steps ``branch_steps`` (e.g. [0, 3, 6, 9] of
20) and a factor F = ``branch_factor`` (2). A node is a state x_l at *level* l (0 the initial noise, T the final
sample); its level is also its depth. Step s takes every node at level s to level s + 1: a node gets F children
at a split step and one child otherwise, so level l holds W_l = F^(splits before l) nodes and the tree has
G = F^len(branch_steps) leaves, one group of ``num_generations`` samples sharing their prefixes (16 for the official
setting). Nodes are numbered by (level, branch) with branch 0 .. W_l - 1 in mixed radix: the children of branch b
at a split are F b .. F b + F - 1, so the leaves below a node form one contiguous run. Each non-root node is the end
of one *edge* (parent, child, step, old log-prob): the unit that is trained.

**Noise.** Each node is drawn with its own seed, ``seed_for(seed, generation, tree_key, level, branch)``
(`TreePlan.nodes[i].noise_seed`; the root's seed gives the initial noise): a function of the run seed, the
generation, the prompt's key and the node only, never of the order in which a rollout engine visits the nodes, so
any batching of the tree's nodes samples the same tree. At a split step the child is
x' = mu + c s z with s the step's std and c = ``branch_noise_scale`` (the official script: 4), elsewhere
x' = mu + s z.

**The split-noise quirk.** The official code draws split children with the scaled noise but computes their old and
new log-probs with the unscaled std s. The ratio it trains is then that of a density the sample was not drawn from
(the samples are off-policy for it by a factor c in std). By default (``branch_split_log_prob="exact"``) the log-prob
of a split edge is that of the distribution it was sampled from, N(mu, (c s)^2), for the old and the new policy
alike; ``"unscaled"`` reproduces the official code (N(mu, s^2)) and is there only to compare with published runs.

**Rewards and advantages.** Leaves are scored; a node's reward R is the mean of its leaves' rewards. Within each tree
and each depth (level) l with at least two nodes:

    A = (R - mean_l(R)) / (std_l(R) + 1e-8),  std_l unbiased;   A = 0 when std_l < 1e-6 (or one node);
    A clamped to +-adv_clip_max (5)

(the root, alone at depth 0, gets 0). Each edge is trained with the advantage of its child in the clipped PPO
objective (official clip range 1e-3, no KL). Hand check (``tests/trainer/algorithms/test_branch_grpo.py``): leaves (1, 2, 3, 6)
in pairs (1, 2) and (3, 6): depth 1 gives A = -+0.7071, the leaves (-0.9258, -0.4629, 0, 1.3887).

**Pruning** (`pruned_edges`, applied to all trees of a batch together, as the official code): ``depth`` leaves out
the edges whose child is at one of the given depths (optionally a window sliding up by one every ``slide_interval``
optimizer steps, down to the last split's depth); ``width`` keeps, among the edges sampled after the last split,
the best ``ratio`` of each last-split branch by advantage (``per_branch``, official mode 1), or the best and the
worst half of ``ratio`` of them over all trees (``best_worst``, official mode 2). Ties keep the official order (trees
in order, edges depth-first from the root), so that after the last split, where every edge of one branch carries
the same advantage, ``per_branch`` keeps each branch's earliest steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..seeds import seed_for

BRANCH_PRUNINGS = ("none", "width", "depth")
BRANCH_WIDTH_MODES = ("per_branch", "best_worst")
SPLIT_LOG_PROBS = ("exact", "unscaled")
#: Below this unbiased std a depth's advantages are all 0 (the official rule).
MIN_DEPTH_STD = 1e-6
#: Added to the depth's std before dividing (the official rule).
DEPTH_STD_EPS = 1e-8

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

__all__ = ["BRANCH_PRUNINGS", "BRANCH_WIDTH_MODES", "SPLIT_LOG_PROBS", "BranchNode", "StepPlan", "TreePlan",
           "branch_tree_plan", "check_branch_steps", "depth_advantages", "depth_pruning_window", "edge_log_prob",
           "edge_std", "node_noise", "node_rewards", "pruned_edges", "tree_passes"]


def check_branch_steps(branch_steps: Sequence[int], num_inference_steps: int | None, branch_factor: int) -> tuple[int, ...]:
    """The split steps as a sorted tuple, after checking them (distinct integers in 0 .. num_inference_steps - 1)
    and the factor (an integer >= 2); errors name the bad value and the fix."""
    if isinstance(branch_factor, bool) or not isinstance(branch_factor, int) or branch_factor < 2:
        raise ValueError(f"branch_factor={branch_factor!r} must be an integer >= 2 (children per node at a split "
                         "step; BranchGRPO: 2).")
    steps = list(branch_steps)
    if any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
        raise ValueError(f"branch_steps={steps!r} must be integers (sampling step indices), e.g. [0, 3, 6, 9].")
    # an unset step count (the model's own, resolved by the trainer) is checked once it is known
    bad = [s for s in steps if s < 0 or (num_inference_steps is not None and s >= num_inference_steps)]
    if bad:
        raise ValueError(f"branch_steps {bad} are outside 0 .. num_inference_steps - 1 = {num_inference_steps - 1}; "
                         "a split step is the index of a sampling step.")
    if len(set(steps)) != len(steps):
        raise ValueError(f"branch_steps={steps} repeats a step; list each split step once.")
    return tuple(sorted(steps))


@dataclass(frozen=True)
class BranchNode:
    """One node of a tree plan: the state x_level of branch ``branch``."""

    index: int          # position in TreePlan.nodes
    level: int          # 0 (initial noise) .. num_steps (final sample); also the node's depth
    branch: int         # 0 .. width(level) - 1
    parent: int | None  # the parent's index (None for the root)
    split: bool         # whether the edge into this node was sampled at a split step
    noise_seed: int     # seed of this node's Gaussian draw (the root's: the initial noise)

    @property
    def step(self) -> int | None:
        """The sampling step of the edge into this node (None for the root)."""
        return None if self.parent is None else self.level - 1


@dataclass(frozen=True)
class StepPlan:
    """What a rollout engine does at sampling step ``step``: evaluate the policy at ``parents`` (level ``step``) and
    draw ``children`` (level ``step + 1``, each with its own seed); F children per parent at a split step."""

    step: int
    split: bool
    parents: tuple[int, ...]
    children: tuple[int, ...]


@dataclass(frozen=True)
class TreePlan:
    """Which node is sampled at which step from which parent with which noise seed, for one prompt's tree."""

    num_steps: int
    branch_steps: tuple[int, ...]
    branch_factor: int
    nodes: tuple[BranchNode, ...]

    def width(self, level: int) -> int:
        """Nodes at ``level``: branch_factor ** (split steps before it)."""
        return self.branch_factor ** sum(1 for s in self.branch_steps if s < level)

    @cached_property
    def _level_start(self) -> tuple[int, ...]:
        starts, total = [], 0
        for level in range(self.num_steps + 1):
            starts.append(total)
            total += self.width(level)
        return tuple(starts)

    def node_index(self, level: int, branch: int) -> int:
        """Index of the node (level, branch)."""
        return self._level_start[level] + branch

    def level_nodes(self, level: int) -> tuple[int, ...]:
        """Indices of the nodes at ``level``, by branch."""
        start = self._level_start[level]
        return tuple(range(start, start + self.width(level)))

    @property
    def root(self) -> int:
        return 0

    @property
    def leaves(self) -> tuple[int, ...]:
        """The final samples' nodes, by branch: leaf j is sample j of the prompt's group."""
        return self.level_nodes(self.num_steps)

    @property
    def num_leaves(self) -> int:
        return self.width(self.num_steps)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[i]``: the indices of node i's children, by branch."""
        kids: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            if node.parent is not None:
                kids[node.parent].append(node.index)
        return tuple(tuple(k) for k in kids)

    def leaf_span(self, index: int) -> range:
        """Positions (0 .. num_leaves - 1) of the leaves below node ``index``."""
        node = self.nodes[index]
        per = self.num_leaves // self.width(node.level)
        return range(node.branch * per, (node.branch + 1) * per)

    @cached_property
    def edges(self) -> tuple[int, ...]:
        """Every non-root node (the edge into it), depth-first from the root with children by branch: the order in
        which the official code collects its training transitions."""
        order, stack = [], list(reversed(self.children[self.root]))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children[node]))
        return tuple(order)

    @cached_property
    def steps(self) -> tuple[StepPlan, ...]:
        """The sampling schedule, one `StepPlan` per step."""
        return tuple(StepPlan(step=s, split=s in self.branch_steps, parents=self.level_nodes(s),
                              children=self.level_nodes(s + 1)) for s in range(self.num_steps))

    @property
    def last_split(self) -> int | None:
        return max(self.branch_steps) if self.branch_steps else None


def branch_tree_plan(num_inference_steps: int, branch_steps: Sequence[int], branch_factor: int = 2, *, seed: int = 0,
                     generation: int = 0, tree_key: int = 0) -> TreePlan:
    """The tree of one prompt: ``tree_key`` identifies the prompt within the run (e.g. its dataset index, or its
    position in the generation batch), ``generation`` the generation batch, ``seed`` the run."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1.")
    steps = check_branch_steps(branch_steps, num_inference_steps, branch_factor)
    nodes: list[BranchNode] = []
    prev_start = 0
    for level in range(num_inference_steps + 1):
        split = level > 0 and (level - 1) in steps
        width = branch_factor ** sum(1 for s in steps if s < level)
        start = len(nodes)
        for branch in range(width):
            if level == 0:
                parent = None
            else:
                parent = prev_start + (branch // branch_factor if split else branch)
            nodes.append(BranchNode(index=start + branch, level=level, branch=branch, parent=parent, split=split,
                                    noise_seed=seed_for("branch-node", seed, generation, tree_key, level, branch)))
        prev_start = start
    return TreePlan(num_steps=num_inference_steps, branch_steps=steps, branch_factor=branch_factor, nodes=tuple(nodes))


def node_noise(node: BranchNode, shape: Sequence[int], device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The standard normal draw of ``node`` (one sample, shape ``shape``): drawn in float32 on the CPU from the node's
    seed, then moved, so that it is the same on every device and process."""
    gen = torch.Generator().manual_seed(node.noise_seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


# ---- the split step: noise scale and log-prob -------------------------------------------------------------------

def _split_factor(split: bool | torch.Tensor, branch_noise_scale: float, like: torch.Tensor) -> torch.Tensor:
    split_t = torch.as_tensor(split, device=like.device).reshape(-1)
    one = torch.ones((), dtype=like.dtype, device=like.device)
    return torch.where(split_t, one * branch_noise_scale, one)


def edge_std(std: torch.Tensor | float, split: bool | torch.Tensor, branch_noise_scale: float) -> torch.Tensor:
    """The std an edge is sampled with: ``branch_noise_scale * std`` at a split step, ``std`` elsewhere. ``std``
    and ``split`` are per sample (or scalars); the result is per sample."""
    std = torch.as_tensor(std, dtype=torch.float32) if not isinstance(std, torch.Tensor) else std
    std = std.reshape(-1)
    return std * _split_factor(split, branch_noise_scale, std)


def edge_log_prob(next_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float,
                  split: bool | torch.Tensor, branch_noise_scale: float, *, split_log_prob: str = "exact",
                  reduction: str = "mean") -> torch.Tensor:
    """log N(x'; mu, s_e^2) per sample, reduced over the non-batch dimensions by the mean (or the sum), in float32 at
    least, with s_e = ``branch_noise_scale`` s on split edges when ``split_log_prob="exact"`` (the distribution the
    child was drawn from) and s_e = s for ``"unscaled"`` (the official code's quirk) and on other edges.
    The gradient flows through ``mean``; ``next_sample`` is a constant."""
    if split_log_prob not in SPLIT_LOG_PROBS:
        raise ValueError(f"split_log_prob={split_log_prob!r} is not valid; choose 'exact' or 'unscaled'.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} is not valid; choose 'mean' or 'sum'.")
    dtype = torch.promote_types(torch.promote_types(mean.dtype, next_sample.dtype), torch.float32)
    mean = mean.to(dtype)
    batch = mean.shape[0]
    std_t = (std.to(dtype) if isinstance(std, torch.Tensor) else torch.tensor(float(std), dtype=dtype))
    std_t = std_t.to(mean.device).reshape(-1).expand(batch) if std_t.numel() == 1 else std_t.to(mean.device)
    if split_log_prob == "exact":
        std_t = std_t.reshape(-1) * _split_factor(split, branch_noise_scale, std_t).expand(batch)
    if bool((std_t <= 0).any()):
        raise ValueError("edge_log_prob needs a stochastic step (std > 0) for every sample.")
    std_b = std_t.reshape((batch,) + (1,) * (mean.ndim - 1))
    density = -((next_sample.detach().to(dtype) - mean) ** 2) / (2 * std_b**2) - torch.log(std_b) - _HALF_LOG_2PI
    dims = tuple(range(1, density.ndim))
    return density.mean(dim=dims) if reduction == "mean" else density.sum(dim=dims)


# ---- rewards and advantages --------------------------------------------------------------------------------------

def node_rewards(plan: TreePlan, leaf_rewards: torch.Tensor) -> torch.Tensor:
    """Each node's reward, the mean of its leaves' rewards (NaN rewards, unscored leaves, are left out; a node with
    no scored leaf is NaN). ``leaf_rewards`` ``(..., num_leaves)`` in leaf order; returns ``(..., num_nodes)``,
    float64."""
    if leaf_rewards.shape[-1] != plan.num_leaves:
        raise ValueError(f"leaf_rewards has {leaf_rewards.shape[-1]} rewards per tree but the tree has "
                         f"{plan.num_leaves} leaves (branch_factor ** len(branch_steps)).")
    r = leaf_rewards.to(torch.float64)
    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    out = torch.empty(*r.shape[:-1], len(plan.nodes), dtype=torch.float64, device=r.device)
    for level in range(plan.num_steps + 1):
        width = plan.width(level)
        per = plan.num_leaves // width
        sums = r0.reshape(*r.shape[:-1], width, per).sum(-1)
        counts = valid.reshape(*r.shape[:-1], width, per).sum(-1).to(torch.float64)
        means = torch.where(counts > 0, sums / counts.clamp_min(1), torch.full_like(sums, float("nan")))
        start = plan.node_index(level, 0)
        out[..., start:start + width] = means
    return out


def depth_advantages(plan: TreePlan, rewards: torch.Tensor, adv_clip_max: float = 5.0) -> torch.Tensor:
    """Per-node advantages normalised within each depth of each tree (see the module docstring); ``rewards``
    ``(..., num_nodes)`` from `node_rewards`; NaN rewards get 0 and are left out of their depth's mean and std."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for level in range(plan.num_steps + 1):
        idx = list(plan.level_nodes(level))
        r = rewards[..., idx].to(torch.float64)
        valid = ~torch.isnan(r)
        n = valid.sum(-1, keepdim=True).to(torch.float64)
        r0 = torch.where(valid, r, torch.zeros_like(r))
        mean = r0.sum(-1, keepdim=True) / n.clamp_min(1)
        var = (torch.where(valid, r - mean, torch.zeros_like(r)) ** 2).sum(-1, keepdim=True) / (n - 1).clamp_min(1)
        std = var.sqrt()
        a = (r - mean) / (std + DEPTH_STD_EPS)
        flat = (n < 2) | (std < MIN_DEPTH_STD)
        a = torch.where(valid & ~flat, a, torch.zeros_like(a))
        adv[..., idx] = a.clamp(-adv_clip_max, adv_clip_max)
    return adv


# ---- pruning -----------------------------------------------------------------------------------------------------

def depth_pruning_window(depths: Sequence[int], step: int = 0, slide_interval: int = 0,
                         stop_depth: int | None = None) -> tuple[int, ...]:
    """The depths whose edges are left out at optimizer step ``step``: ``depths``, moved up by
    min(step // slide_interval, min(depths) - stop_depth) when ``slide_interval`` > 0 (the official sliding
    window; ``stop_depth`` defaults to the caller's last split step)."""
    base = sorted(int(d) for d in depths)
    if not base or slide_interval <= 0:
        return tuple(base)
    stop = base[0] if stop_depth is None else int(stop_depth)
    shift = min(max(0, step // slide_interval), max(0, base[0] - stop))
    return tuple(d - shift for d in base)


def pruned_edges(plan: TreePlan, advantages: torch.Tensor, pruning: str = "none", *, width_mode: str = "per_branch",
                 width_ratio: float = 0.5, prune_depths: Sequence[int] = ()) -> torch.Tensor:
    """Which edges are trained: booleans ``(P, num_nodes)`` for the P trees of ``advantages`` ``(P, num_nodes)``
    (per-node advantages; the edge into node i carries advantage i); the root column is always False.

    ``pruning``: ``"none"`` (every edge), ``"depth"`` (leave out the edges into ``prune_depths``, e.g. from
    `depth_pruning_window`) or ``"width"`` (after the last split keep, by advantage, ``max(1, int(n width_ratio))``
    of the n edges of each last-split branch (``per_branch``) or the best ``k // 2`` and the worst ``k - k // 2``
    of all such edges over the P trees, k = ``max(2, int(n width_ratio))`` (``best_worst``))."""
    if pruning not in BRANCH_PRUNINGS:
        raise ValueError(f"branch_pruning={pruning!r} is not valid; choose one of {', '.join(BRANCH_PRUNINGS)}.")
    if width_mode not in BRANCH_WIDTH_MODES:
        raise ValueError(f"width_mode={width_mode!r} is not valid; choose 'per_branch' or 'best_worst'.")
    adv = advantages.reshape(-1, len(plan.nodes)) if advantages.ndim == 1 else advantages
    if adv.shape[-1] != len(plan.nodes):
        raise ValueError(f"advantages have {adv.shape[-1]} values per tree; the tree has {len(plan.nodes)} nodes.")
    keep = torch.zeros(adv.shape, dtype=torch.bool)
    edges = list(plan.edges)
    keep[:, edges] = True
    if pruning == "depth":
        depths = set(int(d) for d in prune_depths)
        for node in edges:
            if plan.nodes[node].level in depths:
                keep[:, node] = False
        return keep
    if pruning == "none" or plan.last_split is None:
        return keep
    last = plan.last_split
    # edges sampled after the last split, in the official order: trees in order, edges depth-first
    late = [(p, node) for p in range(adv.shape[0]) for node in edges if plan.nodes[node].step > last]
    if not late:
        return keep
    for p, node in late:
        keep[p, node] = False
    values = adv.detach().to("cpu", torch.float64)
    if width_mode == "per_branch":
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for p, node in late:
            anchor = node
            while plan.nodes[anchor].level > last + 1:
                anchor = plan.nodes[anchor].parent
            groups.setdefault((p, anchor), []).append((p, node))
        for members in groups.values():
            count = max(1, int(len(members) * width_ratio))
            best = sorted(members, key=lambda e: float(values[e[0], e[1]]), reverse=True)[:count]
            for p, node in best:
                keep[p, node] = True
    else:
        ordered = sorted(late, key=lambda e: float(values[e[0], e[1]]), reverse=True)
        count = max(2, int(len(ordered) * width_ratio))
        best_count = count // 2
        worst_count = count - best_count
        chosen = ordered[:best_count] + (ordered[-worst_count:] if worst_count > 0 else [])
        for p, node in chosen:
            keep[p, node] = True
    return keep


def tree_passes(num_inference_steps: int, branch_steps: Sequence[int], branch_factor: int) -> tuple[float, float]:
    """A tree's transformer passes and trained edges per leaf: step s evaluates the nodes it creates (a split repeats
    each parent once per child), and every step but the last (deterministic) is an edge. The planner's rollout and
    training counts of a BranchGRPO step."""
    plan = branch_tree_plan(num_inference_steps, branch_steps, branch_factor)
    rows = [plan.width(s + 1) for s in range(num_inference_steps)]
    return sum(rows) / plan.num_leaves, sum(rows[:-1]) / plan.num_leaves
