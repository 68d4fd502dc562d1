"""`WorkerSet`: a run's rollout workers as the trainer sees them: their names and handles, what each said at start,
how often each was born (restarts are counted from the run's start), and the bounded waits for a worker to be alive
again after Ray restarted it."""

from __future__ import annotations

import time
from typing import Any

from ..backend import RolloutWorkerError
from .session import actor_died

__all__ = ["WorkerSet"]


class WorkerSet:
    """``names[i]`` / ``handles[i]``: worker i; ``args``: the configuration, read when a wait starts
    (``rollout_timeout_s``: the longest wait for one worker; ``max_worker_restarts``: Ray's ``max_restarts`` of each,
    for the message of a worker that has none left)."""

    def __init__(self, names: list[str], handles: list, args: Any):
        self.names = list(names)
        self.handles = list(handles)
        self.args = args
        #: what each worker said when it was ready (pid, node, device, threads, niceness, start-up time)
        self.info: list[dict] = []
        #: the Ray node each worker last answered from (its node id), by name
        self.nodes: dict[str, str] = {}
        self._incarnations: dict[str, int] = {}
        self._baseline: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def timeout_s(self) -> float:
        return float(self.args.rollout_timeout_s)

    def started(self, described: list[dict]) -> None:
        """Record each worker's answer at the run's start (its incarnation is the baseline of its restarts)."""
        self.info = list(described)
        for answer in described:
            self._baseline[answer["name"]] = int(answer["incarnation"])
            self.note(answer["name"], answer["incarnation"], answer.get("node_id"))

    def note(self, name: str | None, incarnation: Any, node_id: str | None = None) -> None:
        """A payload or an answer of incarnation ``incarnation`` came from ``name`` (on node ``node_id``)."""
        if name is not None and incarnation is not None:
            self._incarnations[name] = max(self._incarnations.get(name, 1), int(incarnation))
        if name is not None and node_id is not None:
            self.nodes[name] = node_id

    def incarnation(self, index: int) -> int:
        return self._incarnations.get(self.names[index], 1)

    @property
    def restarts(self) -> int:
        """Restarts of the run's workers since the run started."""
        return sum(count - self._baseline.get(name, 1) for name, count in self._incarnations.items())

    def await_alive(self, index: int, deadline: float | None = None, after: str = "after it died") -> dict:
        """Wait (until ``deadline``, default ``timeout_s`` from now) until worker ``index`` answers ``describe``; a
        worker Ray is restarting answers once its constructor ran. Returns its answer; ``after`` says, in the error,
        what the wait followed."""
        import ray
        from ray.exceptions import ActorDiedError

        name, handle = self.names[index], self.handles[index]
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutWorkerError(f"Rollout worker {name} did not answer within rollout_timeout_s="
                                         f"{self.timeout_s:g} s {after} (waited for it to describe itself).",
                                         worker=name)
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
            except Exception as err:  # still restarting
                if not actor_died(err):
                    raise RolloutWorkerError(f"Rollout worker {name} failed to describe itself: "
                                             f"{type(err).__name__}: {err}", worker=name) from err
                time.sleep(0.2)
        self.note(name, info["incarnation"], info.get("node_id"))
        return info
