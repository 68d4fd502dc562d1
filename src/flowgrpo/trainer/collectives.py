"""Agreement between the processes of a launch: small all-reduces that every process enters (a local no-op with one
process), so that every process takes the same branch after a local event (a failed reward, a worker error, a
preemption signal)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["any_process", "max_over_processes"]


def max_over_processes(accelerator: Any, value: int | torch.Tensor) -> int:
    """The largest ``value`` over every process of ``accelerator``'s launch (an integer all-reduce)."""
    t = value.detach().reshape(()).to(torch.int64) if isinstance(value, torch.Tensor) else \
        torch.tensor(int(value), dtype=torch.int64)
    if accelerator.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        t = t.to(accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def any_process(accelerator: Any, flag: bool | torch.Tensor) -> bool:
    """Logical OR of ``flag`` over every process."""
    if isinstance(flag, torch.Tensor):
        flag = bool(flag.detach().reshape(()).item())
    return max_over_processes(accelerator, int(bool(flag))) > 0
