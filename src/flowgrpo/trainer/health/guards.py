"""`HealthGuards`: the trainer's observer of reward hacking and collapse, with explicit hooks.

What it does, and when the trainer calls it:

* before anything is loaded, `check_health_setup` (GARDO's auxiliary rewards, the base-model tail against the SDE
  window, dynamic sampling's group shares); `resolve_gold_rewards` builds the gold evaluation rewards;
* `callbacks`: transformers' ``EarlyStoppingCallback`` and the reference refresh (``sync_ref_model``);
* `on_generation_start`: GARDO's reference reset before a generation;
* `on_generation`: dynamic sampling (``filter_zero_std_groups``): groups without signal are replaced by fresh ones,
  sampled through the rollout engine's public methods, and the merged generation is scored;
* `on_scores` (the rollout engine's hook on every scored rollout): the diagnostics ``health/...`` and, with GARDO, the
  KL gate and diversity-aware advantages; returns the advantages the loss uses;
* `on_step_end` (after each optimizer step): the update ratio, the KL to the reference every ``health_kl_steps``,
  GARDO's KL watch, the hacking alarm's state;
* `on_evaluate` (after each evaluation): the dual step of the evaluation-sourced reward constraints
  (``constraints.py``; the rollout engine takes the rollout-sourced ones and forms the constrained advantages), then
  the hacking alarm on the gold rewards; with ``on_hacking: stop`` it asks the trainer to save and stop;
* `save` / `load`: the run-long state (`monitor.HealthMonitor`) in every checkpoint; `card_lines`: the model card's
  best evaluation.

It reads the policy (the reference, the trained weights) and the rollout engine's public methods; it never writes
another part's state.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ...rewards import RewardResult, RewardSet, resolve_reward_funcs
from ...schedulers import sde_transition
from ...schedulers.flow_matching import noised_sample
from ..collectives import any_process, max_over_processes
from ..rollout.generation import Generation
from ..seeds import seed_for
from ..step_metrics import StepMetrics
from . import metrics as hm
from .dynamic_sampling import (
    concat_records,
    fresh_prompt_indices,
    groups_without_signal,
    replacement_group_id,
    select_rows,
    split_rows,
)
from .gardo import diversity_aware_advantages, reward_uncertainty, uncertainty_gate
from .monitor import HealthMonitor

logger = logging.get_logger(__name__)

__all__ = ["HealthGuards", "HackingDecision", "check_health_setup", "needs_reference_copy", "resolve_gold_rewards"]

#: samples of the last rollout used by the KL-to-reference probe
KL_PROBE_SAMPLES = 4


def resolve_gold_rewards(args: Any, training: RewardSet) -> RewardSet | None:
    """The gold evaluation rewards of ``args.eval_reward_funcs`` (None without any); names must differ from the
    training rewards' (they are logged under the same ``eval_rewards/<name>/...`` keys)."""
    if not args.eval_reward_funcs:
        return None
    gold = resolve_reward_funcs(list(args.eval_reward_funcs), args.eval_reward_weights, args.eval_reward_kwargs,
                                num_workers=1, on_failure="skip")
    clash = sorted(set(gold.names) & set(training.names))
    if clash:
        raise ValueError(f"eval_reward_funcs {clash} are also training rewards (reward_funcs); a gold reward must "
                         "never be trained on: remove them from one of the two lists.")
    if args.regularizer == "gardo":
        missing = [n for n in args.gardo_auxiliary_rewards if n not in training.names]
        if missing:
            raise ValueError(f"gardo_auxiliary_rewards {missing} are not among reward_funcs {training.names}; add them "
                             "there with weight 0.")
    return gold


def needs_reference_copy(args: Any) -> bool:
    """Full fine-tuning keeps a frozen copy of the transformer as reference when the training uses the reference. The
    ``health/kl_to_reference`` diagnostic alone does not: a second full-size transformer would double the weights'
    memory for a log line (with LoRA the diagnostic is free: the base is the adapter switched off)."""
    return bool(args.beta > 0 or args.sync_ref_model or args.base_model_tail_steps > 0 or args.regularizer == "gardo")


