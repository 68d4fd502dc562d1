"""The Ray actors of the rollout backend: `RolloutWorker` (samples), `RewardWorker` (scores) and `RolloutCoordinator`
(what each worker is built from, the latest weights, how often each worker was born).

`RolloutWorker` holds its own pipeline (loaded from the trainer's model path, or a pipeline the trainer shipped), a
`Policy` with the trainer's LoRA configuration and the copies its algorithm samples with (`WorkerNeeds.synced`), and a
`RolloutEngine` running the algorithm's own `RolloutStrategy` (its worker variant, `RolloutStrategy.for_workers`) with
a single-process stand-in for the accelerator (`SingleProcessAccelerator`: the device, the trainer's mixed precision,
identity gathers). One request is one training process's share of one generation: the worker sets the stand-in's
process index to the requesting rank and calls `RolloutEngine.generate` unchanged, so the noise comes from the same
(seed, generation, process) generator, drawn micro-batch after micro-batch, as on that rank, the SDE window from
(seed, generation), the same-noise groups from (seed, generation, group). Where a share is sampled does not change
what is sampled.

Each micro-batch is streamed back as soon as it is decoded (a Ray streaming generator): the record the algorithm keeps
(float32 latents, log-probs, timesteps, the prompt embeddings), the decoded images or frames, the columns the engine
adds for the rewards (the sound), and the weights version that sampled it. Ray runs one call of an actor at a time, so
a weight load never lands in the middle of a request: every sample of a request has one version.

**What a worker is built from.** Its constructor takes only its name and the coordinator's handle (small, held in
the actor's creation task itself); it reads its `WorkerSpec` from the coordinator, which keeps it (a shipped pipeline
included) for as long as the run, or the pool of workers, lasts. A worker restarted by Ray (``max_restarts``) thus
rebuilds exactly what it was, whatever became of the objects the trainer once put in the object store; and a worker
kept between runs (`pool.RolloutWorkerPool`) is rebuilt for the next run by `configure` from the spec that run gave
the coordinator.

**After a restart** the worker registers a new incarnation with the coordinator. With ``weight_sync: object_store`` it
loads the latest weights the coordinator holds; with ``weight_sync: collective`` it holds none until the trainer forms
the group again with it and sends them (a request reaching it before is refused with `WorkerNeedsWeights`, which the
trainer answers by doing so), and the trainer samples the lost request again with its own seeds.
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
           "WorkerNeedsWeights", "WorkerSpec", "move_to", "needs_weights", "rollout_fingerprint"]

#: the longest wait of a worker's constructor for the coordinator (its spec, its registration, the latest weights)
COORDINATOR_TIMEOUT_S = 600.0


class WorkerNeedsWeights(RuntimeError):
    """A request reached a worker that holds no weights yet (restarted with ``weight_sync: collective``): the trainer
    sends them and samples the request again."""


def needs_weights(error: BaseException) -> bool:
    """Whether ``error`` (as Ray hands it back) is a `WorkerNeedsWeights`."""
    return isinstance(error, WorkerNeedsWeights) or isinstance(getattr(error, "cause", None), WorkerNeedsWeights)


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
    """What a `RolloutWorker` is built from (kept by the coordinator, read by the worker's constructor and by
    `RolloutWorker.configure`).

    ``model``: the trainer's model path or hub id, or the pickled bytes of a pipeline it was given. ``args``: the
    trainer's configuration (its generation settings resolved; ``dtype`` set to the trainer's resolved one).
    ``strategy``: the algorithm's `RolloutStrategy` for workers (settings only). ``synced``: the copies the worker
    holds and receives at every sync (`WorkerNeeds.synced`). ``weight_sync``: ``"object_store"`` or
    ``"collective"``.
    """

    name: str
    model: Any
    args: Any
    peft_config: Any
    pipeline_kwargs: dict | None
    strategy: Any
    device: str = "cpu"
    mixed_precision: str = "no"
    synced: tuple[str, ...] = ()
    reference_own_adapter: bool = False
    keep_reference_copy: bool = False
    audio_rewards: list[str] = field(default_factory=list)
    torch_threads: int | None = None
    weight_sync: str = "object_store"

    @property
    def include_reference(self) -> bool:
        return "reference" in self.synced


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

    Methods (each a Ray call): ``describe()``, ``configure()``, ``load_weights(version, digest, state)``,
    ``reload_latest()``, ``join_group(rendezvous, rank)``, ``receive_weights(version, digest, buckets, epoch)``,
    ``sample(request)`` (a streaming generator: one payload per micro-batch, then a final one), ``fingerprint()``.
    """

    def __init__(self, name: str, coordinator: str):
        """``name``: the worker's name (its spec's key at the coordinator); ``coordinator``: the coordinator's actor
        name (strings only: nothing of the creation task lives in the object store, so a restart cannot lose it)."""
        import ray

        from .session import NAMESPACE

        self.niceness = _normal_priority()
        self.name = name
        self.coordinator = ray.get_actor(coordinator, namespace=NAMESPACE)
        self.policy = self.engine = None
        self.group = None
        self._build()
        self.incarnation = ray.get(self.coordinator.register.remote(self.name), timeout=COORDINATOR_TIMEOUT_S)
        if self.spec.weight_sync == "object_store":
            latest = ray.get(self.coordinator.latest_weights.remote(), timeout=COORDINATOR_TIMEOUT_S)
            if latest is not None:  # a restarted worker: the current weights, before any request reaches it
                version, digest, holder = latest
                self.load_weights(version, digest, ray.get(holder[0], timeout=COORDINATOR_TIMEOUT_S))

    def _build(self) -> None:
        """(Re)build everything from the spec the coordinator holds for this worker."""
        tic = time.perf_counter()
        import ray

        from ....cpu_threads import apply_cpu_thread_plan, plan_cpu_threads
        from ...data.prompt_cache import setup_prompt_cache
        from ...policy.policy import Policy
        from ...step_metrics import StepMetrics
        from ..engine import RolloutEngine

        blob = ray.get(self.coordinator.spec_of.remote(self.name), timeout=COORDINATOR_TIMEOUT_S)
        if blob is None:
            raise RuntimeError(f"The coordinator holds no spec for rollout worker {self.name}.")
        import pickle

        spec = pickle.loads(blob)
        if self.engine is not None:
            self.engine.close()
        self.policy = self.engine = self.group = None
        self.spec = spec
        device = torch.device(spec.device)
        if spec.torch_threads:
            os.environ["FLOWGRPO_CPU_THREADS"] = str(spec.torch_threads)
        args = spec.args
        model = spec.model
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
        for copy_name in spec.synced:
            if copy_name == "old_policy":
                self.policy.build_old_policy()
            elif copy_name != "reference":
                self.policy.build_copy(copy_name)
        if args.torch_compile:  # compiled as the trainer compiles them: the same blocks' code samples and trains
            self.policy.compile_blocks(args.torch_compile_backend, args.torch_compile_mode)
        self.engine = RolloutEngine(args, self.policy, spec.strategy, _ForwardedRewards(spec.audio_rewards),
                                    self.accelerator, StepMetrics(), prompt_cache=prompt_cache)
        self.version: int | None = None
        self.digest: str | None = None
        self.loads = 0
        self.startup_s = time.perf_counter() - tic

    # ---- what the trainer asks -------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "pid": os.getpid(), "incarnation": self.incarnation, "version": self.version,
                "digest": self.digest, "loads": self.loads, "device": str(self.accelerator.device),
                "torch_threads": torch.get_num_threads(), "startup_s": self.startup_s, "node": _node_address(),
                "node_id": _node_id(), "niceness": self.niceness, "weight_sync": self.spec.weight_sync}

    def configure(self) -> dict[str, Any]:
        """Rebuild for the spec the coordinator now holds for this worker (a worker kept for another run); answers
        as `describe`."""
        self._build()
        return self.describe()

    def fingerprint(self) -> dict[str, Any]:
        return rollout_fingerprint(self.engine)

    def _answer(self, version: int, digest: str) -> dict[str, Any]:
        """Read back the digest of what the policy now holds; the trainer compares it with what it sent."""
        from .weights import policy_state_digest

        self.version = int(version)
        self.digest = policy_state_digest(self.policy, synced=self.spec.synced)
        if self.digest != digest:
            raise ValueError(f"{self.name} holds weights with digest {self.digest} after loading version {version}, "
                             f"whose digest is {digest}.")
        self.loads += 1
        return {"name": self.name, "version": self.version, "digest": self.digest, "sent_digest": digest,
                "loads": self.loads, "incarnation": self.incarnation}

    def load_weights(self, version: int, digest: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Load ``state`` (``weight_sync: object_store``) and answer with the version and the digest of what the
        policy now holds."""
        from .weights import load_policy_state

        load_policy_state(self.policy, state, synced=self.spec.synced)
        return self._answer(version, digest)

    def reload_latest(self) -> dict[str, Any]:
        """Load the coordinator's latest weights (a worker that came back with none, or an older version)."""
        import ray

        latest = ray.get(self.coordinator.latest_weights.remote(), timeout=COORDINATOR_TIMEOUT_S)
        if latest is None:
            raise RuntimeError("The coordinator holds no weights yet.")
        version, digest, holder = latest
        return self.load_weights(version, digest, ray.get(holder[0], timeout=COORDINATOR_TIMEOUT_S))

    def join_group(self, rendezvous: Any, rank: int) -> dict[str, Any]:
        """Join the trainer's process group as ``rank`` (``weight_sync: collective``; blocks until every member
        joined, at most the rendezvous's timeout)."""
        from .collective import join_group

        self.group = None
        self.group = (rendezvous.epoch, join_group(rendezvous, rank, _node_address() or "", self.accelerator.device))
        return {"name": self.name, "epoch": rendezvous.epoch, "incarnation": self.incarnation}

    def receive_weights(self, version: int, digest: str, buckets: list, epoch: int) -> dict[str, Any]:
        """Receive the state broadcast over the group of formation ``epoch`` (``weight_sync: collective``), bucket
        after bucket into the policy's own tensors, and answer as `load_weights`. A layout that does not match this
        policy is refused after every bucket was received (the group is never left waiting)."""
        from .collective import receive_state
        from .weights import check_layout, live_tensors

        if self.group is None or self.group[0] != epoch:
            raise RuntimeError(f"{self.name} is not in the group of formation {epoch} "
                               f"(it holds {None if self.group is None else self.group[0]}).")
        live = live_tensors(self.policy, self.spec.synced)
        try:
            check_layout(live, {s.key: (s.torch_dtype, s.shape) for bucket in buckets for s in bucket})
            refused = None
        except ValueError as err:
            refused = err
        with torch.no_grad():
            receive_state(self.group[1], buckets, None if refused else live, self.accelerator.device)
        if refused is not None:
            raise refused
        return self._answer(version, digest)

    def sample(self, request: RolloutRequest):
        """Sample ``request``; yields ``{"kind": "micro_batch", ...}`` per micro-batch as soon as it is decoded, then
        ``{"kind": "done", ...}`` with the phase timings."""
        if self.version is None and self.spec.weight_sync == "collective":
            raise WorkerNeedsWeights(f"{self.name} (incarnation {self.incarnation}) holds no weights yet; the request "
                                     f"for generation {request.gen_index} needs version {request.version}.")
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
                   "worker": self.name, "incarnation": self.incarnation, "pid": os.getpid(), "node_id": _node_id()}


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


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray
        return None


def _node_address() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return None


class RolloutCoordinator:
    """A small Ray actor (no CPU reserved) of a run or of a pool of workers: the spec each worker is built from (so that
    a restarted worker rebuilds exactly what it was, and a kept worker what the next run asks), the latest weights
    with ``weight_sync: object_store`` (the object-store reference the trainer put once per sync, with its version and
    digest), and how many times each worker was built."""

    def __init__(self):
        self._specs: dict[str, bytes] = {}
        self._latest: tuple[int, str, list] | None = None
        self._incarnations: dict[str, int] = {}

    def assign(self, name: str, spec: bytes) -> None:
        """The spec worker ``name`` is built (or rebuilt) from, pickled (the coordinator never unpickles it: it needs
        none of the algorithm's modules); a new run's weights start afresh."""
        self._specs[name] = spec
        self._latest = None

    def spec_of(self, name: str) -> bytes | None:
        return self._specs.get(name)

    def register(self, name: str) -> int:
        self._incarnations[name] = self._incarnations.get(name, 0) + 1
        return self._incarnations[name]

    def incarnations(self) -> dict[str, int]:
        return dict(self._incarnations)

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
