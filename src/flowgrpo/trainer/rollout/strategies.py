"""What an algorithm samples in a training rollout and what it records of it: `RolloutStrategy` and the two kinds the
trainers share.

* `SDEWindowRollout` (the Flow-GRPO family): SDE steps inside a window of the trajectory, deterministic steps
  elsewhere; records the window's transitions (x_j, x_{j+1}, log p_old, t_j, sigmas; the transition means for
  GRPO-Guard) and the window.
* `FinalSampleRollout` (DiffusionNFT, AWM, online Diffusion-DPO): a deterministic trajectory by the policy or by its
  old policy; records the clean latent x0 and the rollout's noise levels.

A strategy holds only settings (it is built from the configuration), so a rollout worker can run the same strategy as
the trainer; the engine it is given (`RolloutEngine`) samples, and the engine's policy gives the copies to sample with.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from ...models import PromptEmbeds
from ...schedulers import scheduled_sde_window
from ..seeds import seed_for

__all__ = ["FinalSampleRollout", "RolloutStrategy", "SDEWindowRollout"]


class RolloutStrategy:
    """The interface: ``sde_type`` (the stochastic step of the engine's SDE window), the options of the SDE scheduler,
    the ``plan`` every micro-batch of a generation shares, and ``rollout``, which samples one micro-batch."""

    sde_type: str = "sde"

    def scheduler_options(self) -> dict[str, Any]:
        """Keyword arguments of the `FlowMatchSDEScheduler` built from the pipeline's scheduler config."""
        return {}

    def plan(self, gen_index: int, step: int) -> Any:
        """What every micro-batch of generation ``gen_index`` shares (Flow-GRPO: the SDE window): a function of the
        step and the seed, so that a resumed run continues it and every process agrees."""
        return None

    def rollout(self, engine: Any, model: torch.nn.Module, embeds: PromptEmbeds, plan: Any,
                generator: torch.Generator, progress: Any, group_ids: torch.Tensor,
                gen_index: int) -> tuple[torch.Tensor, dict]:
        """Sample one micro-batch under ``torch.no_grad`` with ``model`` (the trained policy, in eval mode): returns
        the final latents (decoded and scored) and what the algorithm's loss needs of the rollout."""
        raise NotImplementedError

    def assign_advantages(self, generation: Any, advantages: torch.Tensor, kl_gate: torch.Tensor | None,
                          gathered_rewards: torch.Tensor, gathered_groups: torch.Tensor) -> None:
        """Write what the loss reads of the scored rewards into each micro-batch's record (called by the engine's
        ``score`` on every process). ``advantages`` / ``kl_gate``: this process's rows' group advantages and GARDO's
        gate; ``gathered_rewards`` / ``gathered_groups``: every process's weighted rewards (NaN: unscored) and group
        ids, in the generation's order. Default: each row's own advantage (and gate)."""
        for sl, record in zip(generation.chunks, generation.records):
            record["advantages"] = advantages[sl]
            if kl_gate is not None:  # GARDO: the samples whose KL penalty counts
                record["kl_gate"] = kl_gate[sl]


class SDEWindowRollout(RolloutStrategy):
    """Flow-GRPO's rollout: SDE inside the window ``plan``, ``ode_solver`` outside (see the module docstring).

    The window's start follows ``sde_window_strategy`` (random, MixGRPO's progressive schedule, fixed);
    ``same_noise_per_group`` shares x_1 within a group."""

    def __init__(self, args: Any):
        self.args = args
        self.sde_type = args.sde_type

    def scheduler_options(self) -> dict[str, Any]:
        return {"noise_level": self.args.noise_level, "sde_type": self.args.sde_type}

    @property
    def records_means(self) -> bool:
        """Whether each recorded step keeps its transition mean: GRPO-Guard's ratio and Flow-DPPO's frozen anchor
        (the means of the weights that sampled the batch) read them."""
        args = self.args
        return args.ratio_normalization == "grpo_guard" or getattr(args, "policy_loss", "clip") == "dppo"

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


class FinalSampleRollout(RolloutStrategy):
    """A deterministic rollout with ``solver`` (Euler or DPM-Solver++ 2M) that keeps each image's final latent x0 and
    the rollout's noise levels; sampled by the policy, or by its old policy (``by_old_policy``: DiffusionNFT, AWM
    off-policy). ``record_group_ids`` also keeps each row's group (online DPO picks its pairs within groups)."""

    def __init__(self, args: Any, solver: str, by_old_policy: bool = False, record_group_ids: bool = False):
        self.args = args
        self.solver = solver
        self.by_old_policy = by_old_policy
        self.record_group_ids = record_group_ids

    def sampling_model(self, engine: Any, model: torch.nn.Module):
        """A context giving the module that samples: the policy, or its old policy."""
        return engine.policy.old_policy.forward_model(model) if self.by_old_policy else nullcontext(model)

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        with self.sampling_model(engine, model) as sampler:
            final, record = engine.final_sample(sampler, embeds, generator, progress, self.solver)
        if self.record_group_ids:
            record["group_ids"] = group_ids
        return final, record
