"""What an algorithm samples in a training rollout and what it records of it: `RolloutStrategy`, and the kind that
several trainers share.

* `FinalSampleRollout` (DiffusionNFT, AWM, online Diffusion-DPO): a deterministic trajectory by the policy or by its
  old policy; records the clean latent x0 and the rollout's noise levels.

A strategy holds only settings (it is built from the configuration), so a rollout worker can run the same strategy as
the trainer; the engine it is given (`RolloutEngine`) samples, and the engine's policy gives the copies to sample with.
A strategy of one algorithm lives with it (Flow-GRPO's `SDEWindowRollout` in
``flowgrpo.trainer.algorithms.flow_grpo_rollout``).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch

from ...models import PromptEmbeds

__all__ = ["FinalSampleRollout", "RolloutStrategy"]


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

    def advantage_groups(self, group_ids: torch.Tensor) -> torch.Tensor:
        """The groups the advantages are normalised within, for every row of the generation over all processes in
        order (``group_ids``: each row's prompt group, gathered). Default: the prompt groups; TempFlow-GRPO: the
        children that branch from one state (a group's rows at one branch step)."""
        return group_ids

    def for_workers(self, worker_args: Any, max_staleness: int) -> RolloutStrategy:
        """The strategy a rollout worker runs (``rollout_backend: ray``): by default a copy on the worker's copy of the
        configuration. An algorithm whose worker samples or records differently returns its own variant (AWM records
        the sampling policy's surrogate log-probs whenever samples may be stale; BranchGRPO samples a request's trees
        whole)."""
        strategy = copy.copy(self)
        strategy.args = worker_args
        return strategy

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
