"""`RolloutRequests`: the requests of one training process in flight on the rollout workers: sent, streamed back
micro-batch by micro-batch (a collector thread per request submits each to the rewards as it arrives), waited for
within ``rollout_timeout_s`` and assembled into a checked `Generation`.

A request is one process's share of one generation, sent to worker ``(generation x processes + rank) mod workers``
with the version of the weights it must be sampled with. `wait` tells a request that came back from one that was lost
(its worker died, or was restarted and holds no weights yet): the backend then repairs the workers on every process
and sends the lost request again, whole, with its own rows and seeds (`resend`); any other failure is a
`RolloutWorkerError` naming the worker.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...data.condition_images import IMAGE_COLUMN
from ...data.datasets import INDEX_COLUMN
from ..backend import RolloutWorkerError
from ..generation import Generation, done_future
from ..images import load_images
from .session import actor_died
from .worker_set import WorkerSet

__all__ = ["PendingRequest", "RolloutRequests", "check_record_precision", "row_columns"]


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


@dataclass
class PendingRequest:
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


class RolloutRequests:
    """This process's requests in flight (see the module docstring). Built from the configuration, the trainer's
    `RolloutEngine` (its rewards score each micro-batch), the accelerator (this process's rank, its device), the run's
    `WorkerSet` and ``notify``, called with ``(generation, micro-batch index, worker name, worker pid)`` as each
    micro-batch arrives."""

    def __init__(self, args: Any, engine: Any, accelerator: Any, workers: WorkerSet,
                 notify: Callable[[int, int, str, int], None]):
        self.args = args
        self.engine = engine
        self.accelerator = accelerator
        self.workers = workers
        self.notify = notify
        self.in_flight: dict[int, PendingRequest] = {}

    def __contains__(self, gen_index: int) -> bool:
        return gen_index in self.in_flight

    def versions(self) -> dict[int, int]:
        """The version each request in flight was sent with, by generation."""
        return {g: p.request.version for g, p in self.in_flight.items()}

    def submit(self, gen_index: int, rows: list[dict], step: int, version: int) -> None:
        """Send this process's share ``rows`` of generation ``gen_index`` (which trains at optimizer step ``step``),
        to be sampled with weights ``version``."""
        from .worker import RolloutRequest

        rank = self.accelerator.process_index
        worker = (gen_index * self.accelerator.num_processes + rank) % len(self.workers)
        request = RolloutRequest(gen_index=gen_index, process_index=rank, step=step, rows=rows, version=version)
        pending = PendingRequest(request=request, worker=worker, prompts=[row["prompt"] for row in rows],
                                 group_ids=torch.tensor([row[INDEX_COLUMN] for row in rows], dtype=torch.long),
                                 columns=row_columns(rows), sent_at=time.perf_counter())
        # at most one micro-batch streamed ahead of this collector (a worker stopped while its collector handles a
        # micro-batch cannot finish the request behind its back)
        pending.stream = self.workers.handles[worker].sample.options(
            _generator_backpressure_num_objects=1).remote(request)
        threading.Thread(target=self._collect, args=(pending,), name="flowgrpo-rollout-collector",
                         daemon=True).start()
        self.in_flight[gen_index] = pending

    def resend(self, gen_index: int, version: int | None = None) -> None:
        """Send a lost request again, whole (the micro-batches that had arrived are dropped), with its rows and step,
        and with ``version`` (default: the version it was sent with)."""
        request = self.in_flight.pop(gen_index).request
        self.submit(gen_index, request.rows, request.step, request.version if version is None else version)

    def _collect(self, pending: PendingRequest) -> None:
        """The collector thread of one request: each micro-batch as it arrives, its rewards submitted at once."""
        import ray

        micro = self.args.per_device_train_batch_size
        try:
            for ref in pending.stream:
                payload = ray.get(ref)
                self.workers.note(payload.get("worker"), payload.get("incarnation"), payload.get("node_id"))
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
                self.notify(pending.request.gen_index, index, payload["worker"], payload["pid"])
        except BaseException as err:  # seen by `wait`
            pending.error = err
        finally:
            pending.done.set()

    def wait(self, gen_index: int) -> BaseException | None:
        """Wait (up to ``rollout_timeout_s``) for the request of ``gen_index``: None when it came back whole, the error
        when it was lost (its worker died, or holds no weights after a restart); `RolloutWorkerError` otherwise."""
        from .worker import needs_weights

        pending = self.in_flight[gen_index]
        name = self.workers.names[pending.worker]
        if not pending.done.wait(timeout=self.args.rollout_timeout_s):
            raise RolloutWorkerError(
                f"Rollout worker {name} did not return generation {gen_index} (process "
                f"{self.accelerator.process_index}'s {len(pending.prompts)} samples) within rollout_timeout_s="
                f"{self.args.rollout_timeout_s:g} s.", worker=name)
        if pending.error is None:
            return None
        if actor_died(pending.error) or needs_weights(pending.error):
            return pending.error
        raise RolloutWorkerError(f"Rollout worker {name} failed sampling generation {gen_index}: "
                                 f"{type(pending.error).__name__}: {pending.error}", worker=name) from pending.error

    def worker_name(self, gen_index: int) -> str:
        return self.workers.names[self.in_flight[gen_index].worker]

    def assemble(self, gen_index: int, staleness: int) -> Generation:
        """The `Generation` of the complete request of ``gen_index``, on this process's device, checked: every
        micro-batch, one version (the one it was sent with), a staleness within the bound, float32 trajectories."""
        pending = self.in_flight[gen_index]
        request = pending.request
        name = self.workers.names[pending.worker]
        micro = self.args.per_device_train_batch_size
        chunks = [slice(s, s + micro) for s in range(0, len(pending.prompts), micro)]
        if sorted(pending.micro_batches) != list(range(len(chunks))) or pending.final is None:
            raise RolloutWorkerError(f"Rollout worker {name} returned micro-batches {sorted(pending.micro_batches)} of "
                                     f"generation {request.gen_index}; {len(chunks)} were expected.", worker=name)
        versions = {p["version"] for p in pending.micro_batches.values()} | {pending.final["version"]}
        if versions != {request.version}:
            raise RolloutWorkerError(f"Generation {request.gen_index} came back sampled by versions {sorted(versions)}; "
                                     f"it was sent for version {request.version}.", worker=name)
        if staleness > self.args.max_staleness or staleness < 0:
            raise RolloutWorkerError(f"Generation {request.gen_index} was sampled by version {request.version}, "
                                     f"{staleness} steps from the step it trains at; max_staleness="
                                     f"{self.args.max_staleness}.", worker=name)
        from .worker import move_to

        device = self.accelerator.device
        records, jobs = [], []
        for index in range(len(chunks)):
            payload = pending.micro_batches[index]
            check_record_precision(payload["record"], name)
            records.append(move_to(payload["record"], device))
            jobs.append(done_future((payload["images"], payload["rewards"], payload["decode_seconds"])))
        timing = defaultdict(float, pending.final["timing"])
        return Generation(records=records, jobs=jobs, chunks=chunks, prompts=pending.prompts,
                          group_ids=pending.group_ids, timing=timing, step=request.step)

    def pop(self, gen_index: int) -> PendingRequest:
        return self.in_flight.pop(gen_index)

    def cancel(self) -> None:
        """Forget every request in flight, cancelling those Ray has not started (best effort)."""
        import ray

        for pending in self.in_flight.values():
            try:
                ray.cancel(pending.stream)
            except Exception:  # already finished, or not cancellable
                pass
        self.in_flight.clear()
