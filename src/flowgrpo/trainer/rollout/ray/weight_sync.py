"""The weight sync of the Ray backend: `WeightSync` (what every transport does: the version, the collection on every
process, the checks, the states kept for checkpoints, bringing restarted workers back) and its two transports,
``weight_sync: object_store`` (`ObjectStoreSync`) and ``weight_sync: collective`` (`CollectiveSync`).

**A sync.** Every ``weight_sync_steps`` optimizer steps, at the start of the next generation (after the old policy's
update and GARDO's reference reset of the step), every process takes part in collecting the state
(`weights.collect_policy_state`: FSDP2's and ZeRO-3's gathers are collectives); process 0 sends it to every worker,
which loads it and answers with the version and the BLAKE2b digest of what it now holds, both checked against what
was sent; failures are reduced over all processes before anyone raises, and all processes then meet at a barrier, so
that no request of any process reaches a worker before its load. Every wait is bounded by ``rollout_timeout_s``.

* `ObjectStoreSync`: process 0 puts the state in Ray's object store once; every worker reads it (over the network
  from another node) and loads it; the coordinator keeps the reference, so that a worker restarted by Ray loads it by
  itself in its constructor.
* `CollectiveSync`: a process group of process 0 and the workers (`collective`: gloo on CPUs, NCCL on GPUs), formed at
  the first sync and again whenever a worker was restarted (a new process must join); the state goes out as bucketed
  broadcasts (``weight_sync_bucket_mb``), received bucket by bucket into each worker's tensors.

**Bringing workers back** (`repair`, on every process at the same point, after a request was lost anywhere): process 0
waits for every worker to answer and brings each one that does not hold the current version to it (object store: it
reloads the coordinator's latest; collective: the group is formed again and the state broadcast), then all meet at a
barrier.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ...collectives import any_process
from ...rollout_settings import WEIGHT_SYNCS
from ..backend import RolloutWorkerError
from .session import RaySession, actor_died
from .weights import bucket_layout, collect_policy_state, state_digest
from .worker_set import WorkerSet

__all__ = ["WEIGHT_SYNCS", "CollectiveSync", "ObjectStoreSync", "WeightSync", "build_weight_sync"]

logger = logging.getLogger(__name__)

class WeightSync:
    """See the module docstring. Built from the configuration, the `Policy` (the weights to send), the accelerator,
    the run's `RaySession`, its `WorkerSet`, the coordinator's handle, the copies the workers hold (``synced``,
    `WorkerNeeds.synced`) and the metrics sink."""

    def __init__(self, args: Any, policy: Any, accelerator: Any, session: RaySession, workers: WorkerSet,
                 coordinator: Any, synced: tuple[str, ...], metrics: Any):
        self.args = args
        self.policy = policy
        self.accelerator = accelerator
        self.session = session
        self.workers = workers
        self.coordinator = coordinator
        self.synced = tuple(synced)
        self.metrics = metrics
        #: the version the workers hold (optimizer steps their weights went through), None before the first sync
        self.version: int | None = None
        #: process 0: the states of the versions still needed (in flight, or the current one)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    def due(self, step: int) -> bool:
        return self.version is None or step - self.version >= self.args.weight_sync_steps

    def sync(self, step: int) -> None:
        """Collect the state on every process that must take part and publish it as version ``step``."""
        tic = time.perf_counter()
        sharded = getattr(self.policy, "_zero3", False) or any(
            hasattr(p, "full_tensor") for p in self.policy.trainable_parameters())
        state = collect_policy_state(self.policy, synced=self.synced) if (self.rank == 0 or sharded) else None
        self.publish(step, state)
        self.metrics["rollout/weight_sync_s"].append(time.perf_counter() - tic)

    def publish(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Process 0 sends ``state`` as ``version`` to every worker and checks every answer; all processes then meet
        at a barrier."""
        error = None
        if self.rank == 0:
            try:
                digest = state_digest(state)
                answers = self._send(version, digest, state)
                self._check(answers, version, digest)
                self.states[version] = state
                self.metrics["rollout/worker_weight_loads"].append(float(max(a["loads"] for a in answers)))
            except RolloutWorkerError as err:
                error = err
            except Exception as err:  # the object store, the coordinator, the group
                error = RolloutWorkerError(f"The weight sync of version {version} failed: {type(err).__name__}: {err}")
        if any_process(self.accelerator, error is not None):
            raise error or RolloutWorkerError(f"The weight sync of version {version} failed on process 0.")
        self.session.barrier()
        self.version = version

    @staticmethod
    def _check(answers: list[dict], version: int, digest: str) -> None:
        for answer in answers:
            if answer["version"] != version or answer["digest"] != digest:
                raise RolloutWorkerError(
                    f"Rollout worker {answer['name']} loaded version {answer['version']} with digest "
                    f"{answer['digest']}; the trainer sent version {version} with digest {digest}.",
                    worker=answer["name"])

    def repair(self) -> None:
        """After a request was lost on some process (every process calls it at the same point): process 0 waits for
        every worker and brings each one that does not hold the current version to it; then all meet."""
        error = None
        if self.rank == 0 and self.version is not None:
            try:
                deadline = time.monotonic() + self.args.rollout_timeout_s
                behind = [i for i in range(len(self.workers))
                          if self.workers.await_alive(i, deadline)["version"] != self.version]
                if behind:
                    state = self.states[self.version]
                    digest = state_digest(state)
                    self._check(self._bring(behind, self.version, digest, state), self.version, digest)
            except RolloutWorkerError as err:
                error = err
            except Exception as err:
                error = RolloutWorkerError(f"Bringing the rollout workers back to version {self.version} failed: "
                                           f"{type(err).__name__}: {err}")
        if any_process(self.accelerator, error is not None):
            raise error or RolloutWorkerError("Bringing a restarted rollout worker back failed on process 0.")
        self.session.barrier()

    def prune(self, needed: set[int]) -> None:
        """Forget the states of versions neither in ``needed`` nor current."""
        for version in [v for v in self.states if v not in needed | {self.version}]:
            del self.states[version]

    def close(self) -> None:
        self.version = None
        self.states.clear()

    # ---- a transport ---------------------------------------------------------------------------------------------
    def _send(self, version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        """Process 0: every worker loads ``state``; their answers."""
        raise NotImplementedError

    def _bring(self, indices: list[int], version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        """Process 0: the workers ``indices`` (restarted) get the current ``state``; their answers."""
        raise NotImplementedError


class ObjectStoreSync(WeightSync):
    """``weight_sync: object_store`` (see the module docstring)."""

    def _send(self, version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        import ray

        ref = ray.put(state)
        ray.get(self.coordinator.publish.remote(version, digest, [ref]), timeout=self.args.rollout_timeout_s)
        refs = [w.load_weights.remote(version, digest, ref) for w in self.workers.handles]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.args.rollout_timeout_s)
        answers = []
        for i, one in enumerate(refs):
            name = self.workers.names[i]
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
                # restarted, it loads the coordinator's latest weights (these) by itself
                info = self.workers.await_alive(i)
                answers.append(info if info["version"] == version else self._bring([i], version, digest, state)[0])
        return answers

    def _bring(self, indices: list[int], version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        names = [self.workers.names[i] for i in indices]
        return self.session.wait([self.workers.handles[i].reload_latest.remote() for i in indices],
                                 self.args.rollout_timeout_s, "reloading the weights", names)


class CollectiveSync(WeightSync):
    """``weight_sync: collective`` (see the module docstring and `collective`). ``devices``: the device type of each
    worker (from its answer at start), which picks the group's backend with the trainer's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.host = None
        self._formed_with: dict[str, int] | None = None

    @property
    def backend(self) -> str:
        from .collective import group_backend

        return group_backend([self.accelerator.device.type] + [info["device"] for info in self.workers.info])

    @property
    def device(self) -> torch.device:
        return self.accelerator.device if self.backend == "nccl" else torch.device("cpu")

    def _ensure_group(self) -> None:
        """Form the group when there is none or a worker was restarted since it was formed."""
        import ray

        from .collective import GroupHost

        timeout = self.args.rollout_timeout_s
        incarnations = ray.get(self.coordinator.incarnations.remote(), timeout=timeout)
        members = {name: incarnations.get(name, 0) for name in self.workers.names}
        if self.host is not None and self.host.group is not None and members == self._formed_with:
            return
        if self.host is None:
            self.host = GroupHost(ray.util.get_node_ip_address(), timeout)
        rendezvous = self.host.next_rendezvous(len(self.workers) + 1, self.backend)
        refs = [w.join_group.remote(rendezvous, i + 1) for i, w in enumerate(self.workers.handles)]
        self.host.form(rendezvous, self.device)  # returns once every worker joined (or raises past the timeout)
        self.session.wait(refs, timeout, f"joining the weight-sync group (formation {rendezvous.epoch})",
                          self.workers.names)
        self._formed_with = members
        logger.info("Weight-sync group formed (%s, formation %d, %d workers)", rendezvous.backend, rendezvous.epoch,
                    len(self.workers))

    def _send(self, version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        from .collective import broadcast_state

        buckets = bucket_layout(state, int(self.args.weight_sync_bucket_mb * (1 << 20)))
        attempts = self.args.max_worker_restarts + 1
        for attempt in range(attempts + 1):
            try:
                self._ensure_group()
                epoch = self.host.rendezvous.epoch
                self.host.set_timeout(self.args.rollout_timeout_s)
                refs = [w.receive_weights.remote(version, digest, buckets, epoch) for w in self.workers.handles]
                broadcast_state(self.host.group, state, buckets, self.device)
                return self.session.wait(refs, self.args.rollout_timeout_s,
                                         f"the weight sync of version {version}", self.workers.names)
            except Exception as err:
                if attempt == attempts:
                    raise
                # a member died (or was restarted) during the formation or the broadcast: wait for every worker,
                # then form the group again with the processes alive now
                logger.warning("The weight sync of version %d over the group failed (%s: %s); waiting for the workers "
                               "and forming the group again.", version, type(err).__name__, str(err)[:200])
                self.host.group = None
                deadline = time.monotonic() + self.args.rollout_timeout_s
                for i in range(len(self.workers)):
                    self.workers.await_alive(i, deadline, after=f"the weight sync of version {version} failed")
        raise AssertionError("unreachable")

    def _bring(self, indices: list[int], version: int, digest: str, state: dict[str, torch.Tensor]) -> list[dict]:
        # a restarted worker is a new process: the group is formed again with it, and the state broadcast to all
        return self._send(version, digest, state)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        self.host, self._formed_with = None, None
        super().close()


def build_weight_sync(kind: str, *args: Any, **kwargs: Any) -> WeightSync:
    """The transport ``kind`` (``weight_sync``) of a run."""
    if kind not in WEIGHT_SYNCS:
        raise ValueError(f"weight_sync={kind!r} is not valid; choose one of {', '.join(map(repr, WEIGHT_SYNCS))}.")
    return (ObjectStoreSync if kind == "object_store" else CollectiveSync)(*args, **kwargs)
