"""The rollout and scoring pipeline every online-RL trainer shares (composed into `OnlineRLTrainer`).

One generation: the generation batch holds ``generation_batch_size / G`` prompts, each G times. Each unique prompt is
encoded once (or read from the embedding cache, ``_encode_unique``). Images are sampled in micro-batches by the
algorithm's ``_rollout`` (built on ``_sample``: SDE steps in a window, deterministic steps elsewhere). Each micro-batch
is decoded once, in a background thread, and scored by the reward pool while the next micro-batch is sampled
(``_decode_and_submit``). The last micro-batch's rewards are still being scored while the first training forward
runs; ``_resolve_scoring`` then gathers the rewards from all processes and turns them into group advantages
(``advantages.py``), stored in each micro-batch's record as ``"advantages"``.

What the class using it provides: ``args``, ``accelerator``, ``adapter``, ``sde_scheduler``, ``reward_set``,
``prompt_cache``, ``_negative_embeds``, ``model_dtype``, ``_metrics``, ``_micro_step``, ``_generation_context``,
the algorithm's ``_rollout_plan`` / ``_rollout`` / ``_sde_type`` and the crash-safety mixin's
``_raise_if_reward_failed``.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object

from ...cpu_threads import background_task, limit_worker_threads
from ...models import PromptEmbeds
from ...rewards import RewardResult
from ...rewards.composition import metric_means
from ...schedulers import FlowODESolver, rollout_steps, sde_step_from_sigmas
from ..console import rollout_progress
from ..data.condition_images import IMAGE_COLUMN, image_key, load_condition_image
from ..data.datasets import INDEX_COLUMN
from .advantages import compute_reward_advantages
from .sliced_decode import decode_in_slices
from .sound import audio_columns


def _to_pil(images: torch.Tensor) -> list:
    """Decoded pixels in [0, 1] as PIL: ``(B, 3, H, W)`` -> B images, ``(B, F, 3, H, W)`` -> B lists of F frames."""
    from PIL import Image

    if images.dim() == 5:
        return [_to_pil(video) for video in images]
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


def _load_images(values: list) -> list:
    """The ``image`` column's values as RGB PIL images, or lists of them for rows holding several (each distinct path
    read once)."""
    loaded: dict[str, Any] = {}

    def load(value):
        if isinstance(value, (list, tuple)):
            return [load(v) for v in value]
        if isinstance(value, (str, os.PathLike)):
            key = os.fspath(value)
            if key not in loaded:
                loaded[key] = load_condition_image(value)
            return loaded[key]
        return load_condition_image(value)

    return [load(value) for value in values]


def _done_future(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _seed_for(*parts: int) -> int:
    """A 63-bit seed that depends on every part (deterministic, no Python hash randomisation)."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (int(p) + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & ((1 << 63) - 1)
    return value