def check_health_setup(args: Any, reward_names: list[str], algorithm: Any = None) -> None:
    """The checks that need the rewards but nothing loaded (``algorithm``: the run's `AlgorithmFacts`, whose record
    says which sampling steps a rollout may train)."""
    if args.regularizer == "gardo":
        missing = [n for n in args.gardo_auxiliary_rewards if n not in reward_names]
        if missing:
            raise ValueError(f"gardo_auxiliary_rewards {missing} are not among reward_funcs {reward_names}; add them "
                             "there with weight 0.")
    tail = args.base_model_tail_steps
    last_trained = algorithm.record.last_step if algorithm is not None else None
    if tail and last_trained is not None:
        steps = args.num_inference_steps
        if tail > steps - 1 - last_trained:
            raise ValueError(f"base_model_tail_steps={tail} reaches the trained SDE window (a rollout may record "
                             f"and train step {last_trained} of {steps}); use at most {steps - 1 - last_trained} or "
                             "move the window earlier (sde_window_range / sde_window_size).")
    if args.filter_zero_std_groups:
        share = args.per_device_train_batch_size * args.steps_per_generation
        if share % args.num_generations:
            raise ValueError(f"filter_zero_std_groups replaces whole groups on each process, but a process's "
                             f"share of a generation ({share} images = per_device_train_batch_size x "
                             f"steps_per_generation) is not a multiple of num_generations={args.num_generations}; "
                             "make it one.")


@dataclass
class HackingDecision:
    """What `HealthGuards.on_evaluate` asks of the trainer: ``stop`` (save this step and end training)."""

    stop: bool = False


