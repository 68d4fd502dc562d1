"""Flow-GRPO's rollout strategy, `SDEWindowRollout`: SDE steps inside a window of the trajectory, deterministic steps
elsewhere; it records the window's transitions (x_j, x_{j+1}, log p_old, t_j, sigmas; the transition means for
GRPO-Guard and Flow-DPPO) and the window. BranchGRPO's trees (`branch_grpo_rollout.BranchTreeRollout`) build on it.
"""

from __future__ import annotations

from typing import Any

import torch

from ...schedulers import scheduled_sde_window
from ..rollout.strategies import RolloutStrategy
from ..seeds import seed_for

__all__ = ["SDEWindowRollout"]


class SDEWindowRollout(RolloutStrategy):
    """Flow-GRPO's rollout: SDE inside the window ``plan``, ``ode_solver`` outside (see the module docstring).

    The window's start follows ``sde_window_strategy`` (random, MixGRPO's progressive schedule, fixed);
    ``same_noise_per_group`` shares x_1 within a group."""

    def __init__(self, args: Any, records_means: bool = False):
        self.args = args
        self.sde_type = args.sde_type
        #: whether each recorded step keeps its transition mean: GRPO-Guard's ratio and Flow-DPPO's frozen anchor (the
        #: means of the weights that sampled the batch) read them (the spec's ``RolloutRecord.means``)
        self.records_means = records_means

    def scheduler_options(self) -> dict[str, Any]:
        return {"noise_level": self.args.noise_level, "sde_type": self.args.sde_type}

    def plan(self, gen_index: int, step: int) -> tuple[int, int]:
        """The generation's SDE window: a function of the optimizer step and the seed only."""
        args = self.args
        window_gen = torch.Generator().manual_seed(seed_for(args.seed, gen_index))
        return scheduled_sde_window(
            args.sde_window_strategy, step, args.num_inference_steps, args.sde_window_size, args.sde_window_range,
            args.sde_window_shift_interval, args.sde_window_stride, args.sde_window_roll_back, generator=window_gen,
        )

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        args = self.args
        initial = self.group_initial_latents(engine.adapter, group_ids, gen_index) if args.same_noise_per_group \
            else None
        final, traj = engine.sample(model, embeds, args.num_inference_steps, args.guidance_scale, args.noise_level,
                                    plan, generator, record=True, progress=progress, ode_solver=args.ode_solver,
                                    ode_compression_ratio=args.ode_compression_ratio, initial_latents=initial,
                                    record_means=self.records_means)
        traj["window"] = plan
        return final, traj

    def group_initial_latents(self, adapter: Any, group_ids: torch.Tensor, gen_index: int) -> torch.Tensor:
        """Initial noise shared by the members of each group (``same_noise_per_group``).

        Sample ``i`` draws x_1 from a generator seeded by (seed, generation index, ``group_ids[i]``), so every member
        of a group gets the same x_1 wherever it is sampled (any micro-batch, any process, any rollout worker).
        """
        height, width = self.args.image_size
        gens = [torch.Generator().manual_seed(seed_for(self.args.seed, 104729, gen_index, int(g)))
                for g in group_ids.tolist()]
        return adapter.prepare_latents(len(gens), height, width, gens, torch.device("cpu"), torch.float32)
