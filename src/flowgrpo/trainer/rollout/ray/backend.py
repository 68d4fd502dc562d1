r"""`RayRolloutBackend`: rollouts on `RolloutWorker` actors of a Ray cluster, the trainer's side.

**Requests.** One request is one training process's share of one generation (its rows, with their seeds given by
(seed, generation, process) as on the local backend), sent to worker ``(generation x processes + rank) mod workers``.
Micro-batches stream back as the worker decodes them; a collector thread of the trainer submits each to the rewards as
it arrives (the trainer's reward threads, or `RewardWorker` actors with ``reward_backend: ray``). `generate` hands the
generation to training once all of this process's groups have arrived; scoring (the gathers, the advantages) stays
in the training processes.

**Versions and staleness.** The weights' version is the number of optimizer steps they went through. Generation g
starts training at optimizer step s(g) = floor(g P / A) (P = steps_per_generation x num_iterations micro-steps per
generation, A = gradient_accumulation_steps); sampled by version v, its staleness is s(g) - v. A generation is sent to
the workers only when s(g) - v <= ``max_staleness`` for the version v they hold, and every returned sample carries the
version that sampled it, checked again on arrival: no group older than the bound is trained on. With
``max_staleness: 0`` every generation is sent after the sync of the step before it: exactly the local backend's
samples. With N >= 1 the dataloader's coming batches are read ahead (`read_ahead`) and up to N generations are sampled
while the trainer trains.

**Weight sync.** Every ``weight_sync_steps`` optimizer steps, at the start of the next generation (after the old
policy's update and GARDO's reference reset of the step), every process takes part in collecting the state
(`weights.collect_policy_state`: FSDP2's and ZeRO-3's gathers are collectives), process 0 puts it in the object store
once, every worker loads it and answers with the version and the digest of what it now holds, both checked against
what was sent; the coordinator keeps the reference for restarted workers, and all processes wait at a barrier so that
no request of any process reaches a worker before its load. Every wait is bounded by ``rollout_timeout_s``.

**Faults.** A worker that dies mid-request is restarted by Ray (``max_worker_restarts``); it reloads the coordinator's
latest weights by itself, and the lost request is sent again, whole, with the same rows and seeds (the micro-batches
that had arrived are dropped): no group is trained twice or lost. A worker that does not answer within
``rollout_timeout_s`` stops the run on every process (`RolloutWorkerError`, naming it); the trainer saves the last
completed step first.

**Checkpoints.** `save` writes ``rollout_backend.json`` (the current version, the generations in flight and the
version each was sent with, the restarts) and ``rollout_backend_weights.safetensors`` (the weights of those versions,
when they differ from the trainer's own). A resumed run sends the in-flight generations again with the weights they
were first sent with, so it samples, scores and trains exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ...collectives import any_process
from ...data.condition_images import IMAGE_COLUMN
from ...data.datasets import INDEX_COLUMN
from ..backend import RolloutBackend, RolloutWorkerError
from ..generation import Generation, done_future
from ..images import load_images
from .read_ahead import ReadAhead
from .reward_workers import RewardWorkers
from .session import NAMESPACE, RaySession, actor_died, resource_options, worker_env
from .weights import collect_policy_state, state_digest

__all__ = ["BACKEND_STATE_NAME", "BACKEND_WEIGHTS_NAME", "RayRolloutBackend", "check_record_precision", "row_columns"]

logger = logging.getLogger(__name__)

BACKEND_STATE_NAME = "rollout_backend.json"
BACKEND_WEIGHTS_NAME = "rollout_backend_weights.safetensors"
def row_columns(rows: list[dict]) -> dict[str, list]:
    """The dataset's other columns of ``rows`` as the rewards receive them (source images loaded), as
    `RolloutEngine.generate` builds them."""
    columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", INDEX_COLUMN)}
    if IMAGE_COLUMN in columns:
        columns[IMAGE_COLUMN] = load_images(columns[IMAGE_COLUMN])
    return columns


def check_record_precision(record: dict, where: str) -> None:
    """The trajectory a worker recorded must be float32 (or float64): latents or log-probs stored in a half precision
    bias the likelihood ratio (a peer's pitfall). The prompt embeddings keep the text encoders' dtype."""
    for key, value in record.items():
        if key == "embeds" or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if value.dtype not in (torch.float32, torch.float64):
            raise RolloutWorkerError(f"{where} recorded {key!r} in {value.dtype}; the trajectory must be float32 "
                                     "(a half-precision trajectory biases the ratio).")


# ----------------------------------------------------------------------------------------------------------
# requests in flight
# ----------------------------------------------------------------------------------------------------------
@dataclass
class _Pending:
    """A request sent to a worker, and what has come back of it."""

    request: Any
    worker: int
    prompts: list[str]
    group_ids: torch.Tensor
    columns: dict
    stream: Any = None
    micro_batches: dict[int, dict] = field(default_factory=dict)
    final: dict | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    sent_at: float = 0.0


class RayRolloutBackend(RolloutBackend):
    """See the module docstring. Built by the trainer (`rollout.backend_choice.build_rollout_backend`) from its parts:
    the configuration, the `Policy` (the weights to send), the `RolloutEngine` (the strategy the workers run, the
    rewards, scoring), the accelerator (the launch's processes), the metrics sink, the run's `AlgorithmFacts` (what a
    worker needs) and ``source``, what the workers load the pipeline from (`rollout.backend.model_source`);
    ``stale_replay``: the algorithm's correction of a stale generation (``records -> weights``, e.g. Flow-GRPO's
    truncated importance weights), or None."""

    logs_rollout_metrics = True
    #: called in a collector thread with ``(generation, micro-batch index, worker name, worker pid)`` as each
    #: micro-batch arrives (progress reporting; the fault tests stop or kill a worker from here)
    on_micro_batch = None

    def __init__(self, args: Any, policy: Any, engine: Any, accelerator: Any, metrics: Any, algorithm: Any,
                 source: Any, *, stale_replay: Callable[[list[dict]], torch.Tensor] | None = None):
        self.args = args
        self.policy = policy
        self.engine = engine
        self.accelerator = accelerator
        self.metrics = metrics.train
        self.algorithm = algorithm
        self.source = source
        self.strategy = engine.strategy
        self.stale_replay = stale_replay
        if args.truncated_importance_cap is not None and (not algorithm.workers.importance_weights
                                                         or stale_replay is None):
            raise ValueError(f"truncated_importance_cap={args.truncated_importance_cap} weighs the behaviour "
                             "log-probs of SDE-window rollouts (the Flow-GRPO family); this algorithm records none. "
                             "Unset it.")
        self.session = RaySession(args, self.accelerator)
        self.rewards = RewardWorkers(args, engine, accelerator, self.session) if args.reward_backend == "ray" \
            else None
        period = args.steps_per_generation * args.num_iterations
        self.period = period
        #: batches read ahead of the one being trained: enough to see generation g + max_staleness at g's start
        self.depth = args.max_staleness * period + 1 if args.max_staleness > 0 else 0
        self.include_reference = "reference" in algorithm.workers.synced
        self.workers: list = []
        self.worker_names: list[str] = []
        #: process 0: what each worker said when it was ready (pid, node, device, threads, niceness, start-up time)
        self.worker_info: list[dict] = []
        self.coordinator = None
        self.version: int | None = None
        self._states: dict[int, dict[str, torch.Tensor]] = {}  # process 0: the states of versions still needed
        self._requests: dict[int, _Pending] = {}
        self._inputs: dict[int, list[dict]] = {}
        self._read_ahead: ReadAhead | None = None
        self._incarnations: dict[str, int] = {}
        self._resume: dict | None = None
        self._closed = False
        self._ready = False

    # ---- set-up ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def restarts(self) -> int:
        return sum(count - 1 for count in self._incarnations.values())

    def launch(self) -> None:
        """Connect and create the actors: the workers load the pipeline in the background while the trainer goes on
        (its set-up, the first evaluation); `start` waits for them."""
        if self.workers:
            return
        import ray

        from .worker import RolloutCoordinator, RolloutWorker, WorkerSpec

        self._closed = False
        self._ready = False
        args = self.args
        session = self.session
        session.open()
        if self.rewards is not None:
            self.rewards.launch()
        self.coordinator = session.create_or_find(
            f"{session.run}-coordinator",
            lambda name: ray.remote(RolloutCoordinator).options(name=name, namespace=NAMESPACE, num_cpus=0).remote())
        resources = dict(args.rollout_worker_resources or {})
        resources.setdefault("num_cpus", 1)
        if "num_gpus" not in resources and self.accelerator.device.type == "cuda":
            resources["num_gpus"] = 1
        threads = int(args.cpu_threads) if str(args.cpu_threads).isdigit() else max(1, int(resources["num_cpus"]))
        device = "cuda" if resources.get("num_gpus") else "cpu"
        model, pipeline_kwargs = self.source
        model_ref = ray.put(model) if (self.rank == 0 and isinstance(model, bytes)) else model
        worker_args = self._worker_args()
        strategy = self._worker_strategy(worker_args)
        policy = self.policy
        spec_common = dict(
            model=model_ref, args=worker_args, peft_config=self._peft_config(), pipeline_kwargs=pipeline_kwargs,
            strategy=strategy, device=device,
            mixed_precision=str(self.accelerator.mixed_precision), uses_old_policy=policy.old_policy is not None,
            reference_own_adapter=bool(policy.reference is not None and policy.reference.kind == "adapter"),
            keep_reference_copy=self.include_reference and not policy.is_peft,
            include_reference=self.include_reference, audio_rewards=list(self.engine.rewards.audio_rewards),
            torch_threads=threads)

        def make(name: str):
            return ray.remote(RolloutWorker).options(
                name=name, namespace=NAMESPACE, max_restarts=args.max_worker_restarts, max_task_retries=0,
                runtime_env={"env_vars": worker_env(threads)}, **resource_options(resources),
            ).remote(WorkerSpec(name=name, **spec_common), [self.coordinator])

        self.worker_names = [f"{session.run}-rollout-{i}" for i in range(args.rollout_workers)]
        self.workers = [session.create_or_find(name, make) for name in self.worker_names]

    def start(self) -> None:
        """Wait (up to ``rollout_startup_timeout_s``) until every worker has loaded the pipeline, and check that it
        samples with the trainer's settings."""
        if self.workers and self._ready:
            return
        from .worker import rollout_fingerprint

        self.launch()
        args, session = self.args, self.session
        if self.rewards is not None:
            self.rewards.start()
        failed = None
        if session.is_main:
            try:
                described = session.wait([w.describe.remote() for w in self.workers], args.rollout_startup_timeout_s,
                                         "at start (loading the pipeline)", self.worker_names)
                self.worker_info = described
                for info in described:
                    self._incarnations[info["name"]] = info["incarnation"]
                    logger.info("Rollout worker %s: pid %s on %s, %s, %s torch threads, ready in %.1f s", info["name"],
                                info["pid"], info["node"], info["device"], info["torch_threads"], info["startup_s"])
                    if info["niceness"] > 0:
                        logger.warning("Rollout worker %s runs at niceness %d (Ray's default for workers): on a busy "
                                       "node it gets little CPU. Start Ray with RAY_worker_niceness=0 in the "
                                       "environment of `ray start` (docs/distributed.md).", info["name"],
                                       info["niceness"])
                self._check_fingerprints(rollout_fingerprint(self.engine))
            except (RolloutWorkerError, ValueError) as err:
                failed = err
        if any_process(self.accelerator, failed is not None):
            self.close()
            raise failed or RolloutWorkerError("The rollout workers failed to start (see process 0).")
        self._ready = True

    def _worker_args(self) -> Any:
        import copy

        args = copy.copy(self.args)
        args.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.policy.dtype]
        return args

    def _worker_strategy(self, worker_args: Any) -> Any:
        """The trainer's strategy for the workers, on their copy of the configuration. A strategy that records the
        sampling policy's surrogate log-probs only when it is not the trained one at the first forward (AWM) must
        record them whenever samples may be stale."""
        import copy

        strategy = copy.copy(self.strategy)
        strategy.args = worker_args
        if self.args.max_staleness > 0 and hasattr(strategy, "old_log_probs_at_rollout"):
            strategy.old_log_probs_at_rollout = True
        return strategy

    def _peft_config(self) -> Any:
        import copy

        if not self.policy.is_peft:
            return None
        config = copy.deepcopy(self.policy.unwrapped.peft_config["default"])
        config.inference_mode = False
        return config

    def _check_fingerprints(self, own: dict) -> None:
        names = self.worker_names
        for name, theirs in zip(names, self.session.wait([w.fingerprint.remote() for w in self.workers],
                                                         self.args.rollout_timeout_s, "its settings", names)):
            differ = sorted(k for k in set(own) | set(theirs) if own.get(k) != theirs.get(k))
            if differ:
                raise ValueError(f"{name} would sample with other settings than the trainer replays: "
                                 + "; ".join(f"{k}: worker {theirs.get(k)!r}, trainer {own.get(k)!r}" for k in differ))

    # ---- the dataloader --------------------------------------------------------------------------------
    def read_ahead(self, iterator: Iterator, position: int) -> Iterator:
        if self.depth == 0 or isinstance(iterator, ReadAhead):
            return iterator
        if self._read_ahead is None or self._read_ahead.source is not iterator:
            self._read_ahead = ReadAhead(iterator, position, self.depth, self.period, self._note_inputs)
        return self._read_ahead

    def _note_inputs(self, gen_index: int, rows: list[dict]) -> None:
        self._inputs[gen_index] = rows

    def _start_step(self, gen_index: int) -> int:
        """s(g): optimizer steps done when generation g starts training."""
        return gen_index * self.period // self.args.gradient_accumulation_steps

    # ---- one generation ------------------------------------------------------------------------------
    def generate(self, inputs: list[dict], gen_index: int, step: int) -> Generation:
        self.start()
        known = self._inputs.get(gen_index)
        if known is not None and known is not inputs and _row_keys(known) != _row_keys(inputs):
            raise RuntimeError(f"Generation {gen_index}: the rows read ahead differ from the rows the trainer trains "
                               "on; the dataloader is not deterministic.")
        self._inputs[gen_index] = inputs
        if self._resume is not None:
            self._replay_in_flight(step)
        if gen_index in self._requests:
            generation = self._finish(gen_index)
            self._maybe_sync(step)
        else:
            self._maybe_sync(step)
            self._submit(gen_index)
            self._submit_ahead(gen_index)
            generation = self._finish(gen_index)
        self._submit_ahead(gen_index)
        for old in [g for g in self._inputs if g <= gen_index]:
            del self._inputs[old]
        self._prune_states()
        return generation

    def _submit_ahead(self, gen_index: int) -> None:
        bound = self.args.max_staleness
        for later in sorted(g for g in self._inputs if g > gen_index):
            if later in self._requests:
                continue
            if self._start_step(later) - self.version > bound:
                break
            self._submit(later)

    def _submit(self, gen_index: int) -> None:
        from .worker import RolloutRequest

        rows = self._inputs[gen_index]
        processes = self.accelerator.num_processes
        worker = (gen_index * processes + self.rank) % len(self.workers)
        request = RolloutRequest(gen_index=gen_index, process_index=self.rank, step=self._start_step(gen_index),
                                 rows=rows, version=self.version)
        pending = _Pending(request=request, worker=worker, prompts=[row["prompt"] for row in rows],
                           group_ids=torch.tensor([row[INDEX_COLUMN] for row in rows], dtype=torch.long),
                           columns=row_columns(rows), sent_at=time.perf_counter())
        pending.stream = self.workers[worker].sample.remote(request)
        threading.Thread(target=self._collect, args=(pending,), name="flowgrpo-rollout-collector",
                         daemon=True).start()
        self._requests[gen_index] = pending

    def _collect(self, pending: _Pending) -> None:
        """The collector thread of one request: each micro-batch as it arrives, its rewards submitted at once."""
        import ray

        micro = self.args.per_device_train_batch_size
        try:
            for ref in pending.stream:
                payload = ray.get(ref)
                self._note_incarnation(payload)
                if payload["kind"] == "done":
                    pending.final = payload
                    continue
                index = payload["index"]
                rows = slice(index * micro, (index + 1) * micro)
                columns = {k: v[rows] for k, v in pending.columns.items()}
                columns.update(payload["columns"])
                payload["rewards"] = self.engine.rewards.submit(pending.prompts[rows], payload["images"],
                                                                defer_groupwise=True, **columns)
                pending.micro_batches[index] = payload
                if self.on_micro_batch is not None:
                    self.on_micro_batch(pending.request.gen_index, index, payload["worker"], payload["pid"])
        except BaseException as err:  # seen by `_finish`
            pending.error = err
        finally:
            pending.done.set()

    def _note_incarnation(self, payload: dict) -> None:
        name, incarnation = payload.get("worker"), payload.get("incarnation")
        if name is not None and incarnation is not None:
            self._incarnations[name] = max(self._incarnations.get(name, 1), int(incarnation))

    def _finish(self, gen_index: int) -> Generation:
        """Wait for this process's share of ``gen_index`` (restarting lost requests); every process agrees on
        failure, so none is left waiting in a gather."""
        tic = time.perf_counter()
        error, generation = None, None
        try:
            generation = self._await(gen_index)
        except RolloutWorkerError as err:
            error = err
        if any_process(self.accelerator, error is not None):
            # the request stays in flight: a checkpoint saved now records it, and the resumed run samples it again
            raise error or RolloutWorkerError("A rollout worker failed on another process (see its error).")
        pending = self._requests.pop(gen_index)
        self._log_generation(gen_index, pending, time.perf_counter() - tic)
        return generation

    def _await(self, gen_index: int) -> Generation:
        args = self.args
        attempts = 0
        while True:
            pending = self._requests[gen_index]
            name = self.worker_names[pending.worker]
            if not pending.done.wait(timeout=args.rollout_timeout_s):
                raise RolloutWorkerError(
                    f"Rollout worker {name} did not return generation {gen_index} (process {self.rank}'s "
                    f"{len(pending.prompts)} samples) within rollout_timeout_s={args.rollout_timeout_s:g} s.",
                    worker=name)
            if pending.error is None:
                return self._assemble(pending)
            if not actor_died(pending.error):
                raise RolloutWorkerError(f"Rollout worker {name} failed sampling generation {gen_index}: "
                                         f"{type(pending.error).__name__}: {pending.error}", worker=name) \
                    from pending.error
            attempts += 1
            if attempts > args.max_worker_restarts + 1:
                raise RolloutWorkerError(f"Rollout worker {name} died {attempts} times on generation {gen_index}.",
                                         worker=name) from pending.error
            logger.warning("Rollout worker %s died while sampling generation %d; waiting for its restart to sample "
                           "it again with its own seeds.", name, gen_index)
            self._await_restart(pending.worker)
            self._inputs[gen_index] = pending.request.rows
            del self._requests[gen_index]
            self._submit(gen_index)

    def _await_restart(self, worker: int, version: int | None = None) -> dict:
        """Wait (up to ``rollout_timeout_s``) until ``worker`` is alive again with the weights of ``version`` (default:
        the current version); returns its answer."""
        import ray
        from ray.exceptions import ActorDiedError

        name, handle = self.worker_names[worker], self.workers[worker]
        deadline = time.monotonic() + self.args.rollout_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutWorkerError(f"Rollout worker {name} did not come back within rollout_timeout_s="
                                         f"{self.args.rollout_timeout_s:g} s after it died.", worker=name)
            ref = handle.describe.remote()
            ready, _ = ray.wait([ref], timeout=left)
            if not ready:
                continue
            try:
                info = ray.get(ref)
                break
            except ActorDiedError as err:
                raise RolloutWorkerError(f"Rollout worker {name} died and has no restart left (max_worker_restarts="
                                         f"{self.args.max_worker_restarts}).", worker=name) from err
            except Exception:  # still restarting
                time.sleep(0.2)
        self._incarnations[name] = max(self._incarnations.get(name, 1), int(info["incarnation"]))
        version = self.version if version is None else version
        if info["version"] != version:
            info = self.session.wait([handle.reload_latest.remote()], max(1.0, deadline - time.monotonic()),
                                     "reloading the weights", [name])[0]
            if info["version"] != version:
                raise RolloutWorkerError(f"Rollout worker {name} came back with weights version {info['version']}, "
                                         f"not {version}.", worker=name)
        return info

    def _assemble(self, pending: _Pending) -> Generation:
        """The `Generation` of a complete request, on this process's device, checked: every micro-batch, one version
        within the staleness bound, float32 trajectories."""
        request = pending.request
        name = self.worker_names[pending.worker]
        micro = self.args.per_device_train_batch_size
        chunks = [slice(s, s + micro) for s in range(0, len(pending.prompts), micro)]
        if sorted(pending.micro_batches) != list(range(len(chunks))) or pending.final is None:
            raise RolloutWorkerError(f"Rollout worker {name} returned micro-batches {sorted(pending.micro_batches)} of "
                                     f"generation {request.gen_index}; {len(chunks)} were expected.", worker=name)
        versions = {p["version"] for p in pending.micro_batches.values()} | {pending.final["version"]}
        if versions != {request.version}:
            raise RolloutWorkerError(f"Generation {request.gen_index} came back sampled by versions {sorted(versions)}; "
                                     f"it was sent for version {request.version}.", worker=name)
        staleness = self._start_step(request.gen_index) - request.version
        if staleness > self.args.max_staleness or staleness < 0:
            raise RolloutWorkerError(f"Generation {request.gen_index} was sampled by version {request.version}, "
                                     f"{staleness} steps from the step it trains at; max_staleness="
                                     f"{self.args.max_staleness}.", worker=name)
        device = self.accelerator.device
        records, jobs = [], []
        from .worker import move_to

        for index in range(len(chunks)):
            payload = pending.micro_batches[index]
            check_record_precision(payload["record"], name)
            records.append(move_to(payload["record"], device))
            jobs.append(done_future((payload["images"], payload["rewards"], payload["decode_seconds"])))
        from collections import defaultdict

        timing = defaultdict(float, pending.final["timing"])
        generation = Generation(records=records, jobs=jobs, chunks=chunks, prompts=pending.prompts,
                                group_ids=pending.group_ids, timing=timing, step=request.step)
        self.staleness = staleness
        if self.stale_replay is not None:
            weights = self.stale_replay(generation.records)
            self.metrics["rollout/importance_weight_mean"].append(float(weights.mean()))
            self.metrics["rollout/importance_weight_truncated"].append(
                float((weights >= self.args.truncated_importance_cap).float().mean()))
        return generation

    def _log_generation(self, gen_index: int, pending: _Pending, waited: float) -> None:
        m = self.metrics
        m["rollout/staleness_mean"].append(float(self.staleness))
        m["rollout/staleness_max"].append(float(self.staleness))
        m["rollout/queue_wait_s"].append(waited)
        final = pending.final or {}
        if final.get("seconds"):
            m["rollout/images_per_s"].append(final["images"] / final["seconds"])
        m["rollout/worker_restarts"].append(float(self.restarts))

    # ---- weight sync ---------------------------------------------------------------------------------
    def _maybe_sync(self, step: int) -> None:
        if self.version is None or step - self.version >= self.args.weight_sync_steps:
            tic = time.perf_counter()
            sharded = getattr(self.policy, "_zero3", False) or any(
                hasattr(p, "full_tensor") for p in self.policy.trainable_parameters())
            state = collect_policy_state(self.policy, include_reference=self.include_reference) \
                if (self.rank == 0 or sharded) else None
            self._publish(step, state)
            self.metrics["rollout/weight_sync_s"].append(time.perf_counter() - tic)

    def _publish(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Process 0 puts ``state`` in the object store once, every worker loads it and answers with the version and
        the digest it holds (checked); the coordinator keeps it for restarted workers; all processes then meet at a
        barrier, so that no request reaches a worker before its load."""
        import ray

        error = None
        if self.rank == 0:
            try:
                digest = state_digest(state)
                ref = ray.put(state)
                ray.get(self.coordinator.publish.remote(version, digest, [ref]),
                        timeout=self.args.rollout_timeout_s)
                answers = self._load_everywhere(version, digest, ref)
                for answer in answers:
                    if answer["version"] != version or answer["digest"] != digest:
                        raise RolloutWorkerError(
                            f"Rollout worker {answer['name']} loaded version {answer['version']} with digest "
                            f"{answer['digest']}; the trainer sent version {version} with digest {digest}.",
                            worker=answer["name"])
                self._states[version] = state
                self.metrics["rollout/worker_weight_loads"].append(float(max(a["loads"] for a in answers)))
            except RolloutWorkerError as err:
                error = err
            except Exception as err:  # the object store, the coordinator
                error = RolloutWorkerError(f"The weight sync of version {version} failed: {type(err).__name__}: {err}")
        if any_process(self.accelerator, error is not None):
            raise error or RolloutWorkerError(f"The weight sync of version {version} failed on process 0.")
        self.session.barrier()
        self.version = version

    def _load_everywhere(self, version: int, digest: str, ref: Any) -> list[dict]:
        """Every worker loads ``ref``; a worker that dies meanwhile is waited for: restarted, it loads the
        coordinator's latest weights (these) by itself."""
        import ray

        refs = [w.load_weights.remote(version, digest, ref) for w in self.workers]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.args.rollout_timeout_s)
        answers = []
        for i, one in enumerate(refs):
            name = self.worker_names[i]
            if one in pending:
                raise RolloutWorkerError(f"{name} did not answer the weight sync of version {version} within "
                                         f"rollout_timeout_s={self.args.rollout_timeout_s:g} s.", worker=name)
            try:
                answers.append(ray.get(one))
            except Exception as err:
                if not actor_died(err):
                    raise RolloutWorkerError(f"{name} failed the weight sync of version {version}: "
                                             f"{type(err).__name__}: {err}", worker=name) from err
                logger.warning("Rollout worker %s died during the weight sync of version %d; waiting for its restart.",
                               name, version)
                answers.append(self._await_restart(i, version))
        return answers

    def _prune_states(self) -> None:
        needed = {p.request.version for p in self._requests.values()} | {self.version}
        for version in [v for v in self._states if v not in needed]:
            del self._states[version]

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, folder: str, step: int) -> None:
        if self.version is None:
            return
        in_flight = {str(g): p.request.version for g, p in self._requests.items()}
        keep = set(in_flight.values())
        if step - self.version < self.args.weight_sync_steps:  # the next generation still samples with it
            keep.add(self.version)
        state = {"format": 1, "version": self.version, "in_flight": in_flight, "step": step,
                 "restarts": self.restarts, "saved_versions": sorted(keep)}
        with open(os.path.join(folder, BACKEND_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        if keep:
            from safetensors.torch import save_file

            missing = sorted(v for v in keep if v not in self._states)
            if missing:
                raise RuntimeError(f"The weights of versions {missing} are not kept; cannot checkpoint the rollouts.")
            save_file({f"{v}/{k}": t for v in keep for k, t in self._states[v].items()},
                      os.path.join(folder, BACKEND_WEIGHTS_NAME))

    def load(self, folder: str) -> None:
        path = os.path.join(folder, BACKEND_STATE_NAME)
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        states: dict[int, dict[str, torch.Tensor]] = {}
        if state["saved_versions"] and self.rank == 0:
            from safetensors.torch import load_file

            for key, tensor in load_file(os.path.join(folder, BACKEND_WEIGHTS_NAME)).items():
                version, _, name = key.partition("/")
                states.setdefault(int(version), {})[name] = tensor
        self._resume = {"version": state["version"], "in_flight": {int(g): v for g, v in state["in_flight"].items()},
                        "states": states, "saved_versions": state["saved_versions"]}

    def _replay_in_flight(self, step: int) -> None:
        """After resuming: send the generations that were in flight again, each with the weights it was first sent
        with, then restore the version the workers held; the run then samples what the uninterrupted run sampled."""
        resume, self._resume = self._resume, None
        states = resume["states"]
        for gen_index, version in sorted(resume["in_flight"].items()):
            if gen_index not in self._inputs or self._start_step(gen_index) - version > self.args.max_staleness:
                continue  # not read ahead (an epoch's end), or too old for this run's bound: sampled later, fresher
            if self.version != version:
                self._publish(version, states.get(version))
            self._submit(gen_index)
        current = resume["version"]
        if current in resume["saved_versions"] and self.version != current:
            self._publish(current, states.get(current))

    # ---- the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        import ray

        self._closed = True
        if self.rank == 0:
            for handle in [*self.workers, *([self.coordinator] if self.coordinator is not None else [])]:
                try:
                    ray.kill(handle)
                except Exception:  # already gone
                    pass
        self.workers, self.coordinator = [], None
        self._ready = False
        self._requests.clear()
        self._inputs.clear()
        self._read_ahead = None
        self.version = None
        if self.rewards is not None:
            self.rewards.close()
        self.session.close()


def _row_keys(rows: list[dict]) -> list[tuple]:
    return [(row.get("prompt"), row.get(INDEX_COLUMN)) for row in rows]
