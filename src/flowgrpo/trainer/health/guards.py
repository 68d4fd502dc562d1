"""HealthGuards: the trainer side of the health features (composed into `OnlineRLTrainer`).

* gold rewards at evaluation (``eval_reward_funcs``), the hacking alarm after each evaluation and ``on_hacking``;
* early stopping (transformers' ``EarlyStoppingCallback``) and the best model's export (``load_best_model_at_end``
  restores the best checkpoint's weights and EMA before the final save, the model card names its step);
* the diagnostics of every rollout (``health/...``), the KL to the reference every ``health_kl_steps`` and the
  update ratio every step;
* dynamic sampling (``filter_zero_std_groups``), the reference policy and its refresh (``sync_ref_model``), GARDO
  (``regularizer: gardo``) and the base-model tail (``base_model_tail_steps``);
* the run-long state of all of it in every checkpoint (`monitor.HealthMonitor`, the reference's weights).

What the class using it provides: the rollout pipeline (``_generate_and_score``, ``_pending_scoring``, ``_velocity``),
``reward_set``, ``args``, ``accelerator``, ``model``, ``is_peft``, ``ref_model``, ``_metrics``, ``state`` /
``control`` and the crash-safety mixin's ``_any_process``.
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from transformers.utils import logging

from ...rewards import RewardResult, RewardSet, resolve_reward_funcs
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
from .reference import REFERENCE_ADAPTER, ReferencePolicy, ReferenceSyncCallback

logger = logging.get_logger(__name__)

__all__ = ["HealthGuards", "needs_reference_copy", "resolve_gold_rewards"]

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


class HealthGuards:
    """See the module docstring."""

    gold_reward_set: RewardSet | None = None
    health: HealthMonitor | None = None
    reference: ReferencePolicy | None = None
    stopped_by_hacking_alarm = False
    _tail_steps_active = 0
    _in_checkpoint = False
    _kl_seen = 0
    _base_norms: dict | None = None

    # ------------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------------
    def _check_health_setup(self, args: Any) -> None:
        """Cheap checks before any model is loaded."""
        if args.regularizer == "gardo":
            missing = [n for n in args.gardo_auxiliary_rewards if n not in self.reward_set.names]
            if missing:
                raise ValueError(f"gardo_auxiliary_rewards {missing} are not among reward_funcs "
                                 f"{self.reward_set.names}; add them there with weight 0.")
        tail = args.base_model_tail_steps
        size = getattr(args, "sde_window_size", None)
        if tail and size is not None and getattr(args, "ode_compression_ratio", 1.0) == 1.0:
            steps = args.num_inference_steps
            last_trained = steps - 2 if size == 0 else args.sde_window_range[1] + size - 2
            if tail > steps - 1 - last_trained:
                raise ValueError(f"base_model_tail_steps={tail} reaches the trained SDE window (its last step can be "
                                 f"step {last_trained} of {steps}: sde_window_size={size}, sde_window_range="
                                 f"{args.sde_window_range}); use at most {steps - 1 - last_trained} or move the "
                                 "window earlier.")
        if args.filter_zero_std_groups:
            share = args.per_device_train_batch_size * args.steps_per_generation
            if share % args.num_generations:
                raise ValueError(f"filter_zero_std_groups replaces whole groups on each process, but a process's "
                                 f"share of a generation ({share} images = per_device_train_batch_size x "
                                 f"steps_per_generation) is not a multiple of num_generations={args.num_generations}; "
                                 "make it one.")

    def _setup_health(self) -> None:
        """After the model is built and on its device."""
        from transformers import EarlyStoppingCallback

        args = self.args
        funcs = list(self.reward_set.funcs) + (list(self.gold_reward_set.funcs) if self.gold_reward_set else [])
        self.health = HealthMonitor(args, funcs)
        unwrapped = self.accelerator.unwrap_model(self.model)
        own_adapter = bool(self.is_peft and (args.sync_ref_model or args.regularizer == "gardo"))
        if self.is_peft or self.ref_model is not None:
            self.reference = ReferencePolicy(unwrapped, self.is_peft, own_adapter=own_adapter,
                                             frozen_copy=self.ref_model)
        if args.early_stopping_patience:
            self.add_callback(EarlyStoppingCallback(args.early_stopping_patience, args.early_stopping_threshold))
        if args.sync_ref_model:
            self.add_callback(ReferenceSyncCallback(self.reference))
        self._base_norms = {}

    # ------------------------------------------------------------------------------------------------
    # the reference policy
    # ------------------------------------------------------------------------------------------------
    @contextmanager
    def _reference_model(self, model):
        """The module whose forward is the reference (see `reference.ReferencePolicy`)."""
        with self.reference.forward_model(model, unwrap=self.accelerator.unwrap_model) as ref:
            yield ref

    def _reference_velocity(self, model, x, t, embeds, height, width):
        """Velocity under the reference policy (the base with LoRA disabled, the ``ref`` adapter, or the copy)."""
        with torch.no_grad(), self._reference_model(model) as ref:
            return self._velocity(ref, x, t, embeds, self.args.guidance_scale, height, width)

    def _tail_velocity(self, model, step_index: int, plan_length: int, stochastic_recorded: bool, latents, t, embeds,
                       guidance_scale, height, width):
        """The velocity of step ``step_index`` of a rollout: the reference's on the last ``base_model_tail_steps``
        steps of a training rollout, else None (the caller uses the policy)."""
        tail = self._tail_steps_active
        if not tail or step_index < plan_length - tail:
            return None
        if stochastic_recorded:
            raise ValueError(f"base_model_tail_steps={tail} reaches a trained (recorded SDE) step of the rollout; the "
                             "reference's steps must come after the trained window: lower base_model_tail_steps or "
                             "move the SDE window earlier (sde_window_range / sde_window_size).")
        with self._reference_model(model) as ref:
            return self._velocity(ref, latents, t, embeds, guidance_scale, height, width)

    # ------------------------------------------------------------------------------------------------
    # rollouts: GARDO resets, base-model tail, dynamic sampling
    # ------------------------------------------------------------------------------------------------
    def _generate_and_score(self, inputs: list[dict]) -> list[dict]:
        args = self.args
        gen_index = self._generation_index()
        if args.regularizer == "gardo" and self.health.reset_schedule.should_reset(gen_index):
            self.reference.refresh(1.0)
            self._metrics["train"]["gardo/reference_reset"].append(1.0)
        self._tail_steps_active = args.base_model_tail_steps
        overlap = self._overlap_reward_with_training
        if args.filter_zero_std_groups:
            self._overlap_reward_with_training = True  # the refill needs the rewards before they are gathered
        try:
            samples = super()._generate_and_score(inputs)
            if args.filter_zero_std_groups:
                samples = self._refill_groups_without_signal(samples)
        finally:
            self._tail_steps_active = 0
            self._overlap_reward_with_training = overlap
        return samples

    @staticmethod
    def _local_results(pending: tuple) -> tuple[list, list[RewardResult], list[float]]:
        """Wait for the pending rollout's decoding and local rewards (no gather); returns images, results, seconds."""
        images, results, seconds = [], [], []
        for job in pending[0]:
            pil, future, decode_seconds = job.result()
            images.append(pil)
            results.append(future.result())
            seconds.append(decode_seconds)
        return images, results, seconds

    def _refill_groups_without_signal(self, samples: list[dict]) -> list[dict]:
        """DAPO's dynamic sampling on this process's share (see `dynamic_sampling`); scores synchronously."""
        args = self.args
        pending = self._pending_scoring
        jobs, _, chunks, prompts, group_ids, timing = pending
        failed = False
        try:
            images, results, seconds = self._local_results(pending)
        except Exception:  # a reward failure: the normal path raises it on every process, after saving
            failed = True
        if self._any_process(failed):
            self._resolve_scoring()  # raises RewardFailedError everywhere
        result = RewardResult.concatenate(results)
        flat_images = [im for chunk in images for im in chunk]
        totals = torch.tensor([math.nan if v is None else float(v) for v in result.total])
        dropped = groups_without_signal(totals, group_ids)
        parts, part_prompts, part_images, part_results = [concat_records(samples)], [list(prompts)], \
            [flat_images], [result]
        part_groups = [group_ids.clone()]
        replacements: dict[int, int] = {}  # dropped group id -> replacement group id
        rank = self.accelerator.process_index
        dataset = self.train_dataset
        gen_index = self._generation_index()
        rounds = 0
        found = 0
        while rounds < args.max_resample_rounds:
            need = len(dropped) - len(replacements)
            need_max = self._max_over_processes(need)
            if need_max == 0:
                break
            rounds += 1
            from ..rollout.pipeline import _seed_for

            picks = fresh_prompt_indices(len(dataset), need_max, _seed_for(args.seed, 15485863, gen_index, rounds,
                                                                            rank))
            rows = [dataset[i] for i in picks for _ in range(args.num_generations)]
            new_samples = super()._generate_and_score(rows)
            new_pending = self._pending_scoring
            try:
                new_images, new_results, new_seconds = self._local_results(new_pending)
                failed = False
            except Exception:
                failed = True
            if self._any_process(failed):
                self._resolve_scoring()
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
            parts.append(concat_records(new_samples))
            part_prompts.append([r["prompt"] for r in rows])
            part_images.append([im for chunk in new_images for im in chunk])
            part_results.append(new_result)
            part_groups.append(new_ids)
        self._pending_scoring = None
        m = self._metrics["train"]
        m["health/dropped_groups"].append(float(len(replacements)))
        m["health/zero_std_groups_kept"].append(float(len(dropped) - len(replacements)))
        m["health/resample_rounds"].append(float(rounds))
        self.health.dropped_groups_total += len(replacements)
        if dropped:
            first_prompt = {g: prompts[group_ids.tolist().index(g)] for g in dropped}
            logger.info(f"Dynamic sampling, step {self.state.global_step + 1}: {len(dropped)} group(s) without signal "
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
        merged = select_rows(concat_records(parts), index_t)
        new_chunks = [slice(s, s + args.per_device_train_batch_size)
                      for s in range(0, len(index), args.per_device_train_batch_size)]
        new_samples_all = split_rows(merged, args.per_device_train_batch_size)
        picked = RewardResult(
            per_reward={n: [v[i] for i in index] for n, v in merged_result.per_reward.items()},
            total=[merged_result.total[i] for i in index], weights=dict(merged_result.weights),
            failed=dict(merged_result.failed))
        picked_images = [all_images[i] for i in index]
        future: Future = Future()
        future.set_result(picked)
        job: Future = Future()
        job.set_result((picked_images, future, 0.0))
        self._pending_scoring = ([job], new_samples_all, new_chunks, [all_prompts[i] for i in index],
                                 all_groups[index_t], timing)
        self._resolve_scoring()
        return new_samples_all

    def _max_over_processes(self, value: int) -> int:
        """The largest ``value`` over all processes (every process then runs the same number of rollouts)."""
        t = torch.tensor(int(value), dtype=torch.int64)
        if self.accelerator.num_processes > 1 and torch.distributed.is_available() and \
                torch.distributed.is_initialized():
            t = t.to(self.accelerator.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    # ------------------------------------------------------------------------------------------------
    # diagnostics and GARDO on every scored rollout
    # ------------------------------------------------------------------------------------------------
    def _health_on_scores(self, advantages: torch.Tensor, g_totals: torch.Tensor, g_per_reward: dict,
                          g_groups: torch.Tensor, local_images: list, reward_mean: float) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor | None]:
        """Log the rollout's diagnostics; with GARDO shape the advantages and gate the KL. Returns the (gathered)
        advantages and the gathered KL gate (None without GARDO)."""
        args = self.args
        m = self._metrics["train"]
        m["health/zero_std_groups"].append(hm.zero_std_group_fraction(g_totals, g_groups))
        if len(g_per_reward) > 1:
            for pair, r in hm.reward_correlations(g_per_reward).items():
                m[f"health/reward_correlation/{pair}"].append(r)
        local = self.health.image_features(local_images).to(self.accelerator.device)
        features = self.accelerator.gather(local).cpu() if self.accelerator.num_processes > 1 else local.cpu()
        diversity = hm.within_group_diversity(features, g_groups)
        m[f"health/diversity/{self.health.feature_name}"].append(diversity)
        if self.health.diversity.update(diversity):
            m["health/diversity_alarm"].append(1.0)
            if not getattr(self, "_warned_diversity", False):
                self._warned_diversity = True
                logger.warning(f"Diversity alarm: the within-group diversity ({self.health.feature_name}) fell below "
                               f"diversity_collapse_ratio={args.diversity_collapse_ratio} of its first value "
                               f"({self.health.diversity.first:.4g}); the groups are collapsing onto one image.")
        else:
            m["health/diversity_alarm"].append(0.0)
        self.health.hacking.observe_train_reward(self.state.global_step + 1, reward_mean)
        gate = None
        if args.regularizer == "gardo":
            aux = [g_per_reward[n] for n in args.gardo_auxiliary_rewards]
            uncertainty = reward_uncertainty(g_totals, aux)
            fraction = self.health.gate_fraction.update(uncertainty)
            gate = uncertainty_gate(uncertainty, fraction)
            m["gardo/gate_fraction"].append(fraction)
            m["gardo/gated"].append(float(gate.float().mean()))
            if args.gardo_diversity:
                shaped, factor = diversity_aware_advantages(advantages, g_totals, features, g_groups)
                advantages = shaped.to(advantages.dtype).clamp(-args.adv_clip_max, args.adv_clip_max)
                m["gardo/diversity_factor"].append(float(factor.mean()))
        return advantages, gate

    # ------------------------------------------------------------------------------------------------
    # after each optimizer step: update ratio, KL to the reference, GARDO's KL watch, the alarm's state
    # ------------------------------------------------------------------------------------------------
    def _health_step_end(self, step: int) -> None:
        args = self.args
        m = self._metrics["train"]
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self.is_peft:
            m["health/lora_update_ratio"].append(hm.lora_update_ratio(unwrapped, base_norms=self._base_norms))
        elif self.reference is not None and args.health_kl_steps and step % args.health_kl_steps == 0:
            trained = [p for p in unwrapped.parameters() if p.requires_grad]
            ref = dict(self.reference.copy.named_parameters())
            names = [n for n, p in unwrapped.named_parameters() if p.requires_grad]
            m["health/weight_update_ratio"].append(hm.weight_update_ratio(trained, [ref[n] for n in names]))
        if self.reference is not None and args.health_kl_steps and step % args.health_kl_steps == 0 and self._buffer:
            m["health/kl_to_reference"].append(self._kl_to_reference(self._buffer[0]))
        kls = m.get("kl", [])
        if len(kls) < self._kl_seen:
            self._kl_seen = 0
        if args.regularizer == "gardo" and len(kls) > self._kl_seen:
            new = kls[self._kl_seen:]
            self.health.reset_schedule.observe_kl(sum(new) / len(new))
        self._kl_seen = len(kls)
        m["health/hacking_alarm"].append(float(self.health.hacking_alarm_on))

    @torch.no_grad()
    def _kl_to_reference(self, batch: dict) -> float:
        """The analytic KL of one SDE step between the policy and the reference on a few samples of ``batch``."""
        from ...schedulers import sde_step_from_sigmas

        args = self.args
        height, width = args.image_size
        n = min(KL_PROBE_SAMPLES, len(batch["embeds"]))
        embeds = batch["embeds"][:n]
        if "latents" in batch:  # Flow-GRPO: the first recorded transition
            x, t = batch["latents"][:n, 0], batch["timesteps"][:n, 0]
            sigma, sigma_next = batch["sigmas"][:n, 0], batch["sigmas_next"][:n, 0]
        else:  # DiffusionNFT and others: the final latent noised to a middle level of the rollout
            from ..algorithms.nft_loss import noised_sample

            levels = batch["sigmas"].shape[1]
            k = levels // 2
            x0 = batch["x0"][:n]
            gen = torch.Generator().manual_seed(int(args.seed) + 7)
            noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(x0.device)
            sigma = batch["sigmas"][:n, k]
            sigma_next = batch["sigmas"][:n, k + 1] if k + 1 < levels else torch.zeros_like(sigma)
            t = batch["timesteps"][:n, k]
            x = noised_sample(x0, noise, sigma)
        noise_level = float(getattr(args, "noise_level", 0.7) or 0.7)
        with self._generation_context() as model:
            v = self._velocity(model, x, t, embeds, args.guidance_scale, height, width)
            v_ref = self._reference_velocity(model, x, t, embeds, height, width)
        fallback = float(self.sde_scheduler.sigmas[1])
        out = sde_step_from_sigmas(v, x, sigma, sigma_next, noise_level=noise_level, sde_type="sde",
                                   sigma_max_fallback=fallback)
        ref = sde_step_from_sigmas(v_ref, x, sigma, sigma_next, noise_level=noise_level, sde_type="sde",
                                   sigma_max_fallback=fallback)
        return hm.kl_between_transitions(out.prev_sample_mean, ref.prev_sample_mean, out.std)

    # ------------------------------------------------------------------------------------------------
    # evaluation: gold rewards, the hacking alarm
    # ------------------------------------------------------------------------------------------------
    def _gold_scores(self, prompts: list[str], images: list, columns: dict) -> dict[str, list]:
        if self.gold_reward_set is None:
            return {}
        result = self.gold_reward_set(prompts, images, **columns)
        out = {name: list(result.per_reward[name]) for name in self.gold_reward_set.names}
        out[None] = list(result.total)
        return out

    def _health_after_evaluate(self, metrics: dict[str, float], prefix: str) -> None:
        """The hacking alarm on this evaluation's gold means; ``on_hacking: stop`` ends training."""
        if self.gold_reward_set is None:
            return
        args = self.args
        gold = {n: metrics.get(f"{prefix}_rewards/{n}/mean", math.nan) for n in self.gold_reward_set.names}
        verdict = self.health.hacking.update(self.state.global_step, gold)
        self.health.hacking_alarm_on = verdict.fired
        metrics["health/hacking_alarm"] = float(verdict.fired)
        if not verdict.fired:
            return
        message = verdict.message(args.hacking_tolerance)
        if args.on_hacking == "stop" and self.state.global_step > 0:
            self.stopped_by_hacking_alarm = True
            self.control.should_training_stop = True
            self.control.should_save = True
            best = self.state.best_model_checkpoint
            logger.warning(f"{message} on_hacking='stop': saving this step and ending training"
                           + (f"; the best checkpoint so far is {best} ({args.metric_for_best_model}="
                              f"{self.state.best_metric})." if best else "."))
        else:
            warnings.warn(message + " (on_hacking='warn'; set on_hacking: stop to end the run here.)", stacklevel=2)

    # ------------------------------------------------------------------------------------------------
    # checkpoints, the best model, the model card
    # ------------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        self._in_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._in_checkpoint = False

    @contextmanager
    def _reference_adapter_left_out(self):
        """peft's own save writes every adapter of ``peft_config``; the ``ref`` adapter is saved by
        `ReferencePolicy.save` instead, so it is taken out for the duration of that save."""
        configs = self.accelerator.unwrap_model(self.model).peft_config if self.is_peft else {}
        held = configs.pop(REFERENCE_ADAPTER, None)
        try:
            yield
        finally:
            if held is not None:
                configs[REFERENCE_ADAPTER] = held

    def _save_health_state(self, output_dir: str) -> None:
        if self._in_checkpoint and self.args.should_save and self.health is not None:
            self.health.save(output_dir)
            if self.reference is not None and self.reference.kind == "adapter":
                self.reference.save(output_dir)

    def _load_health_state(self, folder: str) -> None:
        if self.health is not None:
            self.health.load(folder)
        if self.reference is not None and self.reference.kind == "adapter":
            self.reference.load(folder)

    def _load_best_model(self) -> None:
        """Trainer's restore of the best checkpoint's weights, and its EMA (the final save then exports them)."""
        import os

        super()._load_best_model()
        from ..online_trainer import EMA_STATE_NAME

        path = os.path.join(self.state.best_model_checkpoint, EMA_STATE_NAME)
        if self.ema is not None and os.path.exists(path):
            self.ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        if self.is_world_process_zero():
            logger.warning(f"Loaded the best model: {self.state.best_model_checkpoint} ({self.args.metric_for_best_model}"
                           f"={self.state.best_metric}); the final weights, exported LoRA and Hub push are its.")

    def _card_best_lines(self) -> list[str]:
        state = self.state
        if state.best_metric is None or not self.args.metric_for_best_model:
            return []
        step = state.best_global_step
        loaded = self.args.load_best_model_at_end and state.best_model_checkpoint
        lines = ["", "## Best evaluation", "",
                 f"- {self.args.metric_for_best_model} = {state.best_metric:.4f} at step {step}"
                 + (f" ({state.best_model_checkpoint})" if state.best_model_checkpoint else ""),
                 "- these weights are " + (f"those of step {step} (load_best_model_at_end)" if loaded else
                                           f"those of the last step, {state.global_step}")]
        if self.gold_reward_set is not None:
            lines.append(f"- gold evaluation rewards (never trained on): {', '.join(self.gold_reward_set.names)}")
        if self.stopped_by_hacking_alarm:
            lines.append(f"- training was stopped by the hacking alarm at step {state.global_step}")
        return lines
