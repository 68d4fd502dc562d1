"""`RolloutEngine`: encoding, sampling with the SDE scheduler, decoding, scoring and advantages of the rollouts.

One generation: the generation batch holds ``generation_batch_size / G`` prompts, each G times. Each unique prompt is
encoded once (or read from the embedding cache, `encode_unique`). Images are sampled in micro-batches by the
algorithm's `RolloutStrategy` (`strategies.py`), built on `sample`: SDE steps in a window, deterministic steps
elsewhere. Each micro-batch is decoded once, in a background thread, and handed to the reward pool while the next
micro-batch is sampled (`generate` returns a `Generation` whose rewards may still be in flight). `score` then
gathers the rewards from all processes and turns them into group advantages (``advantages.py``), stored in each
micro-batch's record as ``"advantages"``; with the default overlap, the trainer defers it (`defer`) until its first
training forward has run (`resolve_scoring`).

With reward constraints (``reward_constraints``), `score` takes each rollout-sourced multiplier's dual step from the
gathered batch and combines the objective's advantage with each constrained reward's own (``advantages.py``,
`compute_constrained_advantages`); the generation keeps the multipliers and scores (``constraint_terms``) for a
strategy that forms its advantages itself (BranchGRPO's trees).

The engine receives what it needs at construction (the configuration, the policy, the algorithm's strategy, the
rewards, the accelerator, the metrics sink, the reward constraints) and two hooks: ``on_scores`` (the health guards' view of each scored
rollout, which may reshape its advantages) and ``on_reward_error`` (stop every process when a reward failed).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import gather_object

from ...cpu_threads import background_task, limit_worker_threads
from ...models import PromptEmbeds
from ...rewards import RewardResult, RewardSet
from ...rewards.composition import metric_means
from ...schedulers import FlowMatchSDEScheduler, FlowODESolver, SDESettings, rollout_steps, sde_transition
from ..console import rollout_progress
from ..data.condition_images import IMAGE_COLUMN, image_key
from ..data.datasets import INDEX_COLUMN
from ..seeds import seed_for
from ..speed_settings import parse_rollout_cache_config
from ..step_metrics import StepMetrics
from .advantages import ConstraintTerms, compute_constrained_advantages, compute_reward_advantages
from .cache import CacheSteps, RolloutCache
from .generation import Generation, done_future
from .images import load_images, to_pil
from .sliced_decode import decode_in_slices
from .sound import audio_columns
from .strategies import RolloutStrategy

__all__ = ["RolloutEngine"]

#: ``on_scores(advantages, totals, per_reward, group_ids, images, reward_mean, step) -> (advantages, kl_gate)``
ScoresHook = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


class RolloutEngine:
    """See the module docstring.

    Args:
        args: the trainer's configuration.
        policy: the `Policy` (adapter, velocities, generation context, copies).
        strategy: what the algorithm samples and records (`RolloutStrategy`).
        rewards: the training rewards.
        accelerator: device, process index, gathers and autocast.
        metrics: where logged values go.
        prompt_cache: the embedding cache (``cache_prompt_embeddings``), or None.
        console: the training console (the rollout's progress on its bar), or None.
        on_scores: see ``ScoresHook``; None leaves the advantages as computed.
        on_reward_error: called with a reward's exception (or None when every reward worked) on every process.
        constraints: the reward constraints' multipliers (``health.constraints.RewardConstraints``), or None.
    """

    #: Overlaps (on by default; switchable for measuring what each buys, see docs/benchmarks.md): decode each rollout
    #: micro-batch in a background thread, and let the first training forward run while the last rewards are scored.
    overlap_decode = True
    overlap_reward_with_training = True
    #: Set by the benchmark harness on a GPU: synchronise before reading the clock, so that phase timings are those of
    #: the kernels and not of their launches. Off by default (a synchronisation stalls the pipeline).
    timing_sync = False

    def __init__(self, args: Any, policy: Any, strategy: RolloutStrategy, rewards: RewardSet, accelerator: Any,
                 metrics: StepMetrics, *, prompt_cache: Any = None, console: Any = None,
                 on_scores: ScoresHook | None = None,
                 on_reward_error: Callable[[BaseException | None], None] | None = None, constraints: Any = None):
        self.args = args
        self.policy = policy
        self.adapter = policy.adapter
        self.strategy = strategy
        self.rewards = rewards
        self.accelerator = accelerator
        self.metrics = metrics
        self.prompt_cache = prompt_cache
        self.console = console
        self.on_scores = on_scores
        self.on_reward_error = on_reward_error
        self.constraints = constraints
        self.scheduler = FlowMatchSDEScheduler.from_config(self.adapter.sde_scheduler_config(),
                                                           **strategy.scheduler_options())
        policy.pipeline.scheduler = self.scheduler
        self._pending: Generation | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._reference_tail = 0
        #: the positions, in the whole generation batch over every process, of the rows that the strategy's current
        #: ``rollout`` call samples (group g's G rows are the consecutive positions g G .. g G + G - 1)
        self.rollout_rows: torch.Tensor | None = None
        #: the positions of every row of the share `generate` samples now (this process's, or a rollout worker's
        #: request), in the same numbering
        self.share_rows: torch.Tensor | None = None
        #: seconds spent waiting for deferred scoring since the trainer last read it (not forward time)
        self.scoring_wait_s = 0.0
        #: the last scored rollout's first images, prompts and rewards, its rewards' notes, and its phase timings
        self.last_samples: tuple | None = None
        self.last_sample_notes: list[str] | None = None
        self.last_timing: dict[str, float] = {}
        #: sequence parallelism: only an SP group's leader scores its samples (`_settle_scores` shares the scores);
        #: the accelerator of a launch without SP always scores
        self.scores_rewards = bool(getattr(accelerator, "scores_rewards", True))
        #: diffusers' cache hooks of ``rollout_cache`` (None: ``"none"``), on during training rollouts only
        kind = getattr(args, "rollout_cache", "none")
        self.cache: RolloutCache | None = None if kind == "none" else RolloutCache(
            kind, parse_rollout_cache_config(getattr(args, "rollout_cache_config", None)), self.adapter.transformers(),
            video=self.adapter.is_video)
        self._cache_on = False

    def sde_settings(self, noise_level: float | None = None, sde_type: str | None = None) -> SDESettings:
        """The stochastic step of this engine's rollouts (the strategy's noise level and step type unless given) with
        the schedule's ``sigmas[1]`` as the sigma_max fallback: what every replay of a recorded step passes to
        `sde_transition` (the trainers' losses, the health guards' probe, the importance weights)."""
        options = self.strategy.scheduler_options()
        level = options.get("noise_level", 0.0) if noise_level is None else noise_level
        return SDESettings(noise_level=float(level or 0.0),
                           sde_type=sde_type or options.get("sde_type", self.strategy.sde_type),
                           sigma_max_fallback=float(self.scheduler.sigmas[1]))

    def clock(self) -> float:
        if self.timing_sync and self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------------
    # encoding
    # ------------------------------------------------------------------------------------------------
    def encode_unique(self, prompts: list[str], images: list | None = None,
                      guidance_scale: float | None = None) -> tuple[PromptEmbeds, torch.Tensor]:
        """Encode each distinct prompt (editing families: each distinct (prompt, source image) pair) once; returns the
        embeddings and, per sample, its row. With CFG and a negative embedding that depends on the source image,
        the negative prompt is encoded once per pair too (``PromptEmbeds.negative``); with the prompt cache, once per
        distinct source image, kept in the cache under (negative prompt, image) like any other pair: the stock
        pipelines encode the negative prompt with the same call as the prompt."""
        args = self.args
        device = self.accelerator.device
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
        if per_image_negative:  # once per distinct source image, however many prompts share it
            image_rows: dict[str, int] = {}
            distinct, negative_rows = [], []
            for (_, key), image in zip(unique, unique_images):
                if key not in image_rows:
                    image_rows[key] = len(distinct)
                    distinct.append(image)
                negative_rows.append(image_rows[key])
            negative = self.adapter.encode_prompts([args.negative_prompt] * len(distinct), args.max_sequence_length,
                                                   device, images=distinct, height=height, width=width)
            embeds.negative = negative.index_select(torch.tensor(negative_rows, dtype=torch.long))
        return embeds, torch.tensor(rows, dtype=torch.long)

    # ------------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------------
    def sample(self, model, embeds: PromptEmbeds, num_steps: int, guidance_scale: float, noise_level: float,
               window: tuple[int, int], generator, record: bool, progress=None, *, ode_solver: str = "euler",
               ode_compression_ratio: float = 1.0, initial_latents: torch.Tensor | None = None,
               record_means: bool = False, sde_type: str | None = None, steps: tuple[int, int] | None = None,
               step_noise: Callable[[int], torch.Tensor] | None = None):
        """Sample one micro-batch. Returns the final latents and (if ``record``) the window's trajectory.

        Steps inside ``window`` are SDE steps of ``sde_type`` (default: the strategy's; noise from ``generator``); the
        others are deterministic, solved by ``ode_solver`` (``"euler"`` or ``"dpmpp_2m"``; the DPM-Solver history
        restarts after the window), and with ``ode_compression_ratio < 1`` the steps after the window are fewer solver
        steps over the same noise range (`rollout_steps`). ``window=(0, 0)`` samples a whole deterministic trajectory.
        ``initial_latents`` replaces the initial noise drawn from ``generator``; ``record_means`` also stores each
        window step's transition mean (``"means"``, for GRPO-Guard and Flow-DPPO's anchor). During a training rollout
        with ``base_model_tail_steps``, the last steps use the reference's velocity.

        A stretch of the trajectory: ``steps=(start, end)`` samples only the schedule's steps ``start .. end - 1``
        from ``initial_latents`` (the state at level ``start``, required) and returns the state after step
        ``end - 1`` (the final latents only when ``end == num_steps``) with the record of the stretch's SDE steps.
        ``step_noise(i)`` gives the draws of SDE step ``i`` (one row per sample, the latents' shape) instead of
        ``generator``: x' = mean + std * step_noise(i), with the log-prob of x' under the step's own Gaussian. A
        caller may scale the draws (BranchGRPO's split children); the recorded log-prob is then that of the unscaled
        step, and the caller computes its own. Together they let a strategy sample trajectories that share prefixes
        (trees) with the same sampler, each draw a function of what it samples, never of the order of the calls.
        """
        args = self.args
        height, width = args.image_size
        device = self.accelerator.device
        batch = len(embeds)
        sde_type = self.strategy.sde_type if sde_type is None else sde_type
        self.adapter.set_timesteps(self.scheduler, num_steps, height, width, device)
        sigmas = self.scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = self.scheduler.timesteps.to(device)
        start, end = (0, num_steps) if steps is None else (int(steps[0]), int(steps[1]))
        if steps is not None:
            if not 0 <= start < end <= num_steps:
                raise ValueError(f"steps={tuple(steps)} is not a stretch of a {num_steps}-step trajectory; give "
                                 f"(start, end) with 0 <= start < end <= {num_steps}.")
            if initial_latents is None:
                raise ValueError("A stretch of steps starts from given latents: pass initial_latents, the state at "
                                 f"level {start}.")
            if ode_compression_ratio < 1:
                raise ValueError("A stretch of steps follows the schedule's own steps; it cannot be combined with "
                                 f"ode_compression_ratio={ode_compression_ratio} (use 1.0).")
        if initial_latents is None:
            latents = self.adapter.prepare_latents(batch, height, width, generator, device, torch.float32)
        else:
            latents = initial_latents.to(device=device, dtype=torch.float32)
        traj = {"latents": [], "next_latents": [], "log_probs": [], "timesteps": [], "sigmas": [], "sigmas_next": []}
        if record_means:
            traj["means"] = []
        solver = FlowODESolver(ode_solver) if ode_solver != "euler" else None
        plan = rollout_steps(sigmas, timesteps, window, ode_compression_ratio, self.scheduler.config.num_train_timesteps)
        tail = self._reference_tail
        with self.cached_steps(len(plan), self.adapter.uses_cfg(guidance_scale)) as cache:
            for index, step in enumerate(plan):
                if not start <= index < end:
                    continue
                if cache is not None:
                    cache.step(float(step.timestep), float(step.sigma))
                t = step.timestep.expand(batch)
                if tail and index >= len(plan) - tail:  # base_model_tail_steps: the reference's velocity
                    if record and step.stochastic:
                        raise ValueError(f"base_model_tail_steps={tail} reaches a trained (recorded SDE) step of the "
                                         "rollout; the reference's steps must come after the trained window: lower "
                                         "base_model_tail_steps or move the SDE window earlier (sde_window_range / "
                                         "sde_window_size).")
                    with self.policy.reference_model(model) as ref:
                        v = self.policy.velocity(ref, latents, t, embeds, guidance_scale, height, width)
                else:
                    v = self.policy.velocity(model, latents, t, embeds, guidance_scale, height, width)
                if step.stochastic or solver is None:
                    sde = SDESettings(noise_level if step.stochastic else 0.0, sde_type, float(sigmas[1]))
                    drawn = None
                    if step.stochastic and step_noise is not None:  # the caller's draws: x' = mean + std * z
                        moments = sde_transition(v, latents, step.sigma, step.sigma_next, sde, next_state=latents)
                        std = moments.std.reshape((batch,) + (1,) * (latents.ndim - 1))
                        noise = step_noise(index).to(device=device, dtype=torch.float32)
                        drawn = moments.prev_sample_mean + std * noise
                    out = sde_transition(v, latents, step.sigma, step.sigma_next, sde, next_state=drawn,
                                         generator=generator if drawn is None else None)
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
        if progress is not None and steps is None and len(plan) < num_steps:
            progress.update(num_steps - len(plan))
        stacked = None
        if record:
            stacked = {k: torch.stack(v, dim=1) if v else torch.empty(batch, 0) for k, v in traj.items()}
        return (self.adapter.final_latents(latents, embeds) if end == num_steps else latents), stacked

    @contextmanager
    def cached_steps(self, num_steps: int, uses_cfg: bool = False) -> Iterator[CacheSteps | None]:
        """The rollout cache's hooks for one denoising loop of ``num_steps`` transformer steps (``uses_cfg``: with
        classifier-free guidance) during a training rollout (`generate`), else None: evaluation, the health guards'
        probes and every training forward run the policy's own blocks. A sampler of its own (AWM's SA-Solver) calls
        ``cache.step(timestep, sigma)`` before each step, as `sample` does."""
        if self.cache is None or not self._cache_on:
            yield None
            return
        with self.cache.trajectory(num_steps, uses_cfg) as steps:
            yield steps

    def final_sample(self, model, embeds: PromptEmbeds, generator, progress, solver: str) -> tuple[torch.Tensor, dict]:
        """A deterministic rollout with ``solver`` (``"euler"`` or ``"dpmpp_2m"``) at ``num_inference_steps`` and
        ``guidance_scale`` that keeps only each image's final latent, with the rollout's noise levels:
        ``{"x0": (B, ...), "sigmas": (B, steps), "timesteps": (B, steps)}`` (DiffusionNFT, AWM, online DPO)."""
        args = self.args
        final, _ = self.sample(model, embeds, args.num_inference_steps, args.guidance_scale, 0.0, (0, 0), generator,
                               record=False, progress=progress, ode_solver=solver)
        batch = final.shape[0]
        sigmas = self.scheduler.sigmas[:-1].to(device=final.device, dtype=torch.float32)
        timesteps = self.scheduler.timesteps.to(final.device)
        return final, {"x0": final, "sigmas": sigmas.expand(batch, -1), "timesteps": timesteps.expand(batch, -1)}

    # ------------------------------------------------------------------------------------------------
    # one generation: rollouts, decoding, rewards in flight
    # ------------------------------------------------------------------------------------------------
    def generate(self, inputs: list[dict], gen_index: int, step: int,
                 on_micro_batch: Callable[[int, dict, Any], None] | None = None) -> Generation:
        """Roll out this process's share of generation ``gen_index`` (rows with ``prompt`` and the group index), in
        micro-batches; each is decoded and handed to the rewards in the background. ``step``: the optimizer steps done
        (the strategy's plan may follow it, e.g. MixGRPO's window). ``on_micro_batch(index, record, job)``, when
        given, sees each micro-batch as soon as it is sampled (a rollout worker streams them from there)."""
        args = self.args
        prompts = [row["prompt"] for row in inputs]
        group_ids = torch.tensor([row[INDEX_COLUMN] for row in inputs], dtype=torch.long)
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", INDEX_COLUMN)}
        if IMAGE_COLUMN in columns:  # source images: conditioning (editing families) and a column for the rewards
            columns[IMAGE_COLUMN] = load_images(columns[IMAGE_COLUMN])

        plan = self.strategy.plan(gen_index, step)
        noise_gen = torch.Generator().manual_seed(seed_for(args.seed, gen_index, self.accelerator.process_index))
        micro = args.per_device_train_batch_size
        chunks = [slice(s, s + micro) for s in range(0, len(prompts), micro)]

        t0 = self.clock()
        timing = defaultdict(float)
        jobs, records = [], []
        progress = rollout_progress(self.console, len(chunks) * args.num_inference_steps)
        self._reference_tail = args.base_model_tail_steps
        self._cache_on = True
        self.share_rows = torch.arange(len(prompts)) + self.accelerator.process_index * len(prompts)
        try:
            with self.policy.generation_context() as model:
                tic = self.clock()
                unique_embeds, rows = self.encode_unique(prompts, columns.get(IMAGE_COLUMN), args.guidance_scale)
                embeds_all = unique_embeds.index_select(rows)
                timing["text_encoding"] += self.clock() - tic
                for sl in chunks:
                    embeds = embeds_all[sl]
                    self.rollout_rows = torch.arange(sl.start, sl.stop) + self.accelerator.process_index * len(prompts)
                    tic = self.clock()
                    final, record = self.strategy.rollout(self, model, embeds, plan, noise_gen, progress,
                                                          group_ids[sl], gen_index)
                    timing["rollout"] += self.clock() - tic
                    chunk_columns = {k: v[sl] for k, v in columns.items()}
                    if self.overlap_decode:
                        # Decode and score in the background while the next micro-batch is sampled.
                        jobs.append(self._executor().submit(background_task, self._decode_and_submit, final,
                                                            prompts[sl], chunk_columns))
                    else:
                        jobs.append(done_future(self._decode_and_submit(final, prompts[sl], chunk_columns)))
                    record["embeds"] = embeds
                    records.append(record)
                    if on_micro_batch is not None:
                        on_micro_batch(len(records) - 1, record, jobs[-1])
        finally:
            self._reference_tail = 0
            self._cache_on = False
        progress.close()
        timing["sampling_total"] = self.clock() - t0
        sequence_parallel = getattr(self.accelerator, "layout", None)
        settle = self._settle_scores if sequence_parallel is not None and sequence_parallel.enabled else None
        if self.cache is not None:  # counts, summed like the timings; score() logs their ratio
            calls, computed = self.cache.take_counts()
            timing["cache_calls"] += calls
            timing["cache_computed"] += computed
        return Generation(records=records, jobs=jobs, chunks=chunks, prompts=prompts, group_ids=group_ids,
                          timing=timing, step=step, settle_scores=settle)

    def _settle_scores(self, generation: Generation) -> None:
        """Sequence parallelism: the SP group's leader sends its reward results (or the error of a failed reward) to
        the group's other processes, whose placeholders receive them; every process of the group then holds the same
        scores, computed once. Runs on the main thread of every process of the group, at the same point."""
        outcomes = []
        for job in generation.jobs:
            _, future, _ = job.result()
            if not self.scores_rewards:
                outcomes.append(None)
                continue
            try:
                outcomes.append(("ok", future.result()))
            except Exception as err:  # handed over; each process raises it where it reads the scores
                outcomes.append(("error", f"{type(err).__name__}: {err}"))
        shared = self.accelerator.broadcast_from_leader(outcomes)
        if self.scores_rewards:
            return
        for job, (kind, value) in zip(generation.jobs, shared):
            _, future, _ = job.result()
            if kind == "ok":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(f"the sequence-parallel group's leader: {value}"))

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowgrpo-decode",
                                            initializer=limit_worker_threads)
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _decode_and_submit(self, final: torch.Tensor, prompts: list[str], columns: dict):
        """Decode one micro-batch (once) and hand it to the reward pool; returns (images, reward future, seconds)."""
        args = self.args
        height, width = args.image_size
        tic = self.clock()
        # Grad mode and autocast are thread-local: set them here too (this may run in the decode thread).
        with torch.no_grad(), self.accelerator.autocast():
            final = final.to(self.policy.dtype)
            pil = to_pil(decode_in_slices(self.adapter.decode, final, height, width, args.vae_decode_batch_size))
            if self.rewards.audio_rewards and self.scores_rewards:  # the sound too, for the rewards that score it
                columns = {**columns, **audio_columns(self.adapter, final, height, width, args.vae_decode_batch_size)}
        seconds = self.clock() - tic
        if not self.scores_rewards:  # filled with the SP group leader's scores by `_settle_scores`
            return pil, Future(), seconds
        # group-wise rewards (pickscore_rank) give raw scores here; they are combined over whole groups in `score`
        return pil, self.rewards.submit(prompts, pil, defer_groupwise=True, **columns), seconds

    # ------------------------------------------------------------------------------------------------
    # scoring: gathered rewards, advantages, metrics
    # ------------------------------------------------------------------------------------------------
    def defer(self, generation: Generation) -> None:
        """Keep ``generation``'s scoring for `resolve_scoring` (the first training forward overlaps the last
        rewards), or score it now when that overlap is off."""
        self._pending = generation
        if not self.overlap_reward_with_training:
            self.resolve_scoring()

    def resolve_scoring(self) -> None:
        """Score the deferred generation, if any (the wait is added to ``scoring_wait_s``)."""
        if self._pending is None:
            return
        generation, self._pending = self._pending, None
        tic = self.clock()
        self.score(generation)
        self.scoring_wait_s += self.clock() - tic

    def score(self, generation: Generation) -> None:
        """Wait for ``generation``'s rewards; gather them, compute advantages into its records, log metrics."""
        args = self.args
        device = self.accelerator.device
        timing = generation.timing
        tic = self.clock()
        generation.settle()
        decoded, results, reward_error = [], [], None
        for job in generation.jobs:
            pil, reward_future, decode_seconds = job.result()
            decoded.append(pil)
            timing["vae_decode"] += decode_seconds
            try:
                results.append(reward_future.result())
            except Exception as err:  # on_failure="raise": stop every process, after saving the last step
                reward_error = reward_error or err
        timing["reward_wait"] = self.clock() - tic
        if self.on_reward_error is not None:
            self.on_reward_error(reward_error)
        elif reward_error is not None:
            raise reward_error

        def as_tensor(values):
            return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32,
                                device=device)

        names = self.rewards.names
        totals = as_tensor([v for r in results for v in r.total])
        per_reward = {name: as_tensor([v for r in results for v in r.per_reward[name]]) for name in names}
        g_totals = self.accelerator.gather(totals).cpu()
        g_groups = self.strategy.advantage_groups(self.accelerator.gather(generation.group_ids.to(device)).cpu())
        g_per_reward = {n: self.accelerator.gather(t).cpu() for n, t in per_reward.items()}
        n_local, rank = len(generation.prompts), self.accelerator.process_index
        if self.rewards.has_groupwise:  # every group is complete once gathered: combine, recompute the totals
            combined, g_total_list = self.rewards.finish_groupwise(
                {n: t.tolist() for n, t in g_per_reward.items()}, g_groups.tolist())
            g_per_reward = {n: as_tensor(v).cpu() for n, v in combined.items()}
            g_totals = as_tensor(g_total_list).cpu()
            totals = g_totals[rank * n_local:(rank + 1) * n_local]
        advantages, stats = compute_reward_advantages(
            g_totals, g_per_reward, dict(zip(names, self.rewards.weights)), g_groups,
            args.scale_rewards, args.adv_clip_max, args.reward_aggregation,
        )
        if self.constraints is not None:  # reward constraints: the dual step, then the Lagrangian's advantage
            self.constraints.observe_rollouts(g_per_reward)
            terms = ConstraintTerms(dict(self.constraints.multipliers),
                                    {name: g_per_reward[name] for name in self.constraints.names})
            advantages = compute_constrained_advantages(advantages, terms, g_groups, args.scale_rewards,
                                                        args.adv_clip_max)
            generation.constraint_terms = terms
        flat_images = [im for chunk in decoded for im in chunk]
        kl_gate = None
        if self.on_scores is not None:
            advantages, kl_gate = self.on_scores(advantages, g_totals, g_per_reward, g_groups, flat_images,
                                                 stats.reward_mean, generation.step)
        local_adv = advantages[rank * n_local:(rank + 1) * n_local].to(device)
        local_gate = kl_gate[rank * n_local:(rank + 1) * n_local].to(device) if kl_gate is not None else None

        m = self.metrics.train
        m["reward"].append(stats.reward_mean)
        m["reward_std"].append(stats.reward_std)
        m["frac_reward_zero_std"].append(stats.frac_reward_zero_std)
        if self.constraints is not None:
            for key, value in self.constraints.metrics().items():
                m[key].append(value)
        failed = torch.tensor([sum(r.failed.get(n, 0) for r in results) for n in names], dtype=torch.float32,
                              device=device)
        g_failed = self.accelerator.gather(failed).cpu().view(-1, len(names)).sum(0)
        for k, (name, vals) in enumerate(g_per_reward.items()):
            valid = vals[~torch.isnan(vals)]
            m[f"rewards/{name}/mean"].append(float(valid.mean()) if valid.numel() else math.nan)
            m[f"rewards/{name}/std"].append(float(valid.std(unbiased=False)) if valid.numel() else math.nan)
            m[f"rewards/{name}/failed"].append(float(g_failed[k]))  # samples scored None by on_failure="skip"
        # Metrics a reward defines itself (RewardOutput.metrics, e.g. GenEval's accuracy per task), over all processes.
        metric_sums = RewardResult.concatenate(results).metric_sums() if results else {}
        gather_objects = getattr(self.accelerator, "gather_object", gather_object)  # SP: one copy per replica
        for key, mean in metric_means(gather_objects([metric_sums]) if self.accelerator.num_processes > 1
                                      else [metric_sums]).items():
            m[f"rewards/{key}"].append(mean)
        # sampling: the rollout phase (text encoding, sampling, decoding unless it runs in the background);
        # reward: the time spent waiting for decoding and rewards that did not overlap anything.
        m["timing/sampling"].append(timing["sampling_total"])
        m["timing/reward"].append(timing["reward_wait"])
        for key in ("text_encoding", "rollout", "vae_decode"):
            m[f"timing/{key}"].append(timing[key])
        if timing.get("cache_calls"):  # rollout_cache: the hooked block (or attention) computations skipped
            m["rollout/cache_skipped"].append(1.0 - timing["cache_computed"] / timing["cache_calls"])
        self.last_timing = dict(timing)

        shown = args.num_log_images
        self.last_samples = (flat_images[:shown], generation.prompts[:shown], totals.cpu().tolist()[:shown])
        self.last_sample_notes = [note for r in results for note in r.image_notes()][:shown]
        self.strategy.assign_advantages(generation, local_adv, local_gate, g_totals, g_groups)

    def close(self) -> None:
        """Stop the decode thread (a no-op when none was started)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
