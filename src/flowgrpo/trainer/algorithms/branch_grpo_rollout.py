r"""BranchGRPO's tree rollouts in the Flow-GRPO trainer: `BranchTreeRollout`, the strategy that samples each group as a
tree with shared prefixes, gives every edge its child's depth-wise advantage, and lays the edges out for training.

**Sampling.** The G = ``branch_factor ** len(branch_steps)`` rows of a group are the leaves of one tree
(`branch_grpo.branch_tree_plan`, keyed by the prompt's dataset index). Row k of the generation batch (counted over
every process, `RolloutEngine.rollout_rows`) is leaf ``k mod G`` of its group's tree. A micro-batch samples the
ancestors of its own leaves, level by level, with the engine's sampler run over the stretches between split steps
(``RolloutEngine.sample(steps=..., step_noise=...)``): at a split step every needed node is repeated once per needed
child, and each child draws its own noise ``branch_noise_scale * std * z`` with z from the child's seed
(`branch_grpo.node_noise`); elsewhere x' = mean + std z, z from the node's seed. Every draw is a function of the node
alone, so a tree split over micro-batches or processes is sampled the same everywhere (shared prefixes are then
sampled once per micro-batch that needs them), and the order in which anything runs changes nothing. Every step but
the last is an SDE step (the tree's edges); the last one is the deterministic step to sigma = 0, i.e. the
x0-prediction that the official code decodes, so its edges are not trained. On a rollout worker (`for_workers`,
the spec's ``WorkerNeeds.whole_groups``) a micro-batch samples its trees with all of their leaves in the request and
keeps the leaves of later micro-batches for them: a tree's shared prefixes are sampled once per request.

**The record** has Flow-GRPO's layout, one row per leaf and one column per SDE step (each leaf's path), plus which
row *owns* each edge: the edge into node c is trained once, by the row of the first leaf below c. Its log-probs are
`branch_grpo.edge_log_prob` of the recorded transition means, so that split edges use the std they were drawn with
(``branch_split_log_prob: exact``) or, for comparison with published runs only, the unscaled std (``unscaled``, the
official code's quirk), for the old and the trained policy alike.

**Advantages** (`BranchTreeRollout.assign_advantages`, from the rewards gathered over every process): a node's reward
is the mean of its leaves' (`node_rewards`), advantages are normalised per depth within each tree
(`depth_advantages`, clamped to ``adv_clip_max``), every edge carries its child's, and `pruned_edges` (applied to
all the generation's trees together) leaves out what ``branch_pruning`` prunes. With reward constraints each
constrained reward's own depth-wise advantages join the objective's as every trainer's do
(``rollout/advantages.py``, `combine_constrained_advantages`), before pruning.

**Training** (`tree_parts`, the trainer's `_batch_loss`): one backward pass per SDE step that has trained edges;
each edge's clipped (or Flow-DPPO) objective at its parent state, weighted so that the micro-batch's loss is the mean
over its trained edges.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...schedulers import SDESettings, sde_transition
from ..rollout.advantages import combine_constrained_advantages
from .branch_grpo import (
    TreePlan,
    branch_tree_plan,
    depth_advantages,
    depth_pruning_window,
    edge_log_prob,
    edge_std,
    node_noise,
    node_rewards,
    pruned_edges,
)
from .flow_grpo_rollout import SDEWindowRollout

__all__ = ["BranchTreeRollout", "is_tree_record", "step_std", "tree_parts"]


def is_tree_record(record: Any) -> bool:
    """Whether a recorded micro-batch holds BranchGRPO tree edges."""
    return "tree_owner" in record


def step_std(sigma: torch.Tensor, sigma_next: torch.Tensor, sde: SDESettings) -> torch.Tensor:
    """The transition std of SDE steps from ``sigma`` to ``sigma_next`` (per element of the tensors), as the sampler
    computes it (`sde_transition`; the std does not depend on the state or the velocity)."""
    zeros = torch.zeros(sigma.numel(), 1, dtype=torch.float32, device=sigma.device)
    return sde_transition(zeros, zeros, sigma.reshape(-1), sigma_next.reshape(-1), sde,
                          next_state=zeros).std.reshape(sigma.shape)


class BranchTreeRollout(SDEWindowRollout):
    """BranchGRPO's tree rollout (see the module docstring); built from a `FlowGRPOConfig` with ``branch_steps``."""

    def __init__(self, args: Any):
        super().__init__(args, records_means=True)  # the split-aware log-probs are computed from the recorded means
        self._shape_plan: TreePlan | None = None
        #: sample every tree of a micro-batch with all of its leaves in the share (a rollout worker's request), keeping
        #: the leaves of later micro-batches for them: a tree's shared prefixes are then sampled once per request
        self.whole_trees = False
        self._kept: dict[int, tuple[torch.Tensor, dict]] = {}
        self._kept_shared: dict[str, Any] = {}
        self._kept_generation: int | None = None

    def for_workers(self, worker_args: Any, max_staleness: int) -> BranchTreeRollout:
        """On a rollout worker a request's trees are sampled whole (`WorkerNeeds.whole_groups`)."""
        strategy = super().for_workers(worker_args, max_staleness)
        strategy.whole_trees = True
        strategy._kept, strategy._kept_shared, strategy._kept_generation = {}, {}, None
        return strategy

    def plan(self, gen_index: int, step: int) -> tuple[int, int]:
        return 0, self.args.num_inference_steps - 1  # every step but the last is an SDE step (an edge)

    def tree_plan(self, gen_index: int, tree_key: int) -> TreePlan:
        args = self.args
        return branch_tree_plan(args.num_inference_steps, args.branch_steps, args.branch_factor, seed=args.seed,
                                generation=gen_index, tree_key=tree_key)

    def shape_plan(self) -> TreePlan:
        """The tree's shape (the same for every tree; its seeds are not used)."""
        if self._shape_plan is None:
            args = self.args
            self._shape_plan = branch_tree_plan(args.num_inference_steps, args.branch_steps, args.branch_factor)
        return self._shape_plan

    # ---- sampling ------------------------------------------------------------------------------------------------
    #: the record's values that are not one per row (kept whole when a record is cut into micro-batches)
    SHARED_KEYS = ("window", "tree_split")

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        positions = engine.rollout_rows
        if positions is None or len(positions) != len(embeds):
            raise RuntimeError("BranchGRPO's rollout needs the rows' positions in the generation batch "
                               "(RolloutEngine.rollout_rows).")
        share = engine.share_rows
        if not self.whole_trees or share is None:
            return self._sample_trees(engine, model, embeds, progress, group_ids, gen_index, positions)
        if self._kept_generation != gen_index:
            self._kept, self._kept_shared, self._kept_generation = {}, {}, gen_index
        wanted = positions.tolist()
        if not all(p in self._kept for p in wanted):
            # every leaf of this micro-batch's trees that the share holds, sampled together; a leaf of a later
            # micro-batch is kept for it (each draw is a function of its node: the same values as sampled there)
            leaves = self.shape_plan().num_leaves
            trees = {p // leaves for p in wanted}
            together = [p for p in share.tolist() if p // leaves in trees]
            first: dict[int, int] = {}
            for row, p in enumerate(wanted):
                first.setdefault(p // leaves, row)
            index = torch.tensor([first[p // leaves] for p in together])  # a row of the same group: its prompt
            final, record = self._sample_trees(engine, model, embeds.index_select(index), progress,
                                               group_ids[index], gen_index, torch.tensor(together))
            if together == wanted:
                return final, record
            for i, p in enumerate(together):
                self._kept[p] = (final[i], {k: v[i] for k, v in record.items() if k not in self.SHARED_KEYS})
            self._kept_shared = {k: record[k] for k in self.SHARED_KEYS}
        rows = [self._kept.pop(p) for p in wanted]
        record = {k: torch.stack([row[1][k] for row in rows]) for k in rows[0][1]}
        record.update(self._kept_shared)
        return torch.stack([row[0] for row in rows]), record

    def _sample_trees(self, engine, model, embeds, progress, group_ids: torch.Tensor, gen_index: int,
                      positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The trees of the rows at ``positions`` (their positions in the generation batch), each row its leaf."""
        args = self.args
        steps = args.num_inference_steps
        shape = self.shape_plan()
        leaves_per_tree = shape.num_leaves
        leaf = (positions % leaves_per_tree).tolist()
        keys = group_ids.tolist()
        # the trees of this micro-batch, in row order, and the leaves each one samples here
        trees: dict[int, dict[str, Any]] = {}
        for row, (key, j) in enumerate(zip(keys, leaf)):
            tree = trees.setdefault(key, {"rows": [], "leaves": []})
            tree["rows"].append(row)
            tree["leaves"].append(j)
        for key, tree in trees.items():
            if len(set(tree["leaves"])) != len(tree["leaves"]):
                raise RuntimeError(f"Group {key} has two rows at the same leaf of its tree: the generation batch does "
                                   f"not hold each group as {leaves_per_tree} consecutive rows.")
            tree["plan"] = self.tree_plan(gen_index, key)
        order = list(trees)

        def branch_at(level: int, j: int) -> int:
            return j // (leaves_per_tree // shape.width(level))

        def needed(level: int) -> list[tuple[int, int]]:
            """(tree position, branch) of every node at ``level`` above this micro-batch's leaves."""
            out = []
            for t, key in enumerate(order):
                out += [(t, b) for b in sorted({branch_at(level, j) for j in trees[key]["leaves"]})]
            return out

        height, width = args.image_size
        roots = [trees[key]["plan"].nodes[0] for key in order]
        gens = [torch.Generator().manual_seed(node.noise_seed) for node in roots]
        latents = engine.adapter.prepare_latents(len(gens), height, width, gens, torch.device("cpu"), torch.float32)
        rows = [(t, 0) for t in range(len(order))]  # the current rows: (tree position, branch) at the current level
        tree_rows = torch.tensor([trees[key]["rows"][0] for key in order])
        scale = float(args.branch_noise_scale)
        latent_shape = tuple(latents.shape[1:])
        bounds = sorted({0, steps, *args.branch_steps})
        segments: list[tuple[int, int, list[tuple[int, int]], dict]] = []
        final = None
        for start, end in zip(bounds[:-1], bounds[1:]):
            if start in args.branch_steps:  # each node becomes one row per needed child
                children = needed(start + 1)
                parent_row = {node: r for r, node in enumerate(rows)}
                index = [parent_row[(t, b // shape.branch_factor)] for t, b in children]
                latents = latents[torch.tensor(index, device=latents.device)]
                rows = children
            level_rows = rows

            def step_noise(i: int, level_rows=level_rows, split_step=start if start in args.branch_steps else None):
                draws = []
                for t, b in level_rows:
                    tree = trees[order[t]]["plan"]
                    node = tree.nodes[tree.node_index(i + 1, b)]
                    draws.append(node_noise(node, latent_shape))
                z = torch.stack(draws)
                return z * scale if i == split_step else z

            row_embeds = embeds.index_select(tree_rows[torch.tensor([t for t, _ in rows])])
            latents, record = engine.sample(
                model, row_embeds, steps, args.guidance_scale, args.noise_level, (0, steps - 1), None, record=True,
                progress=progress, ode_solver=args.ode_solver, initial_latents=latents, record_means=True,
                steps=(start, end), step_noise=step_noise)
            segments.append((start, end, rows, record))
            final = latents
        return self._leaf_order(final, rows, order, trees), self._leaf_record(segments, order, trees, leaf, positions,
                                                                              engine)

    @staticmethod
    def _leaf_order(final: torch.Tensor, rows: list[tuple[int, int]], order: list[int], trees: dict) -> torch.Tensor:
        """The final latents in the micro-batch's row order (row r: its tree's leaf)."""
        where = {node: r for r, node in enumerate(rows)}
        total = sum(len(trees[key]["rows"]) for key in order)
        by_row = [0] * total
        for t, key in enumerate(order):
            for row, j in zip(trees[key]["rows"], trees[key]["leaves"]):
                by_row[row] = where[(t, j)]
        index = torch.tensor(by_row, device=final.device)
        return final[index]

    def _leaf_record(self, segments: list, order: list[int], trees: dict, leaf: list[int], positions: torch.Tensor,
                     engine: Any) -> dict:
        """Each leaf row's path through the segments' records, in Flow-GRPO's layout, with the tree's bookkeeping."""
        args = self.args
        shape = self.shape_plan()
        sde_steps = args.num_inference_steps - 1
        batch = len(leaf)
        tree_of_row = [0] * batch
        for t, key in enumerate(order):
            for row in trees[key]["rows"]:
                tree_of_row[row] = t
        columns: dict[str, list[torch.Tensor]] = {}
        owner = torch.zeros(batch, sde_steps, dtype=torch.bool)
        node = torch.zeros(batch, sde_steps, dtype=torch.long)
        for start, end, rows, record in segments:
            where = {n: r for r, n in enumerate(rows)}
            for s in range(start, min(end, sde_steps)):
                level = s + 1
                per = shape.num_leaves // shape.width(level)
                index = []
                for row in range(batch):
                    branch = leaf[row] // per
                    index.append(where[(tree_of_row[row], branch)])
                    node[row, s] = shape.node_index(level, branch)
                    owner[row, s] = leaf[row] == branch * per
                pick = torch.tensor(index, device=record["latents"].device)
                for key, value in record.items():
                    columns.setdefault(key, []).append(value[pick, s - start])
        out = {key: torch.stack(values, dim=1) for key, values in columns.items()}
        split = torch.tensor([s in args.branch_steps for s in range(sde_steps)])
        # the log-probs of the edges as drawn (exact) or as the official code computes them (unscaled)
        std = step_std(out["sigmas"], out["sigmas_next"], engine.sde_settings())
        flat = lambda x: x.reshape(batch * sde_steps, *x.shape[2:])  # noqa: E731
        out["log_probs"] = edge_log_prob(flat(out["next_latents"]), flat(out["means"]), flat(std),
                                         split.expand(batch, -1).reshape(-1), args.branch_noise_scale,
                                         split_log_prob=args.branch_split_log_prob).reshape(batch, sde_steps)
        device = out["latents"].device
        out.update(window=(0, sde_steps), tree_split=split.to(device), tree_owner=owner.to(device),
                   tree_node=node.to(device), tree_leaf=torch.tensor(leaf, device=device),
                   tree_rows=positions.to(device))
        return out

    # ---- advantages and pruning ------------------------------------------------------------------------------------
    def assign_advantages(self, generation, advantages, kl_gate, gathered_rewards, gathered_groups) -> None:
        """Node rewards, depth-wise advantages and pruning of every tree of the generation (the same on every
        process, from the gathered rewards); each record gets its rows' edge advantages (``edge_advantages``) and the
        edges it trains (``edge_trained``: owned and not pruned)."""
        super().assign_advantages(generation, advantages, None, gathered_rewards, gathered_groups)
        args = self.args
        shape = self.shape_plan()
        g = shape.num_leaves
        total = gathered_rewards.numel()
        if total % g:
            raise RuntimeError(f"The generation batch holds {total} rows, not whole trees of {g} leaves.")
        groups = gathered_groups.reshape(-1, g)
        if not bool((groups == groups[:, :1]).all()):
            raise RuntimeError("A tree's leaves are not consecutive rows of one group in the generation batch; "
                               "BranchGRPO needs the trainer's RepeatSampler layout.")
        rewards = gathered_rewards.reshape(-1, g)
        node_adv = depth_advantages(shape, node_rewards(shape, rewards), args.adv_clip_max)
        terms = generation.constraint_terms
        if terms is not None and terms.active:  # reward constraints: each constrained reward's depth-wise advantage
            constrained = {name: depth_advantages(shape, node_rewards(shape, scores.reshape(-1, g)), math.inf)
                           for name, scores in terms.rewards.items()}
            node_adv = combine_constrained_advantages(node_adv, constrained, terms.multipliers, args.adv_clip_max)
        depths = ()
        if args.branch_pruning == "depth":
            depths = depth_pruning_window(args.branch_prune_depths, generation.step, args.branch_prune_slide_interval,
                                          stop_depth=shape.last_split)
        keep = pruned_edges(shape, node_adv, args.branch_pruning, width_mode=args.branch_width_mode,
                            width_ratio=args.branch_width_ratio, prune_depths=depths)
        for record in generation.records:
            tree = (record["tree_rows"] // g).cpu()
            nodes = record["tree_node"].cpu()
            adv = node_adv[tree[:, None], nodes].to(torch.float32)
            kept = keep[tree[:, None], nodes]
            device = record["tree_owner"].device
            record["edge_advantages"] = adv.to(device)
            record["edge_trained"] = record["tree_owner"] & kept.to(device)


def tree_parts(batch: Any) -> tuple[list[int], int]:
    """The SDE steps of a scored tree record that have trained edges, and the number of trained edges."""
    trained = batch["edge_trained"]
    counts = trained.sum(0)
    return [s for s in range(trained.shape[1]) if int(counts[s]) > 0], int(counts.sum())


def tree_step_std(batch: Any, rows: torch.Tensor, step: int, std: torch.Tensor, args: Any) -> torch.Tensor:
    """The std of the trained edges' log-probs at ``step``: the split-scaled std on split edges with ``exact``."""
    split = bool(batch["tree_split"][step])
    if args.branch_split_log_prob == "exact" and split:
        return edge_std(std, True, args.branch_noise_scale)
    return std
