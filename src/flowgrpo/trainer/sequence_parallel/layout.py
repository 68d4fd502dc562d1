"""How the processes of a launch split into data-parallel replicas and sequence-parallel groups, and the data-parallel
view of the accelerator that the trainer's parts (rollouts, evaluation, health guards) work with.

With ``sequence_parallel_size = S`` a launch of ``W`` processes holds ``D = W / S`` data-parallel replicas. The S
processes of one replica form a sequence-parallel (SP) group: consecutive ranks ``d S .. d S + S - 1`` (within a node,
where the all-to-all is fastest). Every process of an SP group gets the same prompts and draws the same noise, so they
sample the same groups; each one holds a slice of every sample's tokens inside the transformer (Ulysses), and every
other computation (the scheduler, the losses) is replicated.

The parts of the trainer count samples per data-parallel replica, not per process: `DataParallelView` answers with
the replica's index and count, and its gathers keep one copy per replica (the SP group's first process, its *leader*),
so a reward, an advantage or an evaluation score is counted once however many processes hold the sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DataParallelView", "SequenceParallelLayout", "check_heads_divisible", "sequence_parallel_loss_scale"]


@dataclass(frozen=True)
class SequenceParallelLayout:
    """The position of one process in a launch of ``world_size`` processes split into SP groups of ``size``.

    ``rank = data_parallel_rank x size + sequence_parallel_rank``.
    """

    size: int
    rank: int
    world_size: int

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"sequence_parallel_size={self.size!r} must be an integer >= 1.")
        if self.world_size % self.size:
            raise ValueError(f"sequence_parallel_size={self.size} does not divide the {self.world_size} processes of "
                             "this launch; launch a multiple of it (data-parallel replicas x sequence_parallel_size) "
                             "or change it.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a launch of {self.world_size} processes.")

    @property
    def enabled(self) -> bool:
        """Whether samples are split over several processes (``size > 1``)."""
        return self.size > 1

    @property
    def data_parallel_size(self) -> int:
        """D: the data-parallel replicas (each one an SP group)."""
        return self.world_size // self.size

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica, 0 .. D - 1."""
        return self.rank // self.size

    @property
    def sequence_parallel_rank(self) -> int:
        """This process's place in its SP group, 0 .. S - 1 (0: the group's leader)."""
        return self.rank % self.size

    @property
    def is_leader(self) -> bool:
        """Whether this process is its SP group's first: the one whose scores are kept."""
        return self.sequence_parallel_rank == 0

    @property
    def leader_rank(self) -> int:
        """The global rank of this process's SP group leader."""
        return self.data_parallel_rank * self.size

    def group_ranks(self) -> list[int]:
        """The global ranks of this process's SP group."""
        return list(range(self.leader_rank, self.leader_rank + self.size))

    def leaders(self, rows: torch.Tensor | list, rows_per_process: int | None = None):
        """Keep the leaders' blocks of ``rows`` gathered from every process (``world_size`` equal blocks, in rank
        order): a tensor along dim 0, or a list of per-process lists (then ``rows_per_process`` is not used)."""
        if not self.enabled:
            return rows
        if isinstance(rows, torch.Tensor):
            per = rows.shape[0] // self.world_size if rows_per_process is None else rows_per_process
            blocks = rows.reshape(self.world_size, per, *rows.shape[1:])[::self.size]
            return blocks.reshape(self.data_parallel_size * per, *rows.shape[1:])
        return rows[::self.size]


