"""The benchmark run: full trainer steps, their time breakdown, and the FLOP floor measured alongside.

One run = ``warmup_steps + steps`` optimizer steps of the preset's trainer (``FlowGRPOTrainer`` or, for
``trainer="diffusion_nft"`` presets, ``DiffusionNFTTrainer``) ``.train()`` on a preset (see
:mod:`flowgrpo.benchmarking.presets`). After every step a callback times the **floor**: the bare transformer passes
that step needed, with the same number and shapes (the rollout's ``micro-batches x inference steps`` no-grad
forwards of ``micro-batch`` rows, doubled with classifier-free guidance; the training's ``micro-batches x trained
steps`` forward + backward passes; the reference forwards when ``beta > 0``; for DiffusionNFT the trained noise
levels and one old-policy forward each), on the same model (LoRA included),
dtype, autocast and thread count, with random inputs and nothing else around them. Interleaving floor and step
measurements makes their ratio robust to a machine whose load drifts. The floor's time is not counted in the step.

Reported (medians over the measured steps): ``step_time_s``, ``images_per_s``, ``peak_memory_mb``, ``breakdown``
(text encoding, rollout, VAE decode, exposed reward wait, training forward, training backward, optimizer, other),
``floor_time_s`` and ``overhead_ratio = step_time_s / floor_time_s``, plus the analytic transformer FLOPs of a step
(:mod:`flowgrpo.benchmarking.flops`) and the FLOP/s achieved by the step and by the floor.

With ``thread_speedup`` (CPU, a main thread on 2 or more torch threads), after the measured steps the floor's passes
are timed again with the main thread at one thread and at its plan's count, alternating, nothing in the background:
``floor_thread_speedup`` = {phase: median at 1 thread / median at N threads} for the rollout and the training passes.
From it, ``overhead_bound`` is the least ``overhead_ratio`` that any split of the cores reaching the floor's
N-thread speed can have, from the background's work alone: while a background task (decode, reward) holds one core
the main thread's passes run at most at one thread's speed, so each of its core-seconds ``b`` costs the main thread
at least ``b * (1 - 1 / s)`` seconds, ``s`` the smaller of the two speed-ups::

    overhead_bound = 1 + (reward_compute_s + vae_decode_s) * (1 - 1 / s) / floor_time_s
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from transformers import TrainerCallback

from ..cpu_threads import ThreadTimeline, current_cpu_thread_plan, fixed_main_threads
from .flops import step_flops, transformer_forward_flops
from .presets import OCR_PROMPTS, BenchmarkPreset, build_preset_pipeline, check_device, get_preset

__all__ = ["run_benchmark", "format_report", "measure_thread_speedup", "overhead_bound", "AB_CHOICES", "BREAKDOWN_KEYS",
           "PASS_SETTINGS", "RESULT_KEYS", "compare_timesteps_per_pass"]

BREAKDOWN_KEYS = ("text_encoding", "rollout", "vae_decode", "reward", "training_forward", "training_backward",
                  "optimizer", "other")
RESULT_KEYS = ("step_time_s", "images_per_s", "peak_memory_mb", "breakdown", "floor_time_s", "overhead_ratio")

# trainer metric -> breakdown key (summed over the step's micro-steps)
_TRAINER_TIMINGS = {
    "timing/text_encoding": "text_encoding",
    "timing/rollout": "rollout",
    "timing/vae_decode": "vae_decode",
    "timing/reward": "reward",
    "timing/training_forward": "training_forward",
    "timing/training_backward": "training_backward",
}


# ``--ab NAME``: the rollout engine's overlaps switched on and off on alternate measured steps, to measure what they
# buy (attributes of ``trainer.rollouts``).
AB_SWITCHES = {
    "decode": ("overlap_decode",),
    "reward": ("overlap_reward_with_training",),
    "all": ("overlap_decode", "overlap_reward_with_training"),
}
# ``--ab NAME``: a training setting given its "on" and "off" values on alternate measured steps (attributes of
# ``trainer.args``, read afresh by every micro-batch; the floor follows the step's setting).
AB_SETTINGS = {
    "timesteps_per_pass": ("train_timesteps_per_pass", "all", 1),
}
AB_CHOICES = (*AB_SWITCHES, *AB_SETTINGS)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedReward:
    """Wraps a reward function to add up the time spent inside it (it runs in the reward thread, overlapped)."""

    def __init__(self, fn: Callable, sink: list[float], lock: threading.Lock):
        self.fn, self.sink, self.lock = fn, sink, lock
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any):
        tic = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            with self.lock:
                self.sink.append(time.perf_counter() - tic)

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


class FloorRunner:
    """Times the bare transformer passes of one optimizer step of ``trainer`` (see the module docstring)."""

    def __init__(self, trainer, seed: int = 1234):
        args = trainer.args
        self.trainer = trainer
        self.device = trainer.accelerator.device
        self.adapter = trainer.adapter
        self.height, self.width = args.image_size
        self.cfg = self.adapter.uses_cfg(args.guidance_scale)
        # A pass with the doubled batch and no guidance arithmetic; a guidance-embedding model keeps its scale.
        self.pass_guidance = 1.0 if self.cfg else args.guidance_scale
        micro = args.per_device_train_batch_size
        self.rows = micro * (2 if self.cfg else 1)
        self.micro_batches = args.steps_per_generation
        self.rollout_calls = self.micro_batches * args.num_inference_steps
        # the trained timesteps and the forwards without gradient each adds, as the algorithm's spec plans them
        # (DiffusionNFT: num_trained_timesteps noise levels, each with a forward of the old policy too)
        planned = trainer.algorithm.step
        self.old_policy = trainer.policy.old_policy
        self.trained_steps = planned.trained_timesteps
        self.reads_reference = "reference" in planned.frozen_forwards
        self.reads_old_policy = "old_policy" in planned.frozen_forwards
        self.num_iterations = args.num_iterations

        dtype = trainer.policy.dtype
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            source = None  # editing families: a plain source image of the working size
            if self.adapter.accepts_images and not self.adapter.images_optional:
                from PIL import Image

                source = [Image.new("RGB", (self.width, self.height), (128, 128, 128))]
            shapes = self.adapter.encode_prompts(["a"], args.max_sequence_length, self.device, images=source,
                                                 height=self.height, width=self.width)
        from ..models import PromptEmbeds

        # Random embeddings of the real shapes; masks and ids (integer tensors) keep their real values.
        self.embeds = PromptEmbeds({
            k: (torch.randn((self.rows, *v.shape[1:]), generator=gen).to(self.device, dtype) if v.is_floating_point()
                else v[:1].expand(self.rows, *v.shape[1:]).to(self.device))
            for k, v in shapes.tensors.items()
        })
        self.latents = self.adapter.prepare_latents(self.rows, self.height, self.width, gen, torch.device("cpu"),
                                                    torch.float32).to(self.device, dtype)
        self.timestep = torch.full((self.rows,), 500.0, device=self.device)
        self.image_tokens, self.text_tokens = self.adapter.sequence_lengths(self.embeds, self.latents)
        self.audio_tokens = self.adapter.audio_sequence_length(self.latents)

    @property
    def timesteps_per_pass(self) -> int:
        """K of the trainer's current ``train_timesteps_per_pass``: the trained timesteps stacked into one pass."""
        from ..trainer.timestep_passes import resolved_timesteps_per_pass

        return resolved_timesteps_per_pass(self.trainer.args.train_timesteps_per_pass, self.trained_steps)

    @property
    def train_calls(self) -> int:
        """Trained passes of a step: ceil(trained steps / K) per micro-batch and pass over the generation."""
        passes = -(-self.trained_steps // self.timesteps_per_pass)
        return self.micro_batches * passes * self.num_iterations

    @property
    def ref_calls(self) -> int:
        return self.train_calls if self.reads_reference else 0

    @property
    def old_calls(self) -> int:
        return self.train_calls if self.reads_old_policy else 0

    def _pass(self, model, copies: int = 1):
        """One transformer pass over the micro-batch's rows, or over ``copies`` of them stacked (a trained pass of K
        timesteps)."""
        if copies == 1:
            latents, timestep, embeds = self.latents, self.timestep, self.embeds
        else:
            latents, timestep = torch.cat([self.latents] * copies), torch.cat([self.timestep] * copies)
            embeds = self.embeds.index_select(torch.arange(self.rows).repeat(copies))
        return self.adapter.predict_velocity(model, latents, timestep, embeds, self.pass_guidance, None, self.height,
                                             self.width)

    def measure(self) -> dict[str, float]:
        trainer = self.trainer
        model = trainer.model
        accelerator = trainer.accelerator
        was_training = model.training
        params = trainer.policy.trainable_parameters()
        saved_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        _sync(self.device)
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad(), accelerator.autocast():
            for _ in range(self.rollout_calls):
                self._pass(model)
        _sync(self.device)
        t1 = time.perf_counter()
        model.train()
        copies = self.timesteps_per_pass  # the last pass of an uneven split is timed at full size
        for _ in range(self.train_calls):
            with accelerator.autocast():
                out = self._pass(model, copies)
            out.float().square().mean().backward()
            if self.old_calls:
                with torch.no_grad(), accelerator.autocast(), self.old_policy.forward_model(model) as old:
                    self._pass(old, copies)
            if self.ref_calls:
                ctx = accelerator.unwrap_model(model).disable_adapter() if trainer.is_peft else nullcontext()
                ref_model = model if trainer.is_peft else trainer.policy.reference_copy
                with torch.no_grad(), accelerator.autocast(), ctx:
                    self._pass(ref_model, copies)
        _sync(self.device)
        t2 = time.perf_counter()
        for p, g in zip(params, saved_grads):
            p.grad = g
        model.train(was_training)
        return {"rollout": t1 - t0, "training": t2 - t1, "total": t2 - t0}


#: the settings of ``train_timesteps_per_pass`` the training phase is compared at (``--compare-timesteps-per-pass``)
PASS_SETTINGS = (1, "all")


def compare_timesteps_per_pass(trainer: Any, rounds: int = 1) -> dict[str, Any]:
    """The training phase of one optimizer step (forward + backward of every micro-batch of a generation: the
    trainer's own ``_train_on_batch``) at each ``train_timesteps_per_pass`` of :data:`PASS_SETTINGS`, on one fresh
    generation sampled by the trainer's current weights, the settings alternating for ``rounds`` rounds. Each arm
    records its seconds, its peak allocated memory and, for Flow-GRPO, its first-pass max |ratio - 1|: on-policy,
    since nothing changes the weights after that generation is sampled (no optimizer step; the gradients are
    dropped after each arm), so at K = all it is what stacking K timesteps into one batch does to the ratio on
    this device's kernels. Nothing else runs meanwhile (the rewards of that generation are scored before the first
    arm is timed), so the arms differ only in how the trained timesteps are grouped."""
    from ..trainer.timestep_passes import passes_of

    device = trainer.accelerator.device
    cuda = device.type == "cuda"

    model = trainer.model_wrapped
    setting_before = trainer.args.train_timesteps_per_pass
    inputs = next(iter(trainer.get_train_dataloader()))  # one generation's rows of this process
    records = trainer._generate(inputs)
    trainer.rollouts.resolve_scoring()  # the rewards, scored in the background, before anything is timed
    arms: dict[str, dict[str, Any]] = {str(k): {"training_s": [], "peak_allocated_mib": None,
                                                "on_policy_ratio_max_dev": None} for k in PASS_SETTINGS}
    parts = trainer._loss_parts(trainer._prepare_batch(records[0]))
    try:
        for round_index in range(rounds):
            order = PASS_SETTINGS if round_index % 2 == 0 else tuple(reversed(PASS_SETTINGS))
            for setting in order:
                arm = arms[str(setting)]
                trainer.args.train_timesteps_per_pass = setting
                trainer.metrics.train.clear()
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                tic = time.perf_counter()
                for record in records:
                    trainer._train_on_batch(model, record, True)
                _sync(device)
                arm["training_s"].append(time.perf_counter() - tic)
                arm["passes_per_micro_batch"] = len(passes_of(parts, setting))
                if cuda:
                    arm["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                drift = trainer.metrics.train.get("on_policy_ratio_max_dev")
                if drift:
                    arm["on_policy_ratio_max_dev"] = max(drift)
    finally:
        trainer.args.train_timesteps_per_pass = setting_before
        model.zero_grad(set_to_none=True)
        trainer.metrics.train.clear()
    medians = {k: _median(a["training_s"]) for k, a in arms.items()}
    first, last = (str(k) for k in PASS_SETTINGS)
    return {"micro_batches": len(records), "trained_timesteps": parts, "rounds": rounds, "arms": arms,
            "training_s": medians, "speedup": medians[first] / medians[last] if medians[last] else None}


class _BenchmarkClock(TrainerCallback):
    """Step times (between consecutive step ends, the floor excluded), the trainer's timings, optimizer time."""

    def __init__(self, trainer, floor: bool, reward_times: list[float], reward_lock: threading.Lock,
                 ab: str | None = None, on_record: Callable[[dict[str, Any]], None] | None = None):
        self.trainer = trainer
        self.on_record = on_record
        self.ab_switches = AB_SWITCHES[ab] if ab in AB_SWITCHES else ()
        self.ab_setting = AB_SETTINGS.get(ab) if ab else None
        self.floor_enabled = floor
        self.floor: FloorRunner | None = None
        self.reward_times, self.reward_lock = reward_times, reward_lock
        self.records: list[dict[str, Any]] = []
        self._t_last = 0.0
        self._t_opt = 0.0
        self._optimizer = 0.0
        # Where the main thread yields to the background: its thread count against the busy background tasks.
        plan = current_cpu_thread_plan()
        self.timeline = ThreadTimeline() if plan is not None and plan.yield_to_background else None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer.accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.timeline is not None:
            self.timeline.start()
        self._t_last = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self.timeline is not None:
            self.timeline.stop()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        _sync(self.trainer.accelerator.device)
        self._t_opt = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        _sync(self.trainer.accelerator.device)
        self._optimizer += time.perf_counter() - self._t_opt

    def on_step_end(self, args, state, control, **kwargs):
        device = self.trainer.accelerator.device
        _sync(device)
        now = time.perf_counter()
        metrics = self.trainer.metrics.train
        record: dict[str, Any] = {"step": state.global_step, "step_time_s": now - self._t_last}
        parts = {key: 0.0 for key in BREAKDOWN_KEYS}
        for metric, key in _TRAINER_TIMINGS.items():
            parts[key] = float(sum(metrics.get(metric, []) or [0.0]))
        parts["optimizer"] = self._optimizer
        if self.trainer.rollouts.overlap_decode:  # decoded in the background: its wait is part of "reward"
            record["vae_decode_background_s"] = parts["vae_decode"]
            parts["vae_decode"] = 0.0
        if self.ab_switches:
            record["ab_arm"] = "on" if getattr(self.trainer.rollouts, self.ab_switches[0]) else "off"
        if self.ab_setting:
            name, on_value, _ = self.ab_setting
            record["ab_arm"] = "on" if getattr(self.trainer.args, name) == on_value else "off"
        parts["other"] = record["step_time_s"] - sum(v for k, v in parts.items() if k != "other")
        record["breakdown"] = parts
        record["sampling_s"] = float(sum(metrics.get("timing/sampling", []) or [0.0]))
        record["training_s"] = float(sum(metrics.get("timing/training", []) or [0.0]))
        with self.reward_lock:
            record["reward_compute_s"] = float(sum(self.reward_times))
            self.reward_times.clear()
        if self.timeline is not None:
            record["thread_timeline_s"] = self.timeline.take()
        self._optimizer = 0.0
        if self.floor_enabled:
            if self.floor is None:
                self.floor = FloorRunner(self.trainer)
            record["floor"] = self.floor.measure()
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        if self.ab_switches:  # the next step: "on" on even step numbers, "off" on odd ones
            for name in self.ab_switches:
                setattr(self.trainer.rollouts, name, (state.global_step + 1) % 2 == 0)
        if self.ab_setting:
            name, on_value, off_value = self.ab_setting
            setattr(self.trainer.args, name, on_value if (state.global_step + 1) % 2 == 0 else off_value)
        _sync(device)
        if self.timeline is not None:
            self.timeline.reset()  # the floor measurement is not part of the next step
        self._t_last = time.perf_counter()


def _main_thread_torch_threads() -> int:
    """The main thread's torch threads when nothing runs in the background: its plan's, else torch's now."""
    plan = current_cpu_thread_plan()
    return plan.torch_threads if plan is not None else torch.get_num_threads()


def measure_thread_speedup(floor: FloorRunner, threads: int, rounds: int = 2) -> dict[str, Any]:
    """The floor's passes at one thread and at ``threads`` torch threads for the main thread, alternating ``rounds``
    times each, nothing in the background: {phase: median time at 1 / median time at ``threads``} for ``rollout``,
    ``training`` and ``total``, with the medians in seconds."""
    times: dict[int, list[dict[str, float]]] = {1: [], threads: []}
    for _ in range(rounds):
        for n in (1, threads):
            with fixed_main_threads(n):
                times[n].append(floor.measure())
    out: dict[str, Any] = {"threads": threads, "rounds": rounds}
    for phase in ("rollout", "training", "total"):
        one, many = _median([t[phase] for t in times[1]]), _median([t[phase] for t in times[threads]])
        out[phase] = one / many
        out[f"{phase}_s"] = {"1": one, str(threads): many}
    return out


def overhead_bound(overlapped: dict[str, float], floor_time_s: float, speedup: dict[str, Any]) -> float:
    """The least overhead ratio any core split can reach from the background's work alone (module docstring)."""
    s = min(speedup["rollout"], speedup["training"])
    background = overlapped["reward_compute_s"] + overlapped["vae_decode_s"]
    return 1.0 + background * max(0.0, 1.0 - 1.0 / s) / floor_time_s


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "rss"  # Linux: kilobytes


def _machine() -> dict[str, Any]:
    from ..cpu_threads import current_cpu_thread_plan

    plan = current_cpu_thread_plan()
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "thread_plan": plan.describe() if plan is not None else "none (torch's and onnxruntime's own settings)"}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    import diffusers
    import transformers

    info["versions"] = {"torch": torch.__version__, "diffusers": diffusers.__version__,
                        "transformers": transformers.__version__}
    return info


def build_trainer(preset: BenchmarkPreset, max_steps: int, output_dir: str, seed: int = 0):
    """The preset's trainer (``preset.trainer``) on its random-weight pipeline, LoRA, OCR prompts; nothing saved or
    reported."""
    from datasets import Dataset
    from peft import LoraConfig

    from ..models import family_adapter_class
    from ..trainer.registry import config_class, trainer_class

    pipeline = build_preset_pipeline(preset, seed=seed)
    args = config_class(preset.trainer)(
        output_dir=output_dir, report_to=[], max_steps=max_steps, save_strategy="no", logging_steps=1,
        disable_tqdm=True, log_images_steps=0, seed=seed, **preset.config_kwargs(),
    )
    lora = LoraConfig(r=preset.lora_rank, lora_alpha=2 * preset.lora_rank, init_lora_weights="gaussian",
                      target_modules=list(preset.lora_targets))
    if preset.architecture == "toy":
        from ..toy.build import read_prompts

        prompts = read_prompts(pipeline.name_or_path, "train")
    else:
        prompts = OCR_PROMPTS[: max(preset.num_prompts, min(len(OCR_PROMPTS), 2 * preset.num_prompts))]
    reward = preset.reward if isinstance(preset.reward, str) else list(preset.reward)
    columns = {"prompt": prompts}
    adapter_cls = family_adapter_class(pipeline)
    if adapter_cls.accepts_images and not adapter_cls.images_optional:  # editing / image-to-video: a plain source
        from PIL import Image

        columns["image"] = [Image.new("RGB", (args.image_size[1], args.image_size[0]), (128, 128, 128))] * len(prompts)
    return trainer_class(preset.trainer)(model=pipeline, reward_funcs=reward, args=args,
                                         train_dataset=Dataset.from_dict(columns), peft_config=lora)


def run_benchmark(preset: str | BenchmarkPreset, steps: int | None = None, *, warmup_steps: int | None = None,
                  threads: str | int | None = None, torch_threads: int | None = None, measure_floor: bool = True,
                  seed: int = 0, ab: str | None = None, output_dir: str | None = None,
                  thread_speedup: bool = False, passes_rounds: int = 0, log: Callable[[str], None] | None = print,
                  trainer_builder: Callable[..., Any] | None = None,
                  on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return its results as a JSON-ready dict (see the module docstring).

    ``threads`` is the trainer's ``cpu_threads`` (``"auto"``: the thread policy, ``"keep"``: no policy, or the main
    thread's count; default: the preset's). ``torch_threads`` sets torch's process-wide intra-op threads before
    anything is built: with ``threads="keep"`` it reproduces a fixed setting such as ``OMP_NUM_THREADS=N``.
    ``thread_speedup`` also times the floor at one thread and at the main thread's count (``floor_thread_speedup``,
    ``overhead_bound``; see the module docstring). ``passes_rounds`` > 0 then times one more generation's training
    phase at ``train_timesteps_per_pass`` 1 and ``all``, that many rounds each, alternating
    (:func:`compare_timesteps_per_pass`; ``timesteps_per_pass`` in the result).

    ``trainer_builder(preset, max_steps, output_dir, seed=seed)`` replaces :func:`build_trainer` (a trainer made
    from a recipe, say; ``preset`` then only describes the run for the report and the FLOP count), and
    ``on_step(record)`` receives each step's record as soon as the step ends (to keep partial results of a run that
    may be stopped).
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    check_device(preset)
    steps = preset.default_steps if steps is None else int(steps)
    warmup = preset.warmup_steps if warmup_steps is None else int(warmup_steps)
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup_steps >= 0, got steps={steps}, warmup_steps={warmup}.")
    if ab is not None and (ab not in AB_CHOICES or not measure_floor):
        raise ValueError(f"ab={ab!r} must be one of {', '.join(AB_CHOICES)} and needs the floor measurement.")
    if thread_speedup and (preset.device != "cpu" or not measure_floor):
        raise ValueError(f"thread_speedup times the floor on a CPU at two thread counts: it needs a CPU preset (got "
                         f"{preset.name!r} on {preset.device}) and the floor measurement (drop --no-floor).")
    if threads is not None:
        from dataclasses import replace

        from ..cpu_threads import parse_cpu_threads

        preset = replace(preset, threads=parse_cpu_threads(threads, "threads"))
    if torch_threads is not None:
        if int(torch_threads) < 1:
            raise ValueError(f"torch_threads={torch_threads} must be >= 1.")
        torch.set_num_threads(int(torch_threads))
    say = log or (lambda _msg: None)

    tmp = tempfile.TemporaryDirectory(prefix="flowgrpo-bench-") if output_dir is None else None
    try:
        t_build = time.perf_counter()
        say(f"[benchmark] building preset {preset.name!r} ({preset.description})")
        trainer = (trainer_builder or build_trainer)(preset, warmup + steps, output_dir or tmp.name, seed=seed)
        build_s = time.perf_counter() - t_build
        main_threads = _main_thread_torch_threads()
        if thread_speedup and main_threads < 2:
            raise ValueError(f"thread_speedup compares the main thread at 1 and at its own thread count, but this "
                             f"run gives it {main_threads} torch thread; give it more (threads=2, or "
                             f"FLOWGRPO_CPU_THREADS=2 with a model that gets every core) or drop thread_speedup.")
        reward_times: list[float] = []
        lock = threading.Lock()
        reward_set = trainer.reward_set
        reward_set.funcs = [_TimedReward(f, reward_times, lock) for f in reward_set.funcs]
        trainer.rollouts.timing_sync = trainer.accelerator.device.type == "cuda"
        clock = _BenchmarkClock(trainer, measure_floor, reward_times, lock, ab=ab, on_record=on_step)
        trainer.add_callback(clock)
        say(f"[benchmark] built in {build_s:.1f}s; running {warmup} warm-up + {steps} measured steps")
        trainer.train()
        device = trainer.accelerator.device
        peak_mb, peak_kind = _peak_memory_mb(device)
        result = _summarize(preset, trainer, clock, warmup, steps, build_s)
        result["peak_memory_mb"], result["peak_memory_kind"] = peak_mb, peak_kind
        if thread_speedup:
            say(f"[benchmark] timing the floor at 1 and {main_threads} threads")
            speedup = measure_thread_speedup(clock.floor, main_threads)
            result["floor_thread_speedup"] = speedup
            result["overhead_bound"] = overhead_bound(result["overlapped"], result["floor_time_s"], speedup)
        if passes_rounds > 0:
            say(f"[benchmark] timing the training phase at train_timesteps_per_pass {PASS_SETTINGS[0]} and "
                f"{PASS_SETTINGS[1]}, {passes_rounds} rounds")
            result["timesteps_per_pass"] = compare_timesteps_per_pass(trainer, passes_rounds)
        reward_set.close()
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def _summarize(preset: BenchmarkPreset, trainer, clock: _BenchmarkClock, warmup: int, steps: int,
               build_s: float) -> dict[str, Any]:
    records = clock.records[warmup:]
    if not records:
        raise RuntimeError(f"The run recorded {len(clock.records)} steps, none after the {warmup} warm-up steps.")
    step_times = [r["step_time_s"] for r in records]
    step_time = _median(step_times)
    breakdown = {k: _median([r["breakdown"][k] for r in records]) for k in BREAKDOWN_KEYS}
    result: dict[str, Any] = {
        "preset": preset.name,
        "description": preset.description,
        "device": str(trainer.accelerator.device),
        "dtype": preset.dtype,
        "steps": steps,
        "warmup_steps": warmup,
        "images_per_step": preset.images_per_step,
        "step_time_s": step_time,
        "step_times_s": step_times,
        "images_per_s": preset.images_per_step / step_time,
        "breakdown": breakdown,
        "overlapped": {
            "reward_compute_s": _median([r["reward_compute_s"] for r in records]),
            "vae_decode_s": _median([r.get("vae_decode_background_s", 0.0) for r in records]),
            "sampling_s": _median([r["sampling_s"] for r in records]),
            "training_s": _median([r["training_s"] for r in records]),
        },
        "build_time_s": build_s,
        "machine": _machine(),
    }
    timelines = [r["thread_timeline_s"] for r in records if "thread_timeline_s" in r]
    if timelines:  # mean seconds per measured step in each (main threads, busy background tasks) state
        keys = sorted({k for t in timelines for k in t})
        result["thread_timeline_s"] = {k: sum(t.get(k, 0.0) for t in timelines) / len(timelines) for k in keys}
    transformer = trainer.accelerator.unwrap_model(trainer.model)
    result["parameters"] = {
        "transformer": sum(p.numel() for n, p in transformer.named_parameters() if "lora_" not in n),
        "trainable": sum(p.numel() for p in trainer.policy.trainable_parameters()),
    }
    floor = clock.floor
    if floor is not None:
        floors = [r["floor"]["total"] for r in records]
        floor_time = _median(floors)
        result["floor_time_s"] = floor_time
        result["floor_times_s"] = floors
        result["floor_breakdown"] = {k: _median([r["floor"][k] for r in records]) for k in ("rollout", "training")}
        result["overhead_ratio"] = step_time / floor_time
        result["overhead_ratio_per_step"] = [s / f for s, f in zip(step_times, floors)]
        args = trainer.args
        config = trainer.pipeline.transformer.config
        fwd = transformer_forward_flops(preset.family, config, floor.image_tokens, floor.text_tokens,
                                        preset.lora_rank, list(preset.lora_targets), audio_tokens=floor.audio_tokens)
        flops = step_flops(fwd, micro_batches=floor.micro_batches, micro_batch_size=args.per_device_train_batch_size,
                           num_inference_steps=args.num_inference_steps,
                           trained_steps=floor.trained_steps * args.num_iterations, cfg=floor.cfg, beta=args.beta,
                           full_finetune=not trainer.is_peft,
                           gradient_checkpointing=bool(preset.gradient_checkpointing),
                           old_policy=floor.old_policy is not None)
        result["flops"] = {**flops.as_dict(), "image_tokens": floor.image_tokens, "text_tokens": floor.text_tokens}
        if floor.audio_tokens:
            result["flops"]["audio_tokens"] = floor.audio_tokens
        result["achieved_flops_per_s"] = flops.total / step_time
        result["floor_flops_per_s"] = flops.total / floor_time
        if clock.ab_switches or clock.ab_setting:
            result["ab"] = {"switches": list(clock.ab_switches) if clock.ab_switches else
                            [f"{clock.ab_setting[0]}: {clock.ab_setting[1]} (on) / {clock.ab_setting[2]} (off)"]}
            for arm in ("on", "off"):
                rs = [r for r in records if r.get("ab_arm") == arm]
                st, fl = _median([r["step_time_s"] for r in rs]), _median([r["floor"]["total"] for r in rs])
                per_step = [r["step_time_s"] / r["floor"]["total"] for r in rs]
                # Each step against its own floor (robust to load changes between steps), then the median.
                result["ab"][arm] = {
                    "steps": len(rs), "step_time_s": st, "floor_time_s": fl, "overhead_ratio": _median(per_step),
                    "overhead_ratio_per_step": per_step,
                    "breakdown": {k: _median([r["breakdown"][k] for r in rs]) for k in BREAKDOWN_KEYS},
                    # forward + backward per optimizer step, and the floor's trained passes, step by step
                    "training_phase_s": [r["breakdown"]["training_forward"] + r["breakdown"]["training_backward"]
                                         for r in rs],
                    "floor_training_s": [r["floor"]["training"] for r in rs],
                }
    else:
        result["floor_time_s"] = None
        result["overhead_ratio"] = None
    return result


