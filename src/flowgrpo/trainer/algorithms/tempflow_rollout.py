"""TempFlow-GRPO's rollout strategy, `TempFlowRollout`: each group an ODE trunk whose states branch into SDE children
at the branch steps, each child continued by ODE to its clean sample (the layout and weights: `tempflow`).

Row k of group g (rows g G .. g G + G - 1 of the generation, over every process) is child ``k % C`` branching at
``tempflow_branch_steps[k // C]``. A micro-batch samples the trunk of each group it holds (from the group's initial
noise, a function of the seed, the generation and the group's dataset index) up to the latest branch step its rows
need, then for each branch step j the rows branching there: the SDE step j from the trunk's x_j (each child's draw a
function of the seed, the generation, the group, j and the child) and the ODE steps after it, through the rollout
engine's sampler. Every draw is a function of what it samples, so a group split over micro-batches or processes is
sampled the same. The record has Flow-GRPO's layout with one recorded step per row (x_j, the child's x_{j+1}, its
log-prob, t_j, the noise levels) and each row's branch step (``tempflow_step``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..seeds import seed_for
from .flow_grpo_rollout import SDEWindowRollout
from .tempflow import advantage_group_of

__all__ = ["TempFlowRollout", "is_tempflow_record"]


def is_tempflow_record(record: Any) -> bool:
    """Whether ``record`` is a TempFlow-GRPO rollout's (each row one child with its branch step)."""
    return "tempflow_step" in record


class TempFlowRollout(SDEWindowRollout):
    """TempFlow-GRPO's rollout (see the module docstring); built from a `FlowGRPOConfig` with ``tempflow_children``."""

    def plan(self, gen_index: int, step: int) -> list[int]:
        return list(self.args.tempflow_branch_steps)

    def advantage_groups(self, group_ids: torch.Tensor) -> torch.Tensor:
        """Each row's siblings: the children of its group at its branch step (`tempflow.advantage_group_of`)."""
        args = self.args
        return torch.tensor([advantage_group_of(p, args.num_generations, args.tempflow_children,
                                                args.tempflow_branch_steps) for p in range(len(group_ids))],
                            dtype=torch.long)

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        args = self.args
        steps = int(args.num_inference_steps)
        children = int(args.tempflow_children)
        branch_steps = list(plan)
        positions = engine.rollout_rows
        if positions is None or len(positions) != len(embeds):
            raise RuntimeError("TempFlow-GRPO's rollout needs the rows' positions in the generation batch "
                               "(RolloutEngine.rollout_rows).")
        within = (positions % args.num_generations).tolist()
        step_of = [branch_steps[k // children] for k in within]
        child_of = [k % children for k in within]
        keys = group_ids.tolist()
        # the trunks: one per group of this micro-batch, batched, sampled to each branch step its rows need
        groups = list(dict.fromkeys(keys))
        first_row = [keys.index(key) for key in groups]
        height, width = args.image_size
        gens = [torch.Generator().manual_seed(seed_for(args.seed, 7919, gen_index, int(key))) for key in groups]
        state = engine.adapter.prepare_latents(len(gens), height, width, gens, torch.device("cpu"), torch.float32)
        trunk_embeds = embeds.index_select(torch.tensor(first_row))
        trunk: dict[int, torch.Tensor] = {}
        level = 0
        for j in sorted(set(step_of)):
            if j > level:
                state, _ = engine.sample(model, trunk_embeds, steps, args.guidance_scale, 0.0, (0, 0), None,
                                         record=False, initial_latents=state, steps=(level, j))
                level = j
            trunk[j] = state.to(torch.float32)
        latent_shape = tuple(state.shape[1:])
        # the children: the rows branching at each step, the SDE step j and the ODE steps after it
        final: list[torch.Tensor | None] = [None] * len(keys)
        recorded: list[dict | None] = [None] * len(keys)
        for j in sorted(set(step_of)):
            rows = [r for r, s in enumerate(step_of) if s == j]
            parents = torch.tensor([groups.index(keys[r]) for r in rows], device=trunk[j].device)
            draws = torch.stack([
                torch.randn(latent_shape, generator=torch.Generator().manual_seed(
                    seed_for(args.seed, 7927, gen_index, int(keys[r]), j, child_of[r])), dtype=torch.float32)
                for r in rows])

            def step_noise(i: int, draws=draws) -> torch.Tensor:
                return draws

            out, record = engine.sample(model, embeds.index_select(torch.tensor(rows)), steps, args.guidance_scale,
                                        args.noise_level, (j, j + 1), None, record=True,
                                        initial_latents=trunk[j][parents], record_means=self.records_means,
                                        steps=(j, steps), step_noise=step_noise)
            for n, r in enumerate(rows):
                final[r] = out[n]
                recorded[r] = {key: value[n] for key, value in record.items()}
        if progress is not None:
            progress.update(steps)
        traj = {key: torch.stack([rec[key] for rec in recorded]) for key in recorded[0]}
        traj["tempflow_step"] = torch.tensor(step_of, dtype=torch.long)
        traj["window"] = (min(step_of), max(step_of) + 1)
        return torch.stack(final), traj