class HealthGuards:
    """See the module docstring.

    Args:
        args: the trainer's configuration (the fields of `arguments.HealthArguments` and the rollout settings).
        rewards: the training rewards; ``gold_rewards``: the gold evaluation rewards or None.
        policy: the `Policy` (the reference, the trained weights, velocities).
        accelerator: gathers and reductions over processes.
        metrics: where logged values go.
        algorithm: the run's `AlgorithmFacts` (``flowgrpo.trainer.algorithm_spec``): where the KL probe starts.
    """

    def __init__(self, args: Any, rewards: RewardSet, gold_rewards: RewardSet | None, policy: Any, accelerator: Any,
                 metrics: StepMetrics, algorithm: Any):
        self.args = args
        #: the run's `AlgorithmFacts` (the KL probe's state and step)
        self.algorithm = algorithm
        self.rewards = rewards
        self.gold_rewards = gold_rewards
        self.policy = policy
        self.accelerator = accelerator
        self.metrics = metrics
        funcs = list(rewards.funcs) + (list(gold_rewards.funcs) if gold_rewards else [])
        #: the run-long state (alarms, GARDO's schedules, dynamic sampling's totals), saved in every checkpoint
        self.monitor = HealthMonitor(args, funcs)
        #: the reward constraints' multipliers (``reward_constraints``; None without any), saved with the monitor
        self.constraints = self.monitor.constraints
        self.stopped_by_hacking_alarm = False
        self._base_norms: dict = {}
        self._kl_seen = 0
        self._warned_diversity = False

    def callbacks(self) -> list:
        """The callbacks the trainer adds: early stopping, and the reference refresh (``sync_ref_model``)."""
        from transformers import EarlyStoppingCallback

        from ..policy.reference import ReferenceSyncCallback

        args = self.args
        out = []
        if args.early_stopping_patience:
            out.append(EarlyStoppingCallback(args.early_stopping_patience, args.early_stopping_threshold))
        if args.sync_ref_model:
            out.append(ReferenceSyncCallback(self.policy.reference))
        return out

    # ------------------------------------------------------------------------------------------------
    # generations: GARDO's resets, dynamic sampling
    # ------------------------------------------------------------------------------------------------
    def on_generation_start(self, gen_index: int) -> None:
        """GARDO: reset the reference to the current policy when its schedule says so."""
        if self.args.regularizer == "gardo" and self.monitor.reset_schedule.should_reset(gen_index):
            self.policy.reference.refresh(1.0)
            self.metrics.train["gardo/reference_reset"].append(1.0)

    def on_generation(self, generation: Generation, rollouts: Any, dataset: Any, gen_index: int) -> Generation | None:
        """Dynamic sampling (``filter_zero_std_groups``, see `dynamic_sampling`) on this process's share: returns the
        generation with its groups without signal replaced, already scored; None when dynamic sampling is off (the
        trainer then scores the generation as usual)."""
        if not self.args.filter_zero_std_groups:
            return None
        return self._refill_groups_without_signal(generation, rollouts, dataset, gen_index)

    def _refill_groups_without_signal(self, generation: Generation, rollouts: Any, dataset: Any,
                                      gen_index: int) -> Generation:
        args = self.args
        failed = False
        try:
            images, results, _ = generation.local_results()
        except Exception:  # a reward failure: the normal path raises it on every process, after saving
            failed = True
        if self._any_process(failed):
            rollouts.score(generation)  # raises RewardFailedError everywhere
        prompts, group_ids, timing = generation.prompts, generation.group_ids, generation.timing
        result = RewardResult.concatenate(results)
        flat_images = [im for chunk in images for im in chunk]
        totals = torch.tensor([math.nan if v is None else float(v) for v in result.total])
        dropped = groups_without_signal(totals, group_ids)
        parts, part_prompts, part_images, part_results = [concat_records(generation.records)], [list(prompts)], \
            [flat_images], [result]
        part_groups = [group_ids.clone()]
        replacements: dict[int, int] = {}  # dropped group id -> replacement group id
        rank = self.accelerator.process_index
        rounds = 0
        found = 0
        while rounds < args.max_resample_rounds:
            need = len(dropped) - len(replacements)
            need_max = self._max_over_processes(need)
            if need_max == 0:
                break
            rounds += 1
            picks = fresh_prompt_indices(len(dataset), need_max, seed_for(args.seed, 15485863, gen_index, rounds,
                                                                           rank))
            rows = [dataset[i] for i in picks for _ in range(args.num_generations)]
            new_generation = rollouts.generate(rows, gen_index, generation.step)
            try:
                new_images, new_results, new_seconds = new_generation.local_results()
                failed = False
            except Exception:
                failed = True
            if self._any_process(failed):
                rollouts.score(new_generation)
            timing["vae_decode"] += sum(new_seconds)
            new_result = RewardResult.concatenate(new_results)
            new_ids = torch.tensor([replacement_group_id(rank, found + k // args.num_generations)
                                    for k in range(len(rows))])
            found += need_max
            new_totals = torch.tensor([math.nan if v is None else float(v) for v in new_result.total])
            silent = set(groups_without_signal(new_totals, new_ids))
            open_slots = [g for g in dropped if g not in replacements]
            for gid in dict.fromkeys(new_ids.tolist()):
                if gid in silent or not open_slots:
                    continue
                replacements[open_slots.pop(0)] = gid
            parts.append(concat_records(new_generation.records))
            part_prompts.append([r["prompt"] for r in rows])
            part_images.append([im for chunk in new_images for im in chunk])
            part_results.append(new_result)
            part_groups.append(new_ids)
        m = self.metrics.train
        m["health/dropped_groups"].append(float(len(replacements)))
        m["health/zero_std_groups_kept"].append(float(len(dropped) - len(replacements)))
        m["health/resample_rounds"].append(float(rounds))
        self.monitor.dropped_groups_total += len(replacements)
        if dropped:
            first_prompt = {g: prompts[group_ids.tolist().index(g)] for g in dropped}
            logger.info(f"Dynamic sampling, step {generation.step + 1}: {len(dropped)} group(s) without signal "
                        f"({', '.join(repr(first_prompt[g][:40]) for g in dropped)}); {len(replacements)} replaced "
                        f"by fresh prompts in {rounds} round(s), {len(dropped) - len(replacements)} kept.")

        # The batch: every original position, a dropped group's rows taken from its replacement.
        all_groups = torch.cat(part_groups)
        all_prompts = [p for part in part_prompts for p in part]
        all_images = [im for part in part_images for im in part]
        merged_result = RewardResult.concatenate(part_results)
        index = []
        for position, gid in enumerate(group_ids.tolist()):
            if gid in replacements:
                rows_of = torch.nonzero(all_groups == replacements[gid]).flatten().tolist()
                member = sum(1 for g in group_ids.tolist()[:position] if g == gid)
                index.append(rows_of[member])
            else:
                index.append(position)
        index_t = torch.tensor(index, dtype=torch.long)
        micro = args.per_device_train_batch_size
        merged = select_rows(concat_records(parts), index_t)
        picked = RewardResult(
            per_reward={n: [v[i] for i in index] for n, v in merged_result.per_reward.items()},
            total=[merged_result.total[i] for i in index], weights=dict(merged_result.weights),
            failed=dict(merged_result.failed))
        refilled = Generation.already_scored(
            records=split_rows(merged, micro), images=[all_images[i] for i in index], result=picked,
            chunks=[slice(s, s + micro) for s in range(0, len(index), micro)],
            prompts=[all_prompts[i] for i in index], group_ids=all_groups[index_t], timing=timing,
            step=generation.step)
        rollouts.score(refilled)
        return refilled

    def _any_process(self, flag: bool) -> bool:
        """Logical OR of ``flag`` over all processes."""
        return any_process(self.accelerator, flag)

    def _max_over_processes(self, value: int) -> int:
        """The largest ``value`` over all processes (every process then runs the same number of rollouts)."""
        return max_over_processes(self.accelerator, value)

    # ------------------------------------------------------------------------------------------------
    # every scored rollout: diagnostics and GARDO
    # ------------------------------------------------------------------------------------------------
    def on_scores(self, advantages: torch.Tensor, totals: torch.Tensor, per_reward: dict, group_ids: torch.Tensor,
                  local_images: list, reward_mean: float, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log the rollout's diagnostics; with GARDO shape the advantages and gate the KL. Takes and returns gathered
        tensors: the advantages and the KL gate (None without GARDO). ``step``: optimizer steps done."""
        args = self.args
        m = self.metrics.train
        m["health/zero_std_groups"].append(hm.zero_std_group_fraction(totals, group_ids))
        if len(per_reward) > 1:
            for pair, r in hm.reward_correlations(per_reward).items():
                m[f"health/reward_correlation/{pair}"].append(r)
        local = self.monitor.image_features(local_images).to(self.accelerator.device)
        features = self.accelerator.gather(local).cpu() if self.accelerator.num_processes > 1 else local.cpu()
        diversity = hm.within_group_diversity(features, group_ids)
        m[f"health/diversity/{self.monitor.feature_name}"].append(diversity)
        if self.monitor.diversity.update(diversity):
            m["health/diversity_alarm"].append(1.0)
            if not self._warned_diversity:
                self._warned_diversity = True
                logger.warning(f"Diversity alarm: the within-group diversity ({self.monitor.feature_name}) fell below "
                               f"diversity_collapse_ratio={args.diversity_collapse_ratio} of its first value "
                               f"({self.monitor.diversity.first:.4g}); the groups are collapsing onto one image.")
        else:
            m["health/diversity_alarm"].append(0.0)
        self.monitor.hacking.observe_train_reward(step + 1, reward_mean)
        gate = None
        if args.regularizer == "gardo":
            aux = [per_reward[n] for n in args.gardo_auxiliary_rewards]
            uncertainty = reward_uncertainty(totals, aux)
            fraction = self.monitor.gate_fraction.update(uncertainty)
            gate = uncertainty_gate(uncertainty, fraction)
            m["gardo/gate_fraction"].append(fraction)
            m["gardo/gated"].append(float(gate.float().mean()))
            if args.gardo_diversity:
                shaped, factor = diversity_aware_advantages(advantages, totals, features, group_ids)
                advantages = shaped.to(advantages.dtype).clamp(-args.adv_clip_max, args.adv_clip_max)
                m["gardo/diversity_factor"].append(float(factor.mean()))
        return advantages, gate

    # ------------------------------------------------------------------------------------------------
    # after each optimizer step
    # ------------------------------------------------------------------------------------------------
    def on_step_end(self, step: int, batch: dict | None, rollouts: Any) -> None:
        """The update ratio, the KL to the reference every ``health_kl_steps`` (on a few samples of ``batch``, the
        current generation's first micro-batch), GARDO's KL watch and the hacking alarm's state."""
        args = self.args
        m = self.metrics.train
        policy = self.policy
        unwrapped = policy.unwrapped
        kl_due = policy.reference is not None and args.health_kl_steps and step % args.health_kl_steps == 0
        if policy.is_peft:
            m["health/lora_update_ratio"].append(hm.lora_update_ratio(unwrapped, base_norms=self._base_norms))
        elif kl_due:
            trained = [p for p in unwrapped.parameters() if p.requires_grad]
            ref = dict(policy.reference.copy.named_parameters())
            names = [n for n, p in unwrapped.named_parameters() if p.requires_grad]
            m["health/weight_update_ratio"].append(hm.weight_update_ratio(trained, [ref[n] for n in names]))
        if kl_due and batch:
            m["health/kl_to_reference"].append(self._kl_to_reference(batch, rollouts))
        kls = m.get("kl", [])
        if len(kls) < self._kl_seen:
            self._kl_seen = 0
        if args.regularizer == "gardo" and len(kls) > self._kl_seen:
            new = kls[self._kl_seen:]
            self.monitor.reset_schedule.observe_kl(sum(new) / len(new))
        self._kl_seen = len(kls)
        m["health/hacking_alarm"].append(float(self.monitor.hacking_alarm_on))

    @torch.no_grad()
    def _kl_to_reference(self, batch: dict, rollouts: Any) -> float:
        """The analytic KL of one SDE step between the policy and the reference on a few samples of ``batch``, from
        the state the algorithm's probe names (`AlgorithmFacts.probe`)."""
        args = self.args
        policy = self.policy
        probe = self.algorithm.probe
        height, width = args.image_size
        n = min(KL_PROBE_SAMPLES, len(batch["embeds"]))
        embeds = batch["embeds"][:n]
        if probe.source == "recorded_transition":  # the first recorded transition
            x, t = batch["latents"][:n, 0], batch["timesteps"][:n, 0]
            sigma, sigma_next = batch["sigmas"][:n, 0], batch["sigmas_next"][:n, 0]
        else:  # the final latent noised to a middle level of the rollout
            levels = batch["sigmas"].shape[1]
            k = levels // 2
            x0 = batch["x0"][:n]
            gen = torch.Generator().manual_seed(int(args.seed) + 7)
            noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(x0.device)
            sigma = batch["sigmas"][:n, k]
            sigma_next = batch["sigmas"][:n, k + 1] if k + 1 < levels else torch.zeros_like(sigma)
            t = batch["timesteps"][:n, k]
            x = noised_sample(x0, noise, sigma)
        with policy.generation_context() as model:
            v = policy.velocity(model, x, t, embeds, args.guidance_scale, height, width)
            v_ref = policy.reference_velocity(model, x, t, embeds, height, width)
        sde = rollouts.sde_settings(noise_level=probe.noise_level, sde_type=probe.sde_type)
        out = sde_transition(v, x, sigma, sigma_next, sde)
        ref = sde_transition(v_ref, x, sigma, sigma_next, sde)
        return hm.kl_between_transitions(out.prev_sample_mean, ref.prev_sample_mean, out.std)

    # ------------------------------------------------------------------------------------------------
    # after each evaluation: the hacking alarm
    # ------------------------------------------------------------------------------------------------
    def on_evaluate(self, metrics: dict[str, float], prefix: str, step: int, best_checkpoint: str | None = None,
                    best_metric: float | None = None) -> HackingDecision:
        """The hacking alarm on this evaluation's gold means (adds ``health/hacking_alarm`` to ``metrics``); with
        ``on_hacking: stop`` and a fired alarm after step 0, asks the trainer to save and stop. Before that, the
        evaluation-sourced reward constraints take their dual step (the periodic evaluation, prefix ``eval``) and
        their ``constraint/<name>/...`` values are added to ``metrics``."""
        if self.constraints is not None and prefix == "eval":
            self.constraints.observe_evaluation(metrics, prefix, step)
            metrics.update(self.constraints.metrics())
        if self.gold_rewards is None:
            return HackingDecision()
        args = self.args
        gold = {n: metrics.get(f"{prefix}_rewards/{n}/mean", math.nan) for n in self.gold_rewards.names}
        verdict = self.monitor.hacking.update(step, gold)
        self.monitor.hacking_alarm_on = verdict.fired
        metrics["health/hacking_alarm"] = float(verdict.fired)
        if not verdict.fired:
            return HackingDecision()
        message = verdict.message(args.hacking_tolerance)
        if args.on_hacking == "stop" and step > 0:
            self.stopped_by_hacking_alarm = True
            logger.warning(f"{message} on_hacking='stop': saving this step and ending training"
                           + (f"; the best checkpoint so far is {best_checkpoint} ({args.metric_for_best_model}="
                              f"{best_metric})." if best_checkpoint else "."))
            return HackingDecision(stop=True)
        warnings.warn(message + " (on_hacking='warn'; set on_hacking: stop to end the run here.)", stacklevel=2)
        return HackingDecision()

    # ------------------------------------------------------------------------------------------------
    # checkpoints and the model card
    # ------------------------------------------------------------------------------------------------
    def save(self, folder: str) -> None:
        self.monitor.save(folder)

    def load(self, folder: str) -> None:
        self.monitor.load(folder)

    def card_lines(self, state: Any) -> list[str]:
        """The model card's "Best evaluation" section (empty without ``metric_for_best_model``)."""
        args = self.args
        if state.best_metric is None or not args.metric_for_best_model:
            return []
        step = state.best_global_step
        loaded = args.load_best_model_at_end and state.best_model_checkpoint
        lines = ["", "## Best evaluation", "",
                 f"- {args.metric_for_best_model} = {state.best_metric:.4f} at step {step}"
                 + (f" ({state.best_model_checkpoint})" if state.best_model_checkpoint else ""),
                 "- these weights are " + (f"those of step {step} (load_best_model_at_end)" if loaded else
                                           f"those of the last step, {state.global_step}")]
        if self.gold_rewards is not None:
            lines.append(f"- gold evaluation rewards (never trained on): {', '.join(self.gold_rewards.names)}")
        if self.stopped_by_hacking_alarm:
            lines.append(f"- training was stopped by the hacking alarm at step {state.global_step}")
        return lines
