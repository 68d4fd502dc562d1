"""``weight_sync: collective``: a torch.distributed process group joining the trainer's process that holds the weights
(rank 0) and the rollout workers (ranks 1 .. W), over which each sync's state goes out as bucketed broadcasts.

**The group.** Rank 0 of the launch hosts a ``TCPStore`` for the run; each formation of the group (an *epoch*: the
first sync, and again whenever a worker was restarted by Ray, since a new process must join) uses a fresh key prefix
made of a random secret and the epoch, so a process that missed a formation cannot join it by mistake. The backend is
gloo when the trainer or a worker runs on a CPU, NCCL when all of them run on CUDA (one GPU per rank: a colocated
worker sharing the trainer's GPU must use ``weight_sync: object_store``). Gloo binds to the node's address that Ray
reports, so the group works across nodes. Every formation and every broadcast is bounded by the group's timeout
(``rollout_timeout_s``): a member that never joins, or dies, makes the others fail instead of waiting.

**A sync** (`broadcast_state` on the trainer, `receive_state` on a worker): the layout (each tensor's bucket, offset,
dtype and shape, `weights.bucket_layout`) reaches the workers with the Ray call that makes them receive; each worker
checks it against its own tensors first, then every bucket is broadcast from rank 0 and copied into the worker's live
tensors. A worker whose tensors do not match still receives every bucket (the others are not left waiting) and then
refuses the state. Version and digest are checked afterwards as with the object store.

**Security.** The store and gloo's connections are unauthenticated TCP, as torch.distributed's always are; the key
prefix is a 128-bit secret handed to the workers through Ray (token-authenticated), the payload is raw tensor bytes
(never unpickled), and each worker's digest of what it then holds is checked by the trainer: a stranger who reaches the
ports can disturb a sync, not run code or slip in other weights unnoticed.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .weights import TensorSlot, pack_bucket, unpack_bucket

__all__ = ["GroupHost", "Rendezvous", "broadcast_state", "group_backend", "join_group", "receive_state"]

#: torch.distributed backends of the group, by the devices of its members
GROUP_BACKENDS = ("gloo", "nccl")


def group_backend(devices: list[str]) -> str:
    """``"nccl"`` when every member (the trainer and each worker, their device types) runs on CUDA, else ``"gloo"``."""
    return "nccl" if devices and all(d.startswith("cuda") for d in devices) else "gloo"


@dataclass(frozen=True)
class Rendezvous:
    """How the members of one formation of the group meet: the store's address, the formation's key prefix (secret and
    epoch), its size, the torch.distributed backend and the timeout of every wait."""

    host: str
    port: int
    prefix: str
    world_size: int
    backend: str
    timeout_s: float
    epoch: int


def _make_group(store: Any, rendezvous: Rendezvous, rank: int, address: str, device: torch.device) -> Any:
    import torch.distributed as dist

    prefixed = dist.PrefixStore(rendezvous.prefix, store)
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    if rendezvous.backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, rendezvous.world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)] if address else \
        [dist.ProcessGroupGloo.create_default_device()]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, rendezvous.world_size, options)


class GroupHost:
    """The trainer's side (rank 0): the run's store and the formations of the group. ``address``: this node's address
    as the workers reach it (Ray's node address)."""

    def __init__(self, address: str, timeout_s: float):
        import torch.distributed as dist

        self.address = address
        self.timeout_s = float(timeout_s)
        self.store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        self.secret = secrets.token_hex(16)
        self.epoch = 0
        self.group: Any = None
        self.rendezvous: Rendezvous | None = None

    def next_rendezvous(self, world_size: int, backend: str) -> Rendezvous:
        """The rendezvous of a new formation of ``world_size`` members (this one and ``world_size - 1`` workers)."""
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"backend={backend!r}; the group runs on gloo or nccl.")
        self.epoch += 1
        return Rendezvous(self.address, int(self.store.port), f"{self.secret}/{self.epoch}/", int(world_size), backend,
                          self.timeout_s, self.epoch)

    def form(self, rendezvous: Rendezvous, device: torch.device) -> None:
        """Join ``rendezvous`` as rank 0 (blocks until every worker joined, at most the timeout); the previous group is
        dropped."""
        self.group = None
        self.group = _make_group(self.store, rendezvous, 0, self.address, device)
        self.rendezvous = rendezvous

    def set_timeout(self, timeout_s: float) -> None:
        """The time limit of the group's next operations on this side (the configuration may have changed)."""
        if self.group is not None:
            self.group.set_timeout(datetime.timedelta(seconds=float(timeout_s)))

    def close(self) -> None:
        self.group, self.rendezvous = None, None
        self.store = None


def join_group(rendezvous: Rendezvous, rank: int, address: str, device: torch.device) -> Any:
    """A worker's side of a formation: its process group as ``rank`` (blocks until every member joined)."""
    import torch.distributed as dist

    store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False,
                          timeout=datetime.timedelta(seconds=rendezvous.timeout_s))
    return _make_group(store, rendezvous, rank, address, device)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def broadcast_state(group: Any, state: Mapping[str, torch.Tensor], buckets: list[list[TensorSlot]],
                    device: torch.device | str = "cpu") -> None:
    """Rank 0: every bucket of ``state``, packed on ``device`` and broadcast, one after the other."""
    for bucket in buckets:
        _broadcast(group, pack_bucket(state, bucket, device))


def receive_state(group: Any, buckets: list[list[TensorSlot]], live: Mapping[str, torch.Tensor] | None,
                  device: torch.device | str = "cpu") -> None:
    """A worker: receive every bucket and copy it into ``live`` (None: receive and drop, so that a worker that
    refuses the state still takes part in every broadcast)."""
    for bucket in buckets:
        flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].torch_dtype, device=device)
        _broadcast(group, flat)
        if live is not None:
            unpack_bucket(flat, bucket, live)