def format_report(result: dict[str, Any]) -> str:
    """A plain-text table of a :func:`run_benchmark` result."""
    lines = [f"preset {result['preset']} on {result['device']} ({result['dtype']}), {result['steps']} measured "
             f"steps after {result['warmup_steps']} warm-up, {result['machine']['torch_threads']} torch threads"]

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<26} {value}")

    row("step_time_s (median)", f"{result['step_time_s']:.3f}")
    row("images_per_s", f"{result['images_per_s']:.3f}")
    row("peak_memory_mb", f"{result['peak_memory_mb']:.0f} ({result.get('peak_memory_kind', '')})")
    if result.get("floor_time_s"):
        row("floor_time_s (median)", f"{result['floor_time_s']:.3f}  (rollout "
            f"{result['floor_breakdown']['rollout']:.3f}, training {result['floor_breakdown']['training']:.3f})")
        row("overhead_ratio", f"{result['overhead_ratio']:.3f}  (per step: "
            + ", ".join(f"{r:.3f}" for r in result["overhead_ratio_per_step"]) + ")")
        row("transformer TFLOP / step", f"{result['flops']['total'] / 1e12:.4f}")
        row("achieved TFLOP/s", f"{result['achieved_flops_per_s'] / 1e12:.4f} (step), "
            f"{result['floor_flops_per_s'] / 1e12:.4f} (floor)")
    lines.append("  breakdown (median s):")
    total = result["step_time_s"]
    for key, value in result["breakdown"].items():
        lines.append(f"    {key:<24} {value:8.3f}  {100 * value / total:5.1f}%")
    ov = result["overlapped"]
    lines.append(f"  in the background: reward compute {ov['reward_compute_s']:.3f} s, VAE decode "
                 f"{ov['vae_decode_s']:.3f} s")
    if result.get("floor_thread_speedup"):
        sp = result["floor_thread_speedup"]
        lines.append(f"  floor at 1 -> {sp['threads']} threads: rollout {sp['rollout']:.2f}x, training "
                     f"{sp['training']:.2f}x faster; overhead_bound {result['overhead_bound']:.3f} (the least "
                     f"overhead_ratio the background's work allows)")
    if "thread_timeline_s" in result:
        states = ", ".join(f"{k} {v:.3f} s" for k, v in result["thread_timeline_s"].items())
        lines.append(f"  main thread's torch threads against busy background tasks (mean s per step): {states}")
    if "timesteps_per_pass" in result:
        passes = result["timesteps_per_pass"]
        t = passes["training_s"]
        lines.append(f"  training phase of one generation ({passes['micro_batches']} micro-batches, "
                     f"{passes['trained_timesteps']} trained timesteps each), median of {passes['rounds']} alternating "
                     f"rounds: train_timesteps_per_pass 1 {t['1']:.3f} s, all {t['all']:.3f} s "
                     f"({passes['speedup']:.3f}x)")
    if "ab" in result:
        ab = result["ab"]
        lines.append(f"  A/B of {', '.join(ab['switches'])} (alternate steps):")
        for arm in ("on", "off"):
            a = ab[arm]
            lines.append(f"    {arm:<4} {a['steps']} steps: step {a['step_time_s']:.3f} s, floor {a['floor_time_s']:.3f} s, "
                         f"median per-step overhead_ratio {a['overhead_ratio']:.3f}  (reward wait "
                         f"{a['breakdown']['reward']:.3f} s, decode {a['breakdown']['vae_decode']:.3f} s, training "
                         f"forward + backward {_median(a['training_phase_s']):.3f} s, its floor "
                         f"{_median(a['floor_training_s']):.3f} s)")
    return "\n".join(lines)
