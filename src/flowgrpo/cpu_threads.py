"""How many threads each part of a CPU run may use, so that the run never oversubscribes its cores.

A training process on a CPU runs three kinds of work at the same time: the main thread's transformer passes
(torch's intra-op OpenMP team), the background decode thread (VAE passes, also torch ops) and the reward pool
(numpy, or onnxruntime for OCR). When these threads add up to more than the cores the process owns, OpenMP's
teams stall at every barrier waiting for a descheduled member, and a step becomes several times slower (measured
on 2 cores: the toy recipe at 2.4 s per step with torch's default of 2 threads, 1.3 s with one; see
docs/benchmarks.md). The policy gives each kind of work its own share:

    cores_per_process = $FLOWGRPO_CPU_THREADS, else max(1, usable cores // processes on this machine)
    main torch threads = max(1, cores_per_process - 1)   (one core left for the background threads), or
                         cores_per_process when the trained transformer(s) have ALL_CORES_MIN_PARAMETERS or more
    background threads = 1 torch thread each (decode, reward workers); onnxruntime: 1 intra-op thread
    torch inter-op threads = 1                           (nothing here uses inter-op parallelism)

The size rule: a small model's operations are too short to share between threads (OpenMP's fork and barrier cost
more than the split saves, and a descheduled team member stalls the step), so its main thread keeps one thread and
the background work gets the other cores. A larger model's matrix products split well, and its main thread is
the bottleneck, so it takes every core of its share; the background threads, idle most of the step, then overlap
it. Measured on 2 cores (docs/benchmarks.md, "CPU threads"): the 0.4M-parameter tiny pipeline and the 0.59M toy
world ran 1.5x slower with 2 torch threads than with 1; the 34M-parameter `small-cpu` model ran 1.44x faster with
both cores for its main thread than with one, and 1.16x faster than with 2 threads for every kind of work.

"Processes on this machine" is ``LOCAL_WORLD_SIZE`` (set by ``accelerate launch`` and ``torchrun``), else 1;
"usable cores" is the process's CPU affinity. On a GPU run only the reward side matters: the OCR reward then gets
every core of the process's share (the transformer is not competing for them).

``torch.set_num_threads`` is per OS thread under OpenMP: a worker thread inherits the main thread's value when it
starts and keeps its own afterwards. So the background pools call :func:`limit_worker_threads` when each of their
threads starts, and the main thread's setting is left alone by them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "ALL_CORES_MIN_PARAMETERS",
    "CPU_THREADS_ENV",
    "CPUThreadPlan",
    "apply_cpu_thread_plan",
    "current_cpu_thread_plan",
    "limit_worker_threads",
    "parse_cpu_threads",
    "plan_cpu_threads",
    "reward_thread_count",
    "usable_cores",
]

ALL_CORES_MIN_PARAMETERS = 10_000_000
"""From this many parameters in the trained transformer(s) on, ``auto`` gives the main thread every core of its share."""

CPU_THREADS_ENV = "FLOWGRPO_CPU_THREADS"
"""Cores this process may use (overrides the share computed from the machine, e.g. under a parallel test run)."""


@dataclass(frozen=True)
class CPUThreadPlan:
    """The thread counts of one process (see the module docstring for how they are chosen)."""

    cores_per_process: int
    torch_threads: int
    worker_torch_threads: int
    reward_threads: int
    source: str

    def describe(self) -> str:
        return (f"{self.torch_threads} torch thread(s) for the main thread, {self.worker_torch_threads} per background "
                f"worker, {self.reward_threads} for onnxruntime rewards ({self.cores_per_process} core(s) for this "
                f"process; {self.source})")


_CURRENT: CPUThreadPlan | None = None


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _local_processes() -> int:
    for name in ("LOCAL_WORLD_SIZE", "ACCELERATE_NUM_PROCESSES_LOCAL"):
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def parse_cpu_threads(value: str | int | None, name: str = "cpu_threads") -> str | int:
    """Validate a ``cpu_threads`` setting: ``"auto"``, ``"keep"`` or a positive integer (also as a string)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid; use 'auto', 'keep' or a positive integer.")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "keep"):
            return text
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not valid; use 'auto' (the thread policy), 'keep' (leave torch's "
                             "setting alone) or a positive integer (torch intra-op threads).") from None
    if number < 1:
        raise ValueError(f"{name}={value!r} must be >= 1 (or 'auto' / 'keep').")
    return number


