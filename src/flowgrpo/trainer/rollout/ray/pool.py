"""`RolloutWorkerPool`: rollout workers that outlive a run.

A worker's start is mostly its process importing torch, transformers, diffusers and peft (5 to 10 s on a CPU, more on
a busy machine); building its pipeline and policy is the small part. A run's backend takes its workers from a pool
and gives them back when it closes; with a pool that outlives the run (a sweep, a notebook, a test module), the next
run's backend takes the same processes and has them rebuild themselves for its algorithm, model and settings
(`RolloutWorker.configure`), paying the imports once. Without one, each run gets a pool of its own, closed with it.

    from flowgrpo.trainer.rollout.ray.pool import RolloutWorkerPool

    with RolloutWorkerPool():          # the backends of the runs started inside take their workers from it
        for lr in (1e-4, 3e-4):
            make_trainer(lr).train()

A pool holds the coordinator of its workers (`worker.RolloutCoordinator`: each worker's spec, so that a worker
restarted by Ray rebuilds what its current run asked for) and, per set of Ray options (resources, restarts,
environment), its idle workers. A run that ends with a failure (a worker lost, a worker that stopped answering) or with
requests in flight kills its workers instead of returning them: only a worker known to be idle and healthy is kept.
Only the process that created a pool (a launch's process 0) hands out its workers.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from .session import NAMESPACE

__all__ = ["RolloutWorkerPool", "current_pool"]

logger = logging.getLogger(__name__)

_CURRENT: list[RolloutWorkerPool] = []
_LOCK = threading.Lock()


def current_pool() -> RolloutWorkerPool | None:
    """The innermost pool entered with ``with`` in this process, or None."""
    with _LOCK:
        return _CURRENT[-1] if _CURRENT else None


class RolloutWorkerPool:
    """See the module docstring. ``name``: the prefix of its actors' names (default ``flowgrpo-<8 hex>``)."""

    def __init__(self, name: str | None = None):
        self.name = name or f"flowgrpo-{uuid.uuid4().hex[:8]}"
        self.coordinator: Any = None
        self._idle: dict[Any, list[tuple[str, Any]]] = {}
        self._busy: dict[str, tuple[Any, Any]] = {}
        self._created = 0

    # ---- as a context ------------------------------------------------------------------------------------------
    def __enter__(self) -> RolloutWorkerPool:
        with _LOCK:
            _CURRENT.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _LOCK:
            if self in _CURRENT:
                _CURRENT.remove(self)
        self.close()

    # ---- what a backend asks -------------------------------------------------------------------------------------
    @property
    def coordinator_name(self) -> str:
        return f"{self.name}-coordinator"

    def ensure_coordinator(self) -> Any:
        """The pool's coordinator (named `coordinator_name`), created on first use (a connection to the cluster must
        exist)."""
        if self.coordinator is None:
            import ray

            from .worker import RolloutCoordinator

            self.coordinator = ray.remote(RolloutCoordinator).options(
                name=self.coordinator_name, namespace=NAMESPACE, num_cpus=0).remote()
        return self.coordinator

    def acquire(self, key: Any, count: int) -> list[tuple[str, Any]]:
        """``count`` workers of the Ray options ``key``, as ``[(name, handle)]``: idle ones first (to be reconfigured),
        then names for new ones (handle None: the backend assigns their spec, creates them and reports each with
        `created`)."""
        idle = self._idle.setdefault(key, [])
        taken = []
        while idle and len(taken) < count:
            taken.append(idle.pop(0))
        while len(taken) < count:
            taken.append((f"{self.name}-rollout-{self._created}", None))
            self._created += 1
        for name, handle in taken:
            self._busy[name] = (key, handle)
        return taken

    def created(self, name: str, handle: Any) -> None:
        """Record the handle of a worker `acquire` deferred."""
        key, _ = self._busy[name]
        self._busy[name] = (key, handle)

    def release(self, names: list[str], healthy: bool) -> None:
        """Give the workers back: kept for the next run when ``healthy``, else killed."""
        import ray

        for name in names:
            key, handle = self._busy.pop(name, (None, None))
            if handle is None:
                continue
            if healthy:
                self._idle.setdefault(key, []).append((name, handle))
            else:
                _kill(ray, handle)

    def close(self) -> None:
        """Kill every worker of the pool and its coordinator."""
        import sys

        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            self._idle.clear()
            self._busy.clear()
            self.coordinator = None
            return
        for handles in self._idle.values():
            for _, handle in handles:
                _kill(ray, handle)
        for _, handle in self._busy.values():
            if handle is not None:
                _kill(ray, handle)
        self._idle.clear()
        self._busy.clear()
        if self.coordinator is not None:
            _kill(ray, self.coordinator)
            self.coordinator = None


def _kill(ray: Any, handle: Any) -> None:
    try:
        ray.kill(handle)
    except Exception:  # already gone
        pass
