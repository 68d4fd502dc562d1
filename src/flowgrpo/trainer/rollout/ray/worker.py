"""The Ray actors of the rollout backend: `RolloutWorker` (samples), `RewardWorker` (scores) and `RolloutCoordinator`
(the latest weights and how often each worker was born).

`RolloutWorker` holds its own pipeline (loaded from the trainer's model path, or a pipeline the trainer put in the
object store), a `Policy` with the trainer's LoRA configuration, and a `RolloutEngine` running the algorithm's own
`RolloutStrategy` with a single-process stand-in for the accelerator (`SingleProcessAccelerator`: the device, the
trainer's mixed precision, identity gathers). One request is one training process's share of one generation: the
worker sets the stand-in's process index to the requesting rank and calls `RolloutEngine.generate` unchanged, so the
noise comes from the same (seed, generation, process) generator, drawn micro-batch after micro-batch, as on that rank,
the SDE window from (seed, generation), the same-noise groups from (seed, generation, group). Where a share is sampled
does not change what is sampled.

Each micro-batch is streamed back as soon as it is decoded (a Ray streaming generator): the record the algorithm keeps
(float32 latents, log-probs, timesteps, the prompt embeddings), the decoded images or frames, the columns the engine
adds for the rewards (the sound), and the weights version that sampled it. Ray runs one call of an actor at a time, so
a weight load never lands in the middle of a request: every sample of a request has one version.

A worker killed mid-request is restarted by Ray (``max_restarts``); its constructor runs again, registers a new
incarnation with the coordinator and loads the latest weights the coordinator holds, and the trainer samples the lost
request again with its own seeds.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RewardWorker", "RolloutCoordinator", "RolloutRequest", "RolloutWorker", "SingleProcessAccelerator",
           "WorkerSpec", "move_to", "rollout_fingerprint"]


def move_to(value: Any, device: torch.device | str) -> Any:
    """``value`` (a tensor, `PromptEmbeds`, or a dict / list / tuple of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if hasattr(value, "tensors") and hasattr(value, "to") and hasattr(value, "index_select"):  # PromptEmbeds
        return value.to(device)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    return value


class SingleProcessAccelerator:
    """What `Policy` and `RolloutEngine` read of an ``accelerate.Accelerator``, for one process that samples alone:
    ``device``, ``autocast()`` (the trainer's mixed precision), ``process_index`` (set to the requesting rank for each
    request), ``num_processes = 1``, identity ``gather`` and ``unwrap_model``."""

    num_processes = 1
    is_main_process = True

    def __init__(self, device: torch.device | str, mixed_precision: str = "no"):
        self.device = torch.device(device)
        self.mixed_precision = mixed_precision
        self.process_index = 0

    def autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def rollout_fingerprint(engine: Any) -> dict[str, Any]:
    """The settings a rollout and its replay in the loss must share (a peer's pitfall: a replay with another guidance,
    eta or shift): the sampling settings of the configuration and the noise levels the engine's scheduler gives the
    rollout's steps. The trainer compares its own with every worker's at start."""
    args = engine.args
    height, width = args.image_size
    scheduler = engine.scheduler
    engine.adapter.set_timesteps(scheduler, args.num_inference_steps, height, width, torch.device("cpu"))
    names = ("num_inference_steps", "guidance_scale", "noise_level", "sde_type", "sde_window_size",
             "sde_window_range", "sde_window_strategy", "ode_solver", "ode_compression_ratio", "sampler",
             "height", "width", "num_frames", "max_sequence_length", "negative_prompt", "seed",
             "per_device_train_batch_size", "same_noise_per_group", "base_model_tail_steps", "torch_compile",
             "rollout_cache", "rollout_cache_config")
    settings = {name: getattr(args, name, None) for name in names}
    settings["sde_window_range"] = list(settings["sde_window_range"] or []) or None
    settings["sigmas"] = [round(float(s), 7) for s in scheduler.sigmas.tolist()]
    settings["strategy"] = type(engine.strategy).__name__
    settings["scheduler"] = {k: v for k, v in dict(scheduler.config).items()
                             if isinstance(v, (int, float, str, bool, type(None)))}
    return settings


@dataclass
class WorkerSpec:
    """What a `RolloutWorker` is built from (pickled once by the trainer; Ray keeps it to rebuild a restarted worker).

    ``model``: the trainer's model path, or an ``ObjectRef`` of a pipeline it put in the object store. ``args``: the
    trainer's configuration (its generation settings resolved; ``dtype`` set to the trainer's resolved one).
    ``strategy``: the algorithm's `RolloutStrategy` (settings only).
    """

    name: str
    model: Any
    args: Any
    peft_config: Any
    pipeline_kwargs: dict | None
    strategy: Any
    device: str = "cpu"
    mixed_precision: str = "no"
    uses_old_policy: bool = False
    reference_own_adapter: bool = False
    keep_reference_copy: bool = False
    include_reference: bool = False
    audio_rewards: list[str] = field(default_factory=list)
    torch_threads: int | None = None


@dataclass
class RolloutRequest:
    """One training process's share of one generation: its rows (prompt, group index and the dataset's other
    columns), the optimizer steps done before it (``step``) and the version of the weights it must be sampled with
    (checked by the worker: a request never runs on other weights)."""

    gen_index: int
    process_index: int
    step: int
    rows: list[dict]
    version: int


class _ForwardedRewards:
    """The worker engine's reward set: scoring happens on the trainer (or a `RewardWorker`), so ``submit`` only hands
    back the columns the engine computed for the rewards (the decoded sound, for rewards that score it)."""

    def __init__(self, audio_rewards: list[str]):
        self.audio_rewards = list(audio_rewards)

    def submit(self, prompts, images, *, defer_groupwise: bool = False, **columns):
        from ....rewards.composition import AUDIO_COLUMNS
        from ..generation import done_future

        return done_future({k: v for k, v in columns.items() if k in AUDIO_COLUMNS})


class RolloutWorker:
    """A Ray actor that samples training rollouts (see the module docstring); built by ``ray.remote(RolloutWorker)``.

    Methods (each a Ray call): ``describe()``, ``load_weights(version, digest, state)``, ``reload_latest()``,
    ``sample(request)`` (a streaming generator: one payload per micro-batch, then a final one), ``fingerprint()``.
    """

    def __init__(self, spec: WorkerSpec, coordinator: list):
        """``coordinator``: ``[the run's RolloutCoordinator handle]`` (in a list: Ray then passes the handle itself,
        which a restarted worker uses again)."""
        tic = time.perf_counter()
        import ray

        from ....cpu_threads import apply_cpu_thread_plan, plan_cpu_threads
        from ...data.prompt_cache import setup_prompt_cache
        from ...policy.policy import Policy
        from ...step_metrics import StepMetrics
        from ..engine import RolloutEngine

        self.spec = spec
        self.niceness = _normal_priority()
        self.coordinator = coordinator[0]
        self.name = spec.name
        device = torch.device(spec.device)
        if spec.torch_threads:
            os.environ["FLOWGRPO_CPU_THREADS"] = str(spec.torch_threads)
        args = spec.args
        model = ray.get(spec.model) if isinstance(spec.model, ray.ObjectRef) else spec.model
        if isinstance(model, bytes):  # a pipeline the trainer shipped
            import pickle

            model = pickle.loads(model)
        self.policy = Policy(model, args, spec.peft_config, spec.pipeline_kwargs,
                             keep_reference_copy=spec.keep_reference_copy)
        self.accelerator = SingleProcessAccelerator(device, spec.mixed_precision)
        if not args.quantization:  # a bitsandbytes transformer is placed when it loads and refuses .to()
            self.policy.model.to(device)
        self.policy.attach(self.accelerator, lambda: self.policy.model, lambda: self.policy.model)
        self.policy.place_on_device()
        parameters = sum(p.numel() for m in self.policy.adapter.transformers() for p in m.parameters())
        self.thread_plan = apply_cpu_thread_plan(plan_cpu_threads(args.cpu_threads, on_cpu=device.type == "cpu",
                                                                  model_parameters=parameters))
        self.policy.build_reference(own_adapter=spec.reference_own_adapter)
        self.policy.encode_negative_prompt()
        prompt_cache = setup_prompt_cache(args, self.policy.adapter, self.policy.pipeline, device, (),
                                          self.accelerator.autocast)
        if spec.uses_old_policy:
            self.policy.build_old_policy()
        if args.torch_compile:  # compiled as the trainer compiles them: the same blocks' code samples and trains
            self.policy.compile_blocks(args.torch_compile_backend, args.torch_compile_mode)
        self.engine = RolloutEngine(args, self.policy, spec.strategy, _ForwardedRewards(spec.audio_rewards),
                                    self.accelerator, StepMetrics(), prompt_cache=prompt_cache)
        self.version: int | None = None
        self.digest: str | None = None
        self.loads = 0
        self.incarnation = ray.get(self.coordinator.register.remote(self.name))
        latest = ray.get(self.coordinator.latest_weights.remote())
        if latest is not None:  # a restarted worker: the current weights, before any request reaches it
            version, digest, holder = latest
            self.load_weights(version, digest, ray.get(holder[0]))
        self.startup_s = time.perf_counter() - tic

    # ---- what the trainer asks -------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "pid": os.getpid(), "incarnation": self.incarnation, "version": self.version,
                "digest": self.digest, "loads": self.loads, "device": str(self.accelerator.device),
                "torch_threads": torch.get_num_threads(), "startup_s": self.startup_s, "node": _node_address(),
                "niceness": self.niceness}

    def fingerprint(self) -> dict[str, Any]:
        return rollout_fingerprint(self.engine)

    def load_weights(self, version: int, digest: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Load ``state`` and answer with the version and the digest of what the policy now holds (read back from its
        own tensors); the trainer compares both with what it sent."""
        from .weights import load_policy_state, policy_state_digest

        load_policy_state(self.policy, state, include_reference=self.spec.include_reference)
        self.version = int(version)
        self.digest = policy_state_digest(self.policy, include_reference=self.spec.include_reference)
        if self.digest != digest:
            raise ValueError(f"{self.name} holds weights with digest {self.digest} after loading version {version}, "
                             f"whose digest is {digest}.")
        self.loads += 1
        return {"name": self.name, "version": self.version, "digest": self.digest, "sent_digest": digest,
                "loads": self.loads}

    def reload_latest(self) -> dict[str, Any]:
        """Load the coordinator's latest weights (a worker that came back with none, or an older version)."""
        import ray

        latest = ray.get(self.coordinator.latest_weights.remote())
        if latest is None:
            raise RuntimeError("The coordinator holds no weights yet.")
        version, digest, holder = latest
        return self.load_weights(version, digest, ray.get(holder[0]))

    def sample(self, request: RolloutRequest):
        """Sample ``request``; yields ``{"kind": "micro_batch", ...}`` per micro-batch as soon as it is decoded, then
        ``{"kind": "done", ...}`` with the phase timings."""
        if self.version != request.version:
            raise RuntimeError(f"{self.name} holds weights version {self.version} but the request for generation "
                               f"{request.gen_index} (process {request.process_index}) was sent for version "
                               f"{request.version}.")
        self.accelerator.process_index = request.process_index
        tic = time.perf_counter()
        events: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                generation = self.engine.generate(
                    request.rows, request.gen_index, request.step,
                    on_micro_batch=lambda index, record, job: events.put(("micro_batch", index, record, job)))
                events.put(("done", generation, None, None))
            except BaseException as err:  # re-raised in the actor's thread below
                events.put(("error", err, None, None))

        thread = threading.Thread(target=run, name="flowgrpo-rollout", daemon=True)
        thread.start()
        images = 0
        while True:
            kind, first, record, job = events.get()
            if kind == "error":
                raise first
            if kind == "done":
                thread.join()
                yield {"kind": "done", "timing": dict(first.timing), "version": self.version, "images": images,
                       "seconds": time.perf_counter() - tic, "worker": self.name, "incarnation": self.incarnation}
                return
            pil, columns_future, decode_seconds = job.result()
            images += len(pil)
            yield {"kind": "micro_batch", "index": first, "record": move_to(record, "cpu"), "images": pil,
                   "columns": columns_future.result(), "decode_seconds": decode_seconds, "version": self.version,
                   "worker": self.name, "incarnation": self.incarnation, "pid": os.getpid()}


def _normal_priority() -> int:
    """Ray starts worker processes at niceness 15 unless the cluster was started with ``worker_niceness`` 0 (the
    trainer's own cluster is; ``RAY_worker_niceness=0`` before ``ray start`` for others): a rollout worker then loses
    the CPU to every other process of a busy node, its sampling and decoding included. Raise it back to 0 where
    allowed; returns the niceness it runs at."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except PermissionError:
            return current
    return os.getpriority(os.PRIO_PROCESS, 0)


def _node_address() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return None


class RolloutCoordinator:
    """A small Ray actor (no CPU reserved) of the run: the latest weights (the object-store reference the trainer put
    once per sync, with its version and digest), so that a restarted worker reloads them by itself; and how many times
    each worker was built (its restarts are that minus one)."""

    def __init__(self):
        self._latest: tuple[int, str, list] | None = None
        self._incarnations: dict[str, int] = {}

    def register(self, name: str) -> int:
        self._incarnations[name] = self._incarnations.get(name, 0) + 1
        return self._incarnations[name]

    def publish(self, version: int, digest: str, holder: list) -> None:
        """``holder``: ``[ObjectRef]`` (a list, so that Ray passes the reference and not its value)."""
        self._latest = (int(version), digest, holder)

    def latest_weights(self) -> tuple[int, str, list] | None:
        return self._latest

    def restarts(self) -> dict[str, int]:
        return {name: count - 1 for name, count in self._incarnations.items()}


class RewardWorker:
    """A Ray actor that scores with the run's rewards (``reward_backend: ray``): the reward set is rebuilt from the
    trainer's reward names or import paths, weights, keyword arguments and failure policies."""

    def __init__(self, reward_funcs: Any, reward_weights: Any, reward_kwargs: Any, on_failure: Any, offload: bool,
                 torch_threads: int | None = None):
        from ....rewards import resolve_reward_funcs

        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.rewards = resolve_reward_funcs(reward_funcs, reward_weights, reward_kwargs, num_workers=1,
                                            on_failure=on_failure, offload=offload)

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "names": list(self.rewards.names), "node": _node_address()}

    def score(self, prompts: list[str], images: list, defer_groupwise: bool, columns: dict) -> Any:
        return self.rewards(prompts, images, defer_groupwise=defer_groupwise, **columns)
