r"""`RayRolloutBackend`: rollouts on `RolloutWorker` actors of a Ray cluster, the trainer's side.

It holds the run's parts and the order in which they act; each job is a class of its own module:

* `worker_set.WorkerSet`: the run's workers (names, handles, what each said at start, restarts);
* `requests.RolloutRequests`: this process's requests in flight (sent, streamed back, checked, assembled);
* `weight_sync.WeightSync`: the weights' version and the transport that brings it to the workers
  (``weight_sync: object_store | collective``), and bringing restarted workers back;
* `in_flight_checkpoint.InFlightCheckpoint`: the checkpointed generations in flight and their replay on resume;
* `pool.RolloutWorkerPool`: where the workers come from (a pool that outlives the run, or one of its own).

**Requests.** One request is one training process's share of one generation (its rows, with their seeds given by
(seed, generation, process) as on the local backend). Micro-batches stream back as the worker decodes them; a
collector thread of the trainer submits each to the rewards as it arrives (the trainer's reward threads, or
`RewardWorker` actors with ``reward_backend: ray``). `generate` hands the generation to training once all of this
process's groups have arrived; scoring (the gathers, the advantages) stays in the training processes.

**Versions and staleness.** The weights' version is the number of optimizer steps they went through. Generation g
starts training at optimizer step s(g) = floor(g P / A) (P = steps_per_generation x num_iterations micro-steps per
generation, A = gradient_accumulation_steps); sampled by version v, its staleness is s(g) - v. A generation is sent to
the workers only when s(g) - v <= ``max_staleness`` for the version v they hold, and every returned sample carries the
version that sampled it, checked again on arrival: no group older than the bound is trained on. With
``max_staleness: 0`` every generation is sent after the sync of the step before it: exactly the local backend's
samples. With N >= 1 the dataloader's coming batches are read ahead (`read_ahead`) and up to N generations are sampled
while the trainer trains. A stale generation is handed to the algorithm's ``stale_replay`` when it arrives (e.g.
Flow-GRPO's truncated importance weights, Flow-DPPO's anchor), whose metrics are logged.

**Faults.** A worker that dies mid-request is restarted by Ray (``max_worker_restarts``). Every process learns at the
same point (`_finish`) that a request was lost somewhere; the restarted workers are brought to the current weights
(`WeightSync.repair`) and each lost request is sent again, whole, with the same rows and seeds (the micro-batches that
had arrived are dropped): no group is trained twice or lost. A worker that does not answer within
``rollout_timeout_s`` stops the run on every process (`RolloutWorkerError`, naming it); the trainer saves the last
completed step first.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...collectives import any_process
from ...data.datasets import INDEX_COLUMN
from ..backend import RolloutBackend, RolloutWorkerError
from ..generation import Generation
from .in_flight_checkpoint import BACKEND_STATE_NAME, BACKEND_WEIGHTS_NAME, InFlightCheckpoint
from .read_ahead import ReadAhead
from .requests import RolloutRequests, check_record_precision, row_columns
from .reward_workers import RewardWorkers
from .session import NAMESPACE, RaySession, resource_options, worker_env
from .weight_sync import WeightSync, build_weight_sync
from .worker_set import WorkerSet

__all__ = ["BACKEND_STATE_NAME", "BACKEND_WEIGHTS_NAME", "RayRolloutBackend", "check_record_precision", "row_columns"]

logger = logging.getLogger(__name__)


class RayRolloutBackend(RolloutBackend):
    """See the module docstring. Built by the trainer (`rollout.backend_choice.build_rollout_backend`) from its parts:
    the configuration, the `Policy` (the weights to send), the `RolloutEngine` (the strategy the workers run, the
    rewards, scoring), the accelerator (the launch's processes), the metrics sink, the run's `AlgorithmFacts` (what a
    worker needs) and ``source``, what the workers load the pipeline from (`rollout.backend.model_source`);
    ``stale_replay``: the algorithm's correction of a stale generation (``records -> metrics to log``, e.g. Flow-GRPO's
    truncated importance weights), or None."""

    logs_rollout_metrics = True
    #: called in a collector thread with ``(generation, micro-batch index, worker name, worker pid)`` as each
    #: micro-batch arrives (progress reporting; the fault tests stop or kill a worker from here)
    on_micro_batch = None

    def __init__(self, args: Any, policy: Any, engine: Any, accelerator: Any, metrics: Any, algorithm: Any,
                 source: Any, *, stale_replay: Callable[[list[dict]], dict] | None = None):
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
        #: the copies every worker holds and receives (`WorkerNeeds.synced`)
        self.synced = tuple(algorithm.workers.synced)
        self.workers: WorkerSet | None = None
        self.requests: RolloutRequests | None = None
        self.sync: WeightSync | None = None
        self.checkpoint = InFlightCheckpoint(args.weight_sync_steps, self.rank)
        self.coordinator = None
        self.pool = None
        self._own_pool = False
        self._inputs: dict[int, list[dict]] = {}
        self._read_ahead: ReadAhead | None = None
        self._failed = False
        self._ready = False
        #: process 0: per worker, the answer `start` waits for (a kept worker's reconfiguration), None for a new one
        self._ready_refs: list = []

    # ---- views -------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def worker_names(self) -> list[str]:
        return self.workers.names if self.workers is not None else []

    @property
    def worker_info(self) -> list[dict]:
        """Process 0: what each worker said when it was ready (pid, node, device, threads, niceness, start-up time)."""
        return self.workers.info if self.workers is not None else []

    @property
    def restarts(self) -> int:
        return self.workers.restarts if self.workers is not None else 0

    @property
    def version(self) -> int | None:
        return self.sync.version if self.sync is not None else None

    # ---- set-up ------------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Connect, take the workers from the pool and give each its spec: new workers load the pipeline in the
        background while the trainer goes on (its set-up, the first evaluation), kept ones rebuild themselves; `start`
        waits for them."""
        if self.workers is not None:
            return
        import ray

        from .pool import RolloutWorkerPool, current_pool
        from .worker import RolloutWorker

        args, session = self.args, self.session
        self._failed = self._ready = False
        self._ready_refs = []
        session.open()
        if self.rewards is not None:
            self.rewards.launch()
        resources = self._worker_resources()
        threads = int(args.cpu_threads) if str(args.cpu_threads).isdigit() else max(1, int(resources["num_cpus"]))
        env = worker_env(threads)
        spec = self._worker_spec(resources, threads)
        names = coordinator_name = None
        if session.is_main:
            self.pool = current_pool()
            self._own_pool = self.pool is None
            if self._own_pool:
                self.pool = RolloutWorkerPool(session.run)
            coordinator = self.pool.ensure_coordinator()
            coordinator_name = self.pool.coordinator_name
            key = json.dumps([resources, threads, args.max_worker_restarts, env], sort_keys=True, default=str)
            taken = self.pool.acquire(key, args.rollout_workers)
            ray.get([coordinator.assign.remote(name, spec.for_worker(name)) for name, _ in taken],
                    timeout=args.rollout_startup_timeout_s)
            handles = []
            for name, handle in taken:
                if handle is None:
                    handle = ray.remote(RolloutWorker).options(
                        name=name, namespace=NAMESPACE, max_restarts=args.max_worker_restarts, max_task_retries=0,
                        runtime_env={"env_vars": env}, **resource_options(resources)).remote(name, coordinator_name)
                    self.pool.created(name, handle)
                    self._ready_refs.append(None)  # `start` asks it to describe itself once built
                else:
                    self._ready_refs.append(handle.configure.remote())  # rebuilt for this run; `start` waits for it
                handles.append(handle)
            names = [name for name, _ in taken]
            self.coordinator = coordinator
        names, coordinator_name = session.broadcast((names, coordinator_name))
        if not session.is_main:
            handles = [ray.get_actor(name, namespace=NAMESPACE) for name in names]
            self.coordinator = ray.get_actor(coordinator_name, namespace=NAMESPACE)
        self.workers = WorkerSet(names, handles, args)
        self.requests = RolloutRequests(args, self.engine, self.accelerator, self.workers, self._notify)
        self.sync = build_weight_sync(args.weight_sync, args, self.policy, self.accelerator, session, self.workers,
                                      self.coordinator, self.synced, self.metrics)

    def _worker_resources(self) -> dict:
        resources = dict(self.args.rollout_worker_resources or {})
        resources.setdefault("num_cpus", 1)
        if "num_gpus" not in resources and self.accelerator.device.type == "cuda":
            resources["num_gpus"] = 1
        return resources

    def _worker_spec(self, resources: dict, threads: int) -> _SpecTemplate:
        from .worker import WorkerSpec

        model, pipeline_kwargs = self.source
        worker_args = copy.copy(self.args)
        worker_args.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                             torch.float16: "float16"}[self.policy.dtype]
        policy = self.policy
        return _SpecTemplate(WorkerSpec(
            name="", model=model, args=worker_args, peft_config=self._peft_config(), pipeline_kwargs=pipeline_kwargs,
            strategy=self.strategy.for_workers(worker_args, self.args.max_staleness),
            device="cuda" if resources.get("num_gpus") else "cpu", mixed_precision=str(self.accelerator.mixed_precision),
            synced=self.synced,
            reference_own_adapter=bool(policy.reference is not None and policy.reference.kind == "adapter"),
            keep_reference_copy="reference" in self.synced and not policy.is_peft,
            audio_rewards=list(self.engine.rewards.audio_rewards), torch_threads=threads,
            weight_sync=self.args.weight_sync))

    def _peft_config(self) -> Any:
        if not self.policy.is_peft:
            return None
        config = copy.deepcopy(self.policy.unwrapped.peft_config["default"])
        config.inference_mode = False
        return config

    def start(self) -> None:
        """Wait (up to ``rollout_startup_timeout_s``) until every worker has built its pipeline and policy, and check
        that it samples with the trainer's settings."""
        if self.workers is not None and self._ready:
            return
        from .worker import rollout_fingerprint

        self.launch()
        args, session = self.args, self.session
        if self.rewards is not None:
            self.rewards.start()
        failed = None
        if session.is_main:
            try:
                refs = [ref if ref is not None else w.describe.remote()
                        for ref, w in zip(self._ready_refs, self.workers.handles)]
                described = session.wait(refs, args.rollout_startup_timeout_s,
                                         "at start (building the pipeline and policy)", self.workers.names)
                self.workers.started(described)
                for info in described:
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
            self._failed = True
            self.close()
            raise failed or RolloutWorkerError("The rollout workers failed to start (see process 0).")
        self._ready = True

    def _check_fingerprints(self, own: dict) -> None:
        names = self.workers.names
        for name, theirs in zip(names, self.session.wait([w.fingerprint.remote() for w in self.workers.handles],
                                                         self.args.rollout_timeout_s, "its settings", names)):
            differ = sorted(k for k in set(own) | set(theirs) if own.get(k) != theirs.get(k))
            if differ:
                raise ValueError(f"{name} would sample with other settings than the trainer replays: "
                                 + "; ".join(f"{k}: worker {theirs.get(k)!r}, trainer {own.get(k)!r}" for k in differ))

    def summary(self) -> str | None:
        """One line for the console at start-up: where the rollouts run, the layout, the bound and the transport."""
        if not self.worker_info:
            return None
        resources = self._worker_resources()
        gpus = resources.get("num_gpus") or 0
        layout = "separate GPUs" if gpus >= 1 else ("colocated (a share of a GPU)" if gpus > 0 else "CPU workers")
        nodes = sorted({str(info.get("node")) for info in self.worker_info})
        sync = self.args.weight_sync + (f" ({self.sync.backend})" if hasattr(self.sync, "backend") else "")
        return (f"Rollouts on {len(self.worker_info)} Ray worker(s) on node(s) {', '.join(nodes)} ({layout}, "
                f"{resources}); max_staleness {self.args.max_staleness}, weights every {self.args.weight_sync_steps} "
                f"step(s) over {sync}; rewards {'on Ray workers' if self.rewards is not None else 'in the trainer'}.")

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
        if self.checkpoint.pending is not None:
            self.checkpoint.replay(lambda g: g in self._inputs, lambda g, v: self._start_step(g) - v,
                                   self.args.max_staleness, lambda: self.sync.version, self.sync.publish,
                                   self._submit)
        if gen_index in self.requests:
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
        self.sync.prune(set(self.requests.versions().values()))
        return generation

    def _maybe_sync(self, step: int) -> None:
        if self.sync.due(step):
            self.sync.sync(step)

    def _submit(self, gen_index: int, version: int | None = None) -> None:
        self.requests.submit(gen_index, self._inputs[gen_index], self._start_step(gen_index),
                             self.sync.version if version is None else version)

    def _submit_ahead(self, gen_index: int) -> None:
        bound = self.args.max_staleness
        for later in sorted(g for g in self._inputs if g > gen_index):
            if later in self.requests:
                continue
            if self._start_step(later) - self.sync.version > bound:
                break
            self._submit(later)

    def _notify(self, gen_index: int, index: int, worker: str, pid: int) -> None:
        if self.on_micro_batch is not None:
            self.on_micro_batch(gen_index, index, worker, pid)

    def _finish(self, gen_index: int) -> Generation:
        """Wait for this process's share of ``gen_index``. Every process agrees, at this point, on failure (none is
        left waiting in a gather) and on whether a request was lost anywhere: then the workers are brought back
        (`WeightSync.repair`, on every process) and each lost request is sent again."""
        tic = time.perf_counter()
        attempts = 0
        while True:
            error, lost = None, None
            try:
                lost = self.requests.wait(gen_index)
            except RolloutWorkerError as err:
                error = err
            if any_process(self.accelerator, error is not None):
                # the request stays in flight: a checkpoint saved now records it, and the resumed run samples it again
                self._failed = True
                raise error or RolloutWorkerError("A rollout worker failed on another process (see its error).")
            if not any_process(self.accelerator, lost is not None):
                break
            attempts += 1
            if attempts > self.args.max_worker_restarts + 1:
                self._failed = True
                raise RolloutWorkerError(f"Generation {gen_index} was lost {attempts} times: its worker keeps dying.")
            if lost is not None:
                logger.warning("Rollout worker %s lost generation %d (%s); waiting for its restart to sample it again "
                               "with its own seeds.", self.requests.worker_name(gen_index), gen_index,
                               type(lost).__name__)
            try:
                self.sync.repair()
            except RolloutWorkerError:
                self._failed = True
                raise
            if lost is not None:
                self.requests.resend(gen_index)
        generation = self.requests.assemble(gen_index, self._start_step(gen_index)
                                            - self.requests.in_flight[gen_index].request.version)
        pending = self.requests.pop(gen_index)
        self.staleness = self._start_step(gen_index) - pending.request.version
        if self.stale_replay is not None and self.staleness > 0:
            for key, value in self.stale_replay(generation.records).items():
                self.metrics[key].append(float(value))
        self._log_generation(pending, time.perf_counter() - tic)
        return generation

    def _log_generation(self, pending: Any, waited: float) -> None:
        m = self.metrics
        m["rollout/staleness_mean"].append(float(self.staleness))
        m["rollout/staleness_max"].append(float(self.staleness))
        m["rollout/queue_wait_s"].append(waited)
        final = pending.final or {}
        if final.get("seconds"):
            m["rollout/images_per_s"].append(final["images"] / final["seconds"])
        m["rollout/worker_restarts"].append(float(self.restarts))

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, folder: str, step: int) -> None:
        if self.sync is None:
            return
        self.checkpoint.save(folder, step, self.sync.version, self.requests.versions(), self.sync.states,
                             self.restarts)

    def load(self, folder: str) -> None:
        self.checkpoint.load(folder)

    # ---- the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Give the workers back to the pool (kept when the run ended without a failure; killed otherwise: a worker
        that stopped answering must not serve another run), close a pool of the run's own, the transport, the reward
        workers and the connection. Requests still in flight (sampled ahead of a step that never came) are cancelled
        where Ray can; a kept worker finishes the one it is running before it takes the next run's call."""
        if self.sync is not None:
            self.sync.close()
        if self.requests is not None:
            self.requests.cancel()
        if self.session.is_main and self.pool is not None and self.workers is not None:
            self.pool.release(self.workers.names, healthy=not self._failed and self._ready)
            if self._own_pool:
                self.pool.close()
        self.pool, self._own_pool = None, False
        self.workers = self.requests = self.sync = None
        self.coordinator = None
        self._ready = False
        self._inputs.clear()
        self._read_ahead = None
        if self.rewards is not None:
            self.rewards.close()
        self.session.close()


class _SpecTemplate:
    """The run's `WorkerSpec`, named and pickled for each worker."""

    def __init__(self, spec: Any):
        self.spec = spec

    def for_worker(self, name: str) -> bytes:
        """The spec of worker ``name``, pickled for the coordinator."""
        import pickle

        spec = copy.copy(self.spec)
        spec.name = name
        return pickle.dumps(spec, protocol=5)


def _row_keys(rows: list[dict]) -> list[tuple]:
    return [(row.get("prompt"), row.get(INDEX_COLUMN)) for row in rows]