class RolloutPipeline:
    """Rollout, decoding and scoring of one generation batch, and the sampling loop they are built on."""

    # Overlaps (on by default; switchable for measuring what each buys, see docs/benchmarks.md): decode each
    # rollout micro-batch in a background thread, and let the first training forward run while the last rewards
    # are being scored (advantages are only needed by the loss).
    _overlap_decode = True
    _overlap_reward_with_training = True
    _postprocess_pool: ThreadPoolExecutor | None = None
    _pending_scoring: tuple | None = None

    # Set by the benchmark harness on a GPU: synchronise before reading the clock, so that the phase timings are
    # those of the kernels and not of their launches. Off by default (a synchronisation stalls the pipeline).
    _timing_sync = False

    def _clock(self) -> float:
        if self._timing_sync and self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------------
    # rollouts
    # ------------------------------------------------------------------------------------------------
    def _encode_unique(self, prompts: list[str], device, images: list | None = None,
                       guidance_scale: float | None = None) -> tuple[PromptEmbeds, torch.Tensor]:
        """Encode each distinct prompt (editing families: each distinct (prompt, source image) pair) once; returns the
        embeddings and, per sample, its row. With CFG and a negative embedding that depends on the source image,
        the negative prompt is encoded once per pair too (``PromptEmbeds.negative``); with the prompt cache, once per
        distinct source image, kept in the cache under (negative prompt, image) like any other pair: the stock
        pipelines encode the negative prompt with the same call as the prompt."""
        args = self.args
        if images is None or not self.adapter.accepts_images:
            images = None
        guidance = args.guidance_scale if guidance_scale is None else guidance_scale
        per_image_negative = (images is not None and self.adapter.negative_depends_on_image
                              and self.adapter.uses_cfg(guidance))
        if self.prompt_cache is not None:
            embeds, rows = self.prompt_cache.encode_unique(prompts, device, conditions=images)
            if per_image_negative:
                first: dict[int, int] = {}
                for i, row in enumerate(rows.tolist()):
                    first.setdefault(row, i)
                pair_images = [images[first[row]] for row in range(len(first))]
                negative, negative_rows = self.prompt_cache.encode_unique(
                    [args.negative_prompt] * len(pair_images), device, conditions=pair_images)
                embeds.negative = negative.index_select(negative_rows)
            return embeds, rows
        keys = list(prompts) if images is None else [(p, image_key(im)) for p, im in zip(prompts, images)]
        unique: dict[Any, int] = {}
        rows = [unique.setdefault(k, len(unique)) for k in keys]
        first = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        unique_prompts = [prompts[first[k]] for k in unique]
        unique_images = [images[first[k]] for k in unique] if images is not None else None
        height, width = args.image_size
        embeds = self.adapter.encode_prompts(unique_prompts, args.max_sequence_length, device, images=unique_images,
                                             height=height, width=width)
        if per_image_negative:
            embeds.negative = self.adapter.encode_prompts([args.negative_prompt] * len(unique_prompts),
                                                          args.max_sequence_length, device, images=unique_images,
                                                          height=height, width=width)
        return embeds, torch.tensor(rows, dtype=torch.long)

    def _await_scoring(self, tic: float) -> float:
        """Wait for the rollout's rewards (scored while the first training forward ran) and return ``tic`` moved
        by the wait, so that the wait is logged as ``timing/reward``, not as forward time."""
        wait = self._clock()
        self._resolve_scoring()
        return tic + self._clock() - wait

    def _velocity(self, model, latents, timestep, embeds, guidance_scale, height, width):
        neg = None
        if self.adapter.uses_cfg(guidance_scale):
            neg = embeds.negative if embeds.negative is not None else (
                self._negative_embeds.expand_to(latents.shape[0]) if self._negative_embeds is not None else None)
        v = self.adapter.predict_velocity(model, latents.to(self.model_dtype), timestep, embeds, guidance_scale, neg,
                                          height, width)
        return v.float()

    def _sample(self, model, embeds: PromptEmbeds, num_steps: int, guidance_scale: float, noise_level: float,
                window: tuple[int, int], generator: torch.Generator, record: bool, progress=None, *,
                ode_solver: str = "euler", ode_compression_ratio: float = 1.0,
                initial_latents: torch.Tensor | None = None, record_means: bool = False):
        """Sample one micro-batch. Returns the final latents and (if ``record``) the window's trajectory.

        Steps inside ``window`` are SDE steps (noise from ``generator``); the others are deterministic, solved by
        ``ode_solver`` (``"euler"`` or ``"dpmpp_2m"``; the DPM-Solver history restarts after the window), and with
        ``ode_compression_ratio < 1`` the steps after the window are fewer solver steps over the same noise range
        (`rollout_steps`). ``window=(0, 0)`` samples a whole deterministic trajectory. ``initial_latents`` replaces
        the initial noise drawn from ``generator``; ``record_means`` also stores each window step's transition
        mean (``"means"``, for GRPO-Guard).
        """
        args = self.args
        height, width = args.image_size
        device = self.accelerator.device
        batch = len(embeds)
        self.adapter.set_timesteps(self.sde_scheduler, num_steps, height, width, device)
        sigmas = self.sde_scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = self.sde_scheduler.timesteps.to(device)
        if initial_latents is None:
            latents = self.adapter.prepare_latents(batch, height, width, generator, device, torch.float32)
        else:
            latents = initial_latents.to(device=device, dtype=torch.float32)
        traj = {"latents": [], "next_latents": [], "log_probs": [], "timesteps": [], "sigmas": [], "sigmas_next": []}
        if record_means:
            traj["means"] = []
        solver = FlowODESolver(ode_solver) if ode_solver != "euler" else None
        plan = rollout_steps(sigmas, timesteps, window, ode_compression_ratio,
                             self.sde_scheduler.config.num_train_timesteps)
        for index, step in enumerate(plan):
            t = step.timestep.expand(batch)
            # The last base_model_tail_steps steps of a training rollout: the reference's velocity (health/guards.py).
            v = self._tail_velocity(model, index, len(plan), record and step.stochastic, latents, t, embeds,
                                    guidance_scale, height, width)
            if v is None:
                v = self._velocity(model, latents, t, embeds, guidance_scale, height, width)
            if step.stochastic or solver is None:
                out = sde_step_from_sigmas(
                    v, latents, step.sigma, step.sigma_next, noise_level=noise_level if step.stochastic else 0.0,
                    sde_type=self._sde_type(), generator=generator, sigma_max_fallback=float(sigmas[1]),
                )
                if solver is not None:
                    solver.reset()  # a deterministic stretch after the window starts a new history
                if record and step.stochastic:
                    traj["latents"].append(latents)
                    traj["next_latents"].append(out.prev_sample)
                    traj["log_probs"].append(out.log_prob)
                    traj["timesteps"].append(t)
                    traj["sigmas"].append(step.sigma.expand(batch))
                    traj["sigmas_next"].append(step.sigma_next.expand(batch))
                    if record_means:
                        traj["means"].append(out.prev_sample_mean)
                latents = out.prev_sample
            else:
                latents = solver.step(latents, v, step.sigma, step.sigma_next, final=step.final)
            if progress is not None:
                progress.update(1)
        if progress is not None and len(plan) < num_steps:
            progress.update(num_steps - len(plan))
        stacked = {k: torch.stack(v, dim=1) for k, v in traj.items()} if record else None
        return self.adapter.final_latents(latents, embeds), stacked

    def _final_sample_rollout(self, model, embeds: PromptEmbeds, generator: torch.Generator, progress,
                              solver: str) -> tuple[torch.Tensor, dict]:
        """A deterministic rollout with ``solver`` (``"euler"`` or ``"dpmpp_2m"``) at ``num_inference_steps`` and
        ``guidance_scale`` that keeps only each image's final latent, with the rollout's noise levels:
        ``{"x0": (B, ...), "sigmas": (B, steps), "timesteps": (B, steps)}`` (DiffusionNFT, AWM, online DPO)."""
        args = self.args
        final, _ = self._sample(model, embeds, args.num_inference_steps, args.guidance_scale, 0.0, (0, 0), generator,
                                record=False, progress=progress, ode_solver=solver)
        batch = final.shape[0]
        sigmas = self.sde_scheduler.sigmas[:-1].to(device=final.device, dtype=torch.float32)
        timesteps = self.sde_scheduler.timesteps.to(final.device)
        return final, {"x0": final, "sigmas": sigmas.expand(batch, -1), "timesteps": timesteps.expand(batch, -1)}

    def _tail_velocity(self, model, step_index: int, plan_length: int, stochastic_recorded: bool, latents, t, embeds,
                       guidance_scale, height, width):
        """A velocity replacing the policy's at one rollout step, or None (`HealthGuards`: base_model_tail_steps)."""
        return None

    def _health_on_scores(self, advantages: torch.Tensor, g_totals: torch.Tensor, g_per_reward: dict,
                          g_groups: torch.Tensor, local_images: list, reward_mean: float):
        """Diagnostics of a scored rollout and a chance to reshape its gathered advantages; returns (advantages, a
        gathered per-sample KL gate or None) (`HealthGuards`)."""
        return advantages, None

    def _generation_index(self) -> int:
        return self._micro_step // (self.args.steps_per_generation * self.args.num_iterations)

    def _generate_and_score(self, inputs: list[dict]) -> list[dict]:
        """Rollout + rewards + advantages for this process's share of a generation batch, split in micro-batches.

        Returns one record per micro-batch: what the algorithm's ``_rollout`` recorded, plus ``"embeds"`` and (once
        the rewards are in, `_resolve_scoring`) ``"advantages"``.
        """
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        gen_index = self._generation_index()
        prompts = [row["prompt"] for row in inputs]
        group_ids = torch.tensor([row[INDEX_COLUMN] for row in inputs], dtype=torch.long)
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", INDEX_COLUMN)}
        if IMAGE_COLUMN in columns:  # source images: conditioning (editing families) and a column for the rewards
            columns[IMAGE_COLUMN] = _load_images(columns[IMAGE_COLUMN])

        plan = self._rollout_plan(gen_index)
        noise_gen = torch.Generator().manual_seed(_seed_for(args.seed, gen_index, self.accelerator.process_index))
        micro = args.per_device_train_batch_size
        chunks = [slice(s, s + micro) for s in range(0, len(prompts), micro)]

        t0 = self._clock()
        timing = defaultdict(float)
        jobs, samples = [], []
        progress = rollout_progress(getattr(self, "console", None), len(chunks) * args.num_inference_steps)
        overlap_decode = self._overlap_decode
        with self._generation_context() as model:
            tic = self._clock()
            unique_embeds, rows = self._encode_unique(prompts, device, columns.get(IMAGE_COLUMN), args.guidance_scale)
            embeds_all = unique_embeds.index_select(rows)
            timing["text_encoding"] += self._clock() - tic
            for sl in chunks:
                embeds = embeds_all[sl]
                tic = self._clock()
                final, record = self._rollout(model, embeds, plan, noise_gen, progress, group_ids[sl], gen_index)
                timing["rollout"] += self._clock() - tic
                chunk_columns = {k: v[sl] for k, v in columns.items()}
                if overlap_decode:
                    # Decode and score in the background while the next micro-batch is sampled.
                    jobs.append(self._postprocess_executor().submit(background_task, self._decode_and_submit, final,
                                                                    prompts[sl], chunk_columns))
                else:
                    jobs.append(_done_future(self._decode_and_submit(final, prompts[sl], chunk_columns)))
                record["embeds"] = embeds
                samples.append(record)
        progress.close()
        timing["sampling_total"] = self._clock() - t0
        self._pending_scoring = (jobs, samples, chunks, prompts, group_ids, timing)
        if not self._overlap_reward_with_training:
            self._resolve_scoring()
        return samples

    def _postprocess_executor(self) -> ThreadPoolExecutor:
        if self._postprocess_pool is None:
            self._postprocess_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowgrpo-decode",
                                                        initializer=limit_worker_threads)
            weakref.finalize(self, self._postprocess_pool.shutdown, wait=False)
        return self._postprocess_pool

    def _decode_and_submit(self, final: torch.Tensor, prompts: list[str], columns: dict):
        """Decode one micro-batch (once) and hand it to the reward pool; returns (images, reward future, seconds)."""
        height, width = self.args.image_size
        tic = self._clock()
        # Grad mode and autocast are thread-local: set them here too (this may run in the decode thread).
        with torch.no_grad(), self.accelerator.autocast():
            final = final.to(self.model_dtype)
            pil = _to_pil(decode_in_slices(self.adapter.decode, final, height, width, self.args.vae_decode_batch_size))
            if self.reward_set.audio_rewards:  # the sound too, for the rewards that score it
                columns = {**columns, **audio_columns(self.adapter, final, height, width,
                                                      self.args.vae_decode_batch_size)}
        seconds = self._clock() - tic
        # group-wise rewards (pickscore_rank) give raw scores here; they are combined over whole groups below
        return pil, self.reward_set.submit(prompts, pil, defer_groupwise=True, **columns), seconds

    def _resolve_scoring(self) -> None:
        """Wait for the pending rollout's rewards; gather them, compute advantages into its buffers, log metrics."""
        if self._pending_scoring is None:
            return
        jobs, samples, chunks, prompts, group_ids, timing = self._pending_scoring
        self._pending_scoring = None
        args = self.args
        device = self.accelerator.device
        tic = self._clock()
        decoded, results, reward_error = [], [], None
        for job in jobs:
            pil, reward_future, decode_seconds = job.result()
            decoded.append(pil)
            timing["vae_decode"] += decode_seconds
            try:
                results.append(reward_future.result())
            except Exception as err:  # on_failure="raise": stop every process, after saving the last step
                reward_error = reward_error or err
        timing["reward_wait"] = self._clock() - tic
        self._raise_if_reward_failed(reward_error)

        # ---- gather rewards, advantages --------------------------------------------------------------
        def as_tensor(values):
            return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32,
                                device=device)

        totals = as_tensor([v for r in results for v in r.total])
        per_reward = {name: as_tensor([v for r in results for v in r.per_reward[name]])
                      for name in self.reward_set.names}
        g_totals = self.accelerator.gather(totals).cpu()
        g_groups = self.accelerator.gather(group_ids.to(device)).cpu()
        g_per_reward = {n: self.accelerator.gather(t).cpu() for n, t in per_reward.items()}
        if self.reward_set.has_groupwise:  # every group is complete once gathered: combine, recompute the totals
            combined, g_total_list = self.reward_set.finish_groupwise(
                {n: t.tolist() for n, t in g_per_reward.items()}, g_groups.tolist())
            g_per_reward = {n: as_tensor(v).cpu() for n, v in combined.items()}
            g_totals = as_tensor(g_total_list).cpu()
            n_local, rank = len(prompts), self.accelerator.process_index
            totals = g_totals[rank * n_local:(rank + 1) * n_local]
        advantages, stats = compute_reward_advantages(
            g_totals, g_per_reward, dict(zip(self.reward_set.names, self.reward_set.weights)), g_groups,
            args.scale_rewards, args.adv_clip_max, args.reward_aggregation,
        )
        flat_images = [im for chunk in decoded for im in chunk]
        advantages, kl_gate = self._health_on_scores(advantages, g_totals, g_per_reward, g_groups, flat_images,
                                                     stats.reward_mean)
        n_local = len(prompts)
        rank = self.accelerator.process_index
        local_adv = advantages[rank * n_local:(rank + 1) * n_local].to(device)
        local_gate = kl_gate[rank * n_local:(rank + 1) * n_local].to(device) if kl_gate is not None else None

        m = self._metrics["train"]
        m["reward"].append(stats.reward_mean)
        m["reward_std"].append(stats.reward_std)
        m["frac_reward_zero_std"].append(stats.frac_reward_zero_std)
        failed = torch.tensor([sum(r.failed.get(n, 0) for r in results) for n in self.reward_set.names],
                              dtype=torch.float32, device=device)
        g_failed = self.accelerator.gather(failed).cpu().view(-1, len(self.reward_set.names)).sum(0)
        for k, (name, vals) in enumerate(g_per_reward.items()):
            valid = vals[~torch.isnan(vals)]
            m[f"rewards/{name}/mean"].append(float(valid.mean()) if valid.numel() else math.nan)
            m[f"rewards/{name}/std"].append(float(valid.std(unbiased=False)) if valid.numel() else math.nan)
            m[f"rewards/{name}/failed"].append(float(g_failed[k]))  # samples scored None by on_failure="skip"
        # Metrics a reward defines itself (RewardOutput.metrics, e.g. GenEval's accuracy per task), over all processes.
        metric_sums = RewardResult.concatenate(results).metric_sums() if results else {}
        for key, mean in metric_means(gather_object([metric_sums]) if self.accelerator.num_processes > 1
                                      else [metric_sums]).items():
            m[f"rewards/{key}"].append(mean)
        # sampling: the rollout phase (text encoding, sampling, decoding unless it runs in the background);
        # reward: the time spent waiting for decoding and rewards that did not overlap anything.
        m["timing/sampling"].append(timing["sampling_total"])
        m["timing/reward"].append(timing["reward_wait"])
        for key in ("text_encoding", "rollout", "vae_decode"):
            m[f"timing/{key}"].append(timing[key])
        self._last_timing = dict(timing)

        totals_list = totals.cpu().tolist()
        self._last_samples = (flat_images[: args.num_log_images], prompts[: args.num_log_images],
                              totals_list[: args.num_log_images])
        self._last_sample_notes = [note for r in results for note in r.image_notes()][: args.num_log_images]
        for sl, traj in zip(chunks, samples):
            traj["advantages"] = local_adv[sl]
            if local_gate is not None:  # GARDO: the samples whose KL penalty counts
                traj["kl_gate"] = local_gate[sl]


__all__ = ["RolloutPipeline"]
