"""FlowGRPOTrainer: Flow-GRPO (and its Fast / CPS / MixGRPO / GRPO-Guard / DanceGRPO variants) on
``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout* (`flow_grpo_rollout.SDEWindowRollout`). Images are sampled in micro-batches with SDE steps inside the
   rollout's window and deterministic steps outside; for the window's steps the record keeps x_j, x_{j+1},
   log p_old(x_{j+1} | x_j), t_j and the noise levels.
2. *Reward.* Decoded and scored in the background; gathered into group advantages while the first training forward
   runs (`OnlineRLTrainer`).
3. *Training.* For each micro-batch and each stored step j, the policy's transition log-prob is recomputed with the
   same guidance and negative embeddings and `flow_grpo_loss` gives the clipped-ratio loss, plus ``beta`` x a KL
   estimate to the reference (the math is there); each step's loss is divided by the number of steps and the
   accumulation steps. The stored steps are replayed ``train_timesteps_per_pass`` at a time, their rows stacked into
   one forward and one backward (`timestep_passes`; default one step per backward, so activation memory is bounded
   by one step). On the first pass the ratio is exactly 1 (same inputs, dtype and per-row computation as sampling):
   ``on_policy_ratio_max_dev`` logs the drift and a warning names the likely causes.

Variants (``FlowGRPOConfig``): the window's start follows ``sde_window_strategy`` (random, MixGRPO's progressive
schedule, fixed); the deterministic steps use ``ode_solver`` (Euler or DPM-Solver++ 2M, with the steps after the
window compressed by ``ode_compression_ratio``); ``same_noise_per_group`` shares x_1 within a group;
``reward_aggregation`` combines several rewards (``advantages.py``). DanceGRPO is ``sde_type="dance"`` with
``same_noise_per_group`` and ``timestep_fraction < 1`` (each sample trains a random subset of its steps).

Three switches change the objective and the rollout. ``policy_loss: dppo`` (Flow-DPPO, `flow_dppo_loss`) replaces
the ratio clip by a trust region on the divergence from the frozen anchor, the transition means of the weights that
sampled the batch (recorded during the rollout, which computes exactly them, so no extra forward). ``branch_steps``
(BranchGRPO, `branch_grpo_rollout.BranchTreeRollout`) samples each group as a tree with shared prefixes and trains
every edge with its child's depth-wise advantage. ``tempflow_children`` (TempFlow-GRPO,
`tempflow_rollout.TempFlowRollout`) samples each group as one ODE trajectory branching into SDE children at its branch
steps and trains each child's step with its siblings' advantage, weighted by the step's noise level (`tempflow`).

Logged besides the shared keys: ``policy_loss``, ``approx_kl``, ``clip_frac``, ``ratio_mean``, ``sde_window_start``,
``on_policy_ratio_max_dev`` (first pass), ``kl`` (beta > 0); Flow-DPPO: ``dppo/dropped_frac``, ``dppo/outside_frac``,
``dppo/divergence_mean``, ``dppo/divergence_max`` instead of ``clip_frac``; BranchGRPO: ``branch/trained_edges``;
TempFlow-GRPO: ``tempflow/weight`` (the mean loss weight of a branch step).
"""

from __future__ import annotations

import warnings
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import torch

from ...models.defaults import generation_card_lines
from ...schedulers import sde_transition
from ..online_trainer import LossPart, OnlineRLTrainer
from ..outputs.lora_export import LORA_WEIGHTS_NAME
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .branch_grpo import edge_log_prob
from .branch_grpo_rollout import BranchTreeRollout, is_tree_record, tree_parts, tree_step_std
from .flow_dppo_loss import flow_dppo_loss
from .flow_grpo_config import FlowGRPOConfig
from .flow_grpo_importance import stale_generation_replay
from .flow_grpo_loss import flow_grpo_loss, gated_mean, grpo_guard_log_ratio, kl_estimate
from .flow_grpo_rollout import SDEWindowRollout
from .tempflow import weighted_advantages
from .tempflow_rollout import TempFlowRollout, is_tempflow_record

__all__ = ["FlowGRPOTrainer", "LORA_WEIGHTS_NAME", "TrainedTransition"]