def plan_cpu_threads(cpu_threads: str | int = "auto", *, on_cpu: bool = True,
                     model_parameters: int | None = None) -> CPUThreadPlan | None:
    """The thread plan for this process, or ``None`` for ``"keep"`` (no policy: every thread uses torch's and
    onnxruntime's own settings, as before the policy existed).

    Args:
        cpu_threads: ``"auto"`` (the policy), ``"keep"`` or an integer (the main thread's torch threads; the
            background threads still get one each).
        on_cpu: whether the transformer runs on the CPU. On a GPU the main thread's torch setting is left alone
            and the reward side gets the whole share of cores.
        model_parameters: parameters of the transformer(s) the main thread runs; from
            ``ALL_CORES_MIN_PARAMETERS`` on, ``"auto"`` gives the main thread every core of the share (``None``:
            treated as a small model).
    """
    import torch

    setting = parse_cpu_threads(cpu_threads)
    if setting == "keep":
        return None
    env = os.environ.get(CPU_THREADS_ENV)
    if env:
        cores = parse_cpu_threads(env, CPU_THREADS_ENV)
        if not isinstance(cores, int):
            raise ValueError(f"{CPU_THREADS_ENV}={env!r} must be a positive integer (cores for this process).")
        source = f"{CPU_THREADS_ENV}={cores}"
    else:
        processes = _local_processes()
        cores = max(1, usable_cores() // processes)
        source = f"{usable_cores()} usable core(s) / {processes} local process(es)"
    if not on_cpu:
        return CPUThreadPlan(cores, torch.get_num_threads(), 1, cores, source + ", GPU run")
    if setting == "auto":
        large = (model_parameters or 0) >= ALL_CORES_MIN_PARAMETERS
        main = cores if large else max(1, cores - 1)
        if large and cores > 1:
            source += f", a {model_parameters / 1e6:.0f}M-parameter model: every core for the main thread"
    else:
        main = int(setting)
        source += f", main thread fixed at {main}"
    return CPUThreadPlan(cores, main, 1, 1, source)


def apply_cpu_thread_plan(plan: CPUThreadPlan | None) -> CPUThreadPlan | None:
    """Set the calling (main) thread's torch threads and remember ``plan`` for the workers and rewards
    (``None``: forget any earlier plan and change nothing)."""
    import torch

    global _CURRENT
    if plan is None:
        _CURRENT = None
        return None
    if torch.get_num_threads() != plan.torch_threads:
        torch.set_num_threads(plan.torch_threads)
    try:
        if torch.get_num_interop_threads() != 1:
            torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # inter-op work has already started in this process: the count can no longer change
    _CURRENT = plan
    return plan


def current_cpu_thread_plan() -> CPUThreadPlan | None:
    """The plan last applied in this process, or ``None``."""
    return _CURRENT


def limit_worker_threads() -> None:
    """Thread-pool initializer: give the starting background thread the applied plan's torch intra-op count
    (nothing changes when no plan was applied in this process)."""
    if _CURRENT is None:
        return
    import torch

    torch.set_num_threads(_CURRENT.worker_torch_threads)


def reward_thread_count(default: int | None = None) -> int | None:
    """Intra-op threads for a reward's own runtime (onnxruntime): the applied plan's, else ``default``."""
    return _CURRENT.reward_threads if _CURRENT is not None else default