class DataParallelView:
    """The accelerator as the trainer's parts see it with sequence parallelism: one "process" per data-parallel
    replica.

    ``process_index`` / ``num_processes`` are the replica's index and count (they pick a replica's share of the
    prompts and seed its noise); ``gather`` / ``gather_for_metrics`` / ``reduce`` / ``gather_object`` keep each
    replica's leader copy. Everything else (the device, autocast, ``is_main_process``, barriers, ``backward``) is the
    accelerator's own. With ``size == 1`` every answer is the accelerator's.
    """

    def __init__(self, accelerator: Any, layout: SequenceParallelLayout, group: Any = None):
        self._accelerator = accelerator
        self.layout = layout
        #: the process group of this process's SP group (the mesh's ``"ulysses"`` dimension)
        self.group = group

    def __getattr__(self, name: str):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self.layout.data_parallel_rank

    @property
    def num_processes(self) -> int:
        return self.layout.data_parallel_size

    @property
    def scores_rewards(self) -> bool:
        """Whether this process computes the rewards of its samples (only SP group leaders do; the others receive
        the leader's scores)."""
        return self.layout.is_leader

    def broadcast_from_leader(self, obj: Any) -> Any:
        """The SP group leader's ``obj`` on every process of the group (a picklable object; every process calls)."""
        if not self.layout.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self.layout.leader_rank, group=self.group)
        return box[0]

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``accelerator.gather`` with one copy per replica: ``(D x n, ...)`` for ``n`` rows per process."""
        gathered = self._accelerator.gather(tensor)
        if not self.layout.enabled:
            return gathered
        if tensor.dim() == 0:
            gathered = gathered.reshape(self.layout.world_size)
            return self.layout.leaders(gathered, 1)
        return self.layout.leaders(gathered, tensor.shape[0])

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        """``accelerator.reduce`` over the replicas (each counted once): ``sum`` or ``mean``."""
        if not self.layout.enabled:
            return self._accelerator.reduce(tensor, reduction=reduction, scale=scale)
        rows = self.gather(tensor.unsqueeze(0)) * scale
        if reduction == "sum":
            return rows.sum(0)
        if reduction == "mean":
            return rows.mean(0)
        raise ValueError(f"reduction={reduction!r}: choose 'sum' or 'mean'.")

    def gather_object(self, obj: list) -> list:
        """``accelerate.utils.gather_object`` over the replicas: the leaders' lists, concatenated in replica order."""
        if self._accelerator.num_processes == 1:
            return list(obj)
        per_process: list[Any] = [None] * self._accelerator.num_processes
        torch.distributed.all_gather_object(per_process, list(obj))
        return [item for part in self.layout.leaders(per_process) for item in part]

    def gather_for_metrics(self, obj: Any, use_gather_object: bool = False):
        """``accelerator.gather_for_metrics`` over the replicas (objects: ``use_gather_object=True``)."""
        if not self.layout.enabled:
            return self._accelerator.gather_for_metrics(obj, use_gather_object=use_gather_object)
        if use_gather_object or not isinstance(obj, torch.Tensor):
            return self.gather_object(obj)
        return self.gather(obj)


def sequence_parallel_loss_scale(layout: SequenceParallelLayout) -> float:
    """The factor a training loss is multiplied by before its backward pass: ``S``.

    Each process of an SP group back-propagates only its slice of the tokens (the gather after the last layer
    returns each process its slice of the output's gradient), so the S processes' parameter gradients are the S
    parts of the sample's gradient and must be **summed**: ``g = sum_s g_s``. Data parallelism (DDP, FSDP2 over the
    whole launch) averages over all ``W = D x S`` processes: ``(1 / W) sum_{d, s} S g_{d, s} = (1 / D) sum_d g_d``,
    the mean over replicas of their summed gradients, as without sequence parallelism.
    """
    return float(layout.size)


def check_heads_divisible(num_heads: int, size: int, where: str) -> None:
    """Ulysses gives each process ``num_heads / S`` attention heads: refuse a head count S does not divide."""
    if num_heads % size:
        divisors = [d for d in range(2, num_heads + 1) if num_heads % d == 0 and d <= 64]
        raise ValueError(f"sequence_parallel_size={size}: {where} has {num_heads} attention heads, which "
                         f"{size} does not divide (Ulysses gives each process heads / S of them); use one of "
                         f"{divisors[:8]}.")