#: the per-step tensors of a recorded micro-batch (``(batch, steps, ...)``), reindexed by `_prepare_batch`
STEP_KEYS = ("latents", "next_latents", "log_probs", "timesteps", "sigmas", "sigmas_next", "means")


@dataclass
class TrainedTransition:
    """One trained step of a micro-batch, as Flow-GRPO's objective reads it: the recorded transition x -> x' at
    (t, sigma -> sigma'), the prompts' embeddings, the trained policy's velocity and transition (log-prob, mean, std,
    with gradient), the sampling policy's log-prob and mean (the anchor of Flow-DPPO and GRPO-Guard), the
    advantages, GARDO's gate and, with a KL term, the reference's velocity at the same point (no gradient)."""

    state: torch.Tensor
    next_state: torch.Tensor
    timestep: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    embeds: Any
    velocity: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    old_log_prob: torch.Tensor | None = None
    old_mean: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    kl_gate: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None


class FlowGRPOTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with Flow-GRPO (see `OnlineRLTrainer` for the arguments; ``args``: a
    ``FlowGRPOConfig``)."""

    _tag_names = ["flow-grpo", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "Flow-GRPO"
    _paper = {
        "title": "Flow-GRPO: Training Flow Matching Models via Online RL",
        "id": "2505.05470",
        "citation": (
            "@article{liu2025flowgrpo,\n  title={Flow-GRPO: Training Flow Matching Models via Online RL},\n"
            "  author={Liu, Jie and others},\n  journal={arXiv preprint arXiv:2505.05470},\n  year={2025}\n}"
        ),
    }
    _config_class = FlowGRPOConfig
    #: set once the first-pass ratio has drifted beyond ``on_policy_tolerance`` (one warning per trainer)
    _warned_off_policy = False

    def _rollout_strategy(self, args: FlowGRPOConfig) -> SDEWindowRollout:
        if args.uses_branching:
            return BranchTreeRollout(args)
        if args.uses_tempflow:
            return TempFlowRollout(args, records_means=self.spec.facts(args).record.means)
        return SDEWindowRollout(args, records_means=self.spec.facts(args).record.means)

    def _prepare_batch(self, record: dict) -> dict:
        """With ``timestep_fraction < 1`` (DanceGRPO), each sample keeps a random ``max(1, int(n * fraction))`` of
        its ``n`` recorded steps, in random order (a permutation per sample, as in the official code); drawn from
        the seed, the micro-step and the process, so that a resumed run draws the same.

        A BranchGRPO record is scored first (which edges are trained depends on the rewards, through pruning), then
        trained one SDE step with trained edges at a time (``tree_parts``)."""
        if is_tree_record(record):
            self.rollouts.resolve_scoring()
            parts, edges = tree_parts(record)
            return ChainMap({"tree_parts": parts, "tree_edges": edges}, record)
        if is_tempflow_record(record):  # one part per branch step the micro-batch holds
            return ChainMap({"tempflow_parts": sorted(set(record["tempflow_step"].tolist()))}, record)
        fraction = self.args.timestep_fraction
        num_steps = record["latents"].shape[1]
        if fraction >= 1:
            return record
        keep = max(1, int(num_steps * fraction))
        size = record["latents"].shape[0]
        gen = torch.Generator().manual_seed(seed_for(self.args.seed, 7331, self._micro_step,
                                                     self.data_parallel.process_index))
        order = torch.stack([torch.randperm(num_steps, generator=gen)[:keep] for _ in range(size)])
        rows = torch.arange(size)[:, None]
        selected = {key: record[key][rows.to(record[key].device), order.to(record[key].device)]
                    for key in STEP_KEYS if key in record}
        return ChainMap(selected, record)  # the advantages arrive in the record once it is scored

    def _loss_parts(self, batch: dict) -> int:
        if is_tree_record(batch):
            return max(1, len(batch["tree_parts"]))
        if is_tempflow_record(batch):
            return len(batch["tempflow_parts"])
        return batch["latents"].shape[1]

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the recorded steps ``parts`` (indices into the micro-batch's steps), replayed in one forward
        over their rows stacked (`_replay_parts`); each step's loss is `_objective` of its own transitions."""
        if is_tree_record(batch):
            return self._tree_losses(model, batch, parts, first_pass)
        if is_tempflow_record(batch):
            return self._tempflow_losses(model, batch, parts, first_pass)
        steps = self._replay_parts(model, batch, [(j, None) for j in parts])
        losses = []
        for j, step in zip(parts, steps):
            step.old_log_prob = batch["log_probs"][:, j]
            step.old_mean = batch["means"][:, j] if "means" in batch else None
            step.advantages = self._advantages(batch)  # the last rewards were scored while the forward ran
            step.kl_gate = batch.get("kl_gate")
            loss, metrics = self._objective(model, step, first_pass)
            metrics["sde_window_start"] = float(batch["window"][0])
            losses.append(LossPart(loss, metrics))
        return losses

    def _replay_parts(self, model, batch: dict, picks: list[tuple[int, torch.Tensor | None]]
                      ) -> list[TrainedTransition]:
        """Recorded steps of the micro-batch replayed by the trained policy: for each ``(j, rows)`` of ``picks``, step
        ``j`` of the rows ``rows`` (None: all), its velocity at (x_j, t_j) and its transition to the recorded x_{j+1}
        (log-prob, mean, std), and, with ``beta > 0``, the reference's velocity there. The picks' rows go through one
        forward of the policy (and one of the reference) as one batch (`timestep_passes`); each transition is then
        computed from its own rows as alone."""
        args = self.args
        height, width = args.image_size

        def pick(key: str) -> list[torch.Tensor]:
            return [batch[key][:, j] if rows is None else batch[key][rows, j] for j, rows in picks]

        states, next_states = pick("latents"), pick("next_latents")
        timesteps, sigmas, sigmas_next = pick("timesteps"), pick("sigmas"), pick("sigmas_next")
        x, t = stack_rows(states), stack_rows(timesteps)
        embeds = stack_embeds(batch["embeds"], [rows for _, rows in picks])
        with self.accelerator.autocast():
            v = self.policy.velocity(model, x, t, embeds, args.guidance_scale, height, width)
        v_ref = None
        if args.beta > 0:
            with self.accelerator.autocast():
                v_ref = self.policy.reference_velocity(model, x, t, embeds, height, width)
        sizes = [len(state) for state in states]
        velocities = split_rows(v, sizes)
        references = split_rows(v_ref, sizes) if v_ref is not None else [None] * len(picks)
        sde = self.rollouts.sde_settings()
        out = []
        for i, (_, rows) in enumerate(picks):
            part_embeds = embeds if len(picks) == 1 else (
                batch["embeds"] if rows is None else batch["embeds"].index_select(rows))
            transition = sde_transition(velocities[i], states[i], sigmas[i], sigmas_next[i], sde,
                                        next_state=next_states[i])
            out.append(TrainedTransition(
                state=states[i], next_state=next_states[i], timestep=timesteps[i], sigma=sigmas[i],
                sigma_next=sigmas_next[i], embeds=part_embeds, velocity=velocities[i], log_prob=transition.log_prob,
                mean=transition.prev_sample_mean, std=transition.std, ref_velocity=references[i]))
        return out

    def _advantages(self, batch: dict) -> torch.Tensor:
        """The micro-batch's advantages, times the truncated importance weights of a stale generation replayed by the
        proximal policy (``truncated_importance_cap``, `flow_grpo_importance`)."""
        advantages = super()._advantages(batch)
        weights = batch.get("importance_weights")
        return advantages if weights is None else advantages * weights

    def _stale_generation_replay(self):
        """On the Ray backend, every stale generation is replayed by the proximal policy when it arrives: for the
        truncated importance weights (``truncated_importance_cap``) or Flow-DPPO's anchor (``policy_loss: dppo``);
        `flow_grpo_importance.stale_generation_replay`."""
        return stale_generation_replay(self.policy, self.rollouts, self.args)

    def _objective(self, model, step: TrainedTransition, first_pass: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """The mean over ``step``'s transitions of the policy objective (``policy_loss``: the clipped ratio, or
        Flow-DPPO's divergence trust region around the anchor ``step.old_mean``) plus ``beta`` x the KL estimate to
        the reference, with the values to log."""
        args = self.args
        height, width = args.image_size
        x, x_next, mean, std = step.state, step.next_state, step.mean, step.std
        v_ref = ref_mean = None
        if args.beta > 0:
            v_ref = step.ref_velocity
            if v_ref is None:  # not replayed with the policy's forward (`_replay_parts` gives it)
                with self.accelerator.autocast():
                    v_ref = self.policy.reference_velocity(model, x, step.timestep, step.embeds, height, width)
            if args.kl_estimator != "velocity":  # the reference's transition mean
                with torch.no_grad():
                    ref_mean = sde_transition(v_ref, x, step.sigma, step.sigma_next,
                                              self.rollouts.sde_settings()).prev_sample_mean
        metrics: dict[str, float] = {}
        if args.policy_loss == "dppo":
            if args.ratio_normalization == "grpo_guard":
                log_ratio = grpo_guard_log_ratio(mean, step.old_mean, x_next, std)
            else:
                log_ratio = step.log_prob - step.old_log_prob
            dppo = flow_dppo_loss(log_ratio, step.advantages, mean, step.old_mean, std, dppo_tau=args.dppo_tau)
            ratio, policy_loss, kl = dppo.ratio, dppo.loss, None
            loss = policy_loss
            if args.beta > 0:
                kl = gated_mean(kl_estimate(args.kl_estimator, mean, ref_mean, std, prev_sample=x_next,
                                            velocity=step.velocity, ref_velocity=v_ref), step.kl_gate)
                loss = loss + args.beta * kl
            metrics.update({"dppo/dropped_frac": float(dppo.dropped_frac), "dppo/outside_frac": float(dppo.outside_frac),
                            "dppo/divergence_mean": float(dppo.mean_divergence),
                            "dppo/divergence_max": float(dppo.max_divergence)})
        else:
            out = flow_grpo_loss(step.log_prob, step.old_log_prob, step.advantages, args.epsilon,
                                 ratio_normalization=args.ratio_normalization, mean=mean, old_mean=step.old_mean,
                                 prev_sample=x_next, std=std, beta=args.beta, kl_estimator=args.kl_estimator,
                                 ref_mean=ref_mean, velocity=step.velocity, ref_velocity=v_ref, kl_gate=step.kl_gate)
            ratio, log_ratio, policy_loss, kl, loss = out.ratio, out.log_ratio, out.policy_loss, out.kl, out.loss
            metrics["clip_frac"] = float(((ratio.detach() - 1).abs() > args.epsilon).float().mean())
        with torch.no_grad():
            log_ratio = log_ratio.detach()
            metrics.update({"policy_loss": float(policy_loss), "approx_kl": float(0.5 * (log_ratio**2).mean()),
                            "ratio_mean": float(ratio.detach().mean())})
            if kl is not None:
                metrics["kl"] = float(kl.detach())
            if first_pass:
                metrics["on_policy_ratio_max_dev"] = self._check_on_policy(ratio.detach())
        return loss, metrics

    def _tree_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """Parts ``parts`` of a BranchGRPO micro-batch, replayed in one forward: each the edges trained at one SDE
        step, each edge at its parent state with its child's advantage and its split-aware log-prob, weighted so
        that the parts sum to the mean over the micro-batch's trained edges."""
        args = self.args
        tree, edges = batch["tree_parts"], batch["tree_edges"]
        picks, weights = [], []
        for part in parts:
            if not tree:  # nothing to train here (pruned): a zero loss that still reaches every trained weight
                step_index, rows, weight = batch["latents"].shape[1] - 1, torch.zeros(1, dtype=torch.long), 0.0
            else:
                step_index = tree[part]
                rows = batch["edge_trained"][:, step_index].nonzero().flatten()
                weight = len(rows) * len(tree) / edges
            picks.append((step_index, rows.to(batch["latents"].device)))
            weights.append(weight)
        losses = []
        for (step_index, rows), weight, step in zip(picks, weights, self._replay_parts(model, batch, picks)):
            split = bool(batch["tree_split"][step_index])
            step.log_prob = edge_log_prob(step.next_state, step.mean, step.std, split, args.branch_noise_scale,
                                          split_log_prob=args.branch_split_log_prob)
            step.std = tree_step_std(batch, rows, step_index, step.std, args)
            step.old_log_prob = batch["log_probs"][rows, step_index]
            step.old_mean = batch["means"][rows, step_index]
            step.advantages = batch["edge_advantages"][rows, step_index]
            loss, metrics = self._objective(model, step, first_pass and bool(tree))
            metrics.update({"sde_window_start": 0.0, "branch/trained_edges": float(edges)})
            losses.append(LossPart(loss * weight, metrics))
        return losses

    def _tempflow_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """Parts ``parts`` of a TempFlow-GRPO micro-batch, replayed in one forward: each the children that branch at
        one step, each replayed from its trunk state with its sibling advantage weighted by
        ``tempflow_noise_weight`` x the step's std (`tempflow`), weighted so that the parts sum to the mean over the
        micro-batch's children."""
        args = self.args
        device = batch["latents"].device
        branch_steps = [batch["tempflow_parts"][part] for part in parts]
        picks = [(0, (batch["tempflow_step"] == branch_step).nonzero().flatten().to(device))
                 for branch_step in branch_steps]
        advantages = self._advantages(batch)
        losses = []
        for branch_step, (_, rows), step in zip(branch_steps, picks, self._replay_parts(model, batch, picks)):
            step.old_log_prob = batch["log_probs"][rows, 0]
            step.old_mean = batch["means"][rows, 0] if "means" in batch else None
            step.advantages = weighted_advantages(advantages[rows], step.std, args.tempflow_noise_weight)
            step.kl_gate = batch["kl_gate"][rows] if batch.get("kl_gate") is not None else None
            loss, metrics = self._objective(model, step, first_pass)
            metrics.update({"sde_window_start": float(branch_step),
                            "tempflow/weight": float(args.tempflow_noise_weight * step.std.detach().mean())})
            weight = len(rows) * len(batch["tempflow_parts"]) / batch["latents"].shape[0]
            losses.append(LossPart(loss * weight, metrics))
        return losses

    def _check_on_policy(self, ratio: torch.Tensor) -> float:
        """max |ratio - 1| of a first pass, with one warning when it exceeds ``on_policy_tolerance``."""
        drift = float((ratio - 1).abs().max())
        if drift > self.args.on_policy_tolerance and not self._warned_off_policy:
            self._warned_off_policy = True
            warnings.warn(
                f"On the first pass over a fresh batch the likelihood ratio should be exactly 1, but max |ratio - 1| = "
                f"{drift:.3g} > on_policy_tolerance={self.args.on_policy_tolerance}. Likely causes: dropout (e.g. "
                "lora_dropout > 0), a different dtype/autocast between sampling and training, micro-batches whose "
                "composition differs from sampling, or non-deterministic kernels.", stacklevel=3,
            )
        return drift

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        return [
            f"- algorithm: {self._name} ({args.sde_type}, noise level {args.noise_level}, "
            f"{'window ' + str(args.sde_window_size) if args.sde_window_size else 'all steps'})"
            + (f"; TempFlow-GRPO: {args.tempflow_children} children at branch steps {args.tempflow_branch_steps}, "
               f"loss weight {args.tempflow_noise_weight:g} x std" if args.uses_tempflow else ""),
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale}, {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- beta (KL) {args.beta}, clip range {args.epsilon}, learning rate {args.learning_rate}",
            f"- SDE window: sde_window_strategy={args.sde_window_strategy}, sde_window_range={args.sde_window_range}, "
            f"sde_window_shift_interval={args.sde_window_shift_interval}, sde_window_stride={args.sde_window_stride}, "
            f"sde_window_roll_back={args.sde_window_roll_back}",
            f"- deterministic steps: ode_solver={args.ode_solver}, ode_compression_ratio={args.ode_compression_ratio:g}",
            f"- objective: ratio_normalization={args.ratio_normalization}, kl_estimator={args.kl_estimator}, "
            f"reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}, "
            f"same_noise_per_group={args.same_noise_per_group}, timestep_fraction={args.timestep_fraction:g}",
        ]
