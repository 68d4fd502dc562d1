"""How many threads each part of a CPU run may use, so that the run never oversubscribes its cores.

A training process on a CPU runs three kinds of work at the same time: the main thread's transformer passes
(torch's intra-op OpenMP team), the background decode thread (VAE passes, also torch ops) and the reward pool
(numpy, or onnxruntime for OCR). When these threads add up to more than the cores the process owns, OpenMP's
teams stall at every barrier waiting for a descheduled member, and a step becomes several times slower (measured
on 2 cores: the toy recipe at 2.4 s per step with torch's default of 2 threads, 1.3 s with one; see
docs/benchmarks.md). The policy gives each kind of work its own share:

    cores_per_process = $FLOWGRPO_CPU_THREADS, else max(1, usable cores // processes on this machine)
    main torch threads = max(1, cores_per_process - 1)   (one core left for the background threads), or
                         cores_per_process when the trained transformer(s) have ALL_CORES_MIN_PARAMETERS or more,
                         less one per busy background thread (at least 1) while the background works
    background threads = 1 torch thread each (decode, reward workers); onnxruntime: 1 intra-op thread
    torch inter-op threads = 1                           (nothing here uses inter-op parallelism)

The size rule: a small model's operations are too short to share between threads (OpenMP's fork and barrier cost
more than the split saves, and a descheduled team member stalls the step), so its main thread keeps one thread and
the background work gets the other cores. A larger model's matrix products split well, and its main thread is
the bottleneck, so it takes every core of its share; the background threads, idle most of the step, then overlap
it. Measured on 2 cores (docs/benchmarks.md, "CPU threads"): the 0.4M-parameter tiny pipeline and the 0.59M toy
world ran 1.5x slower with 2 torch threads than with 1; the 34M-parameter `small-cpu` model ran 1.44x faster with
both cores for its main thread than with one, and 1.16x faster than with 2 threads for every kind of work.

Yielding. With every core on the main thread, the background threads still take a core whenever they decode or
score, and the main thread's OpenMP team, one member short, stalls at every barrier: the step ran above its
bare-model floor by the background's whole cost. So the background tasks count themselves busy
(:func:`background_work`, :func:`background_task`) and the main thread, at the start of every block of the trained
transformer, forward and backward (:func:`install_main_thread_yield`), runs with one thread fewer per busy background
thread and with all of them again once the background is idle: the cores are never oversubscribed and never idle.
``$FLOWGRPO_CPU_SPLIT`` chooses another split for measurements (``yield-forward``: yielding at the forward blocks
only, as before the backward followed too; ``nice``: no yielding, the background threads at nice 19; ``both``: yield
and nice; ``none``).

"Processes on this machine" is ``LOCAL_WORLD_SIZE`` (set by ``accelerate launch`` and ``torchrun``), else 1;
"usable cores" is the process's CPU affinity. On a GPU run only the reward side matters: the OCR reward then gets
every core of the process's share (the transformer is not competing for them).

``torch.set_num_threads`` is per OS thread under OpenMP: a worker thread inherits the main thread's value when it
starts and keeps its own afterwards. So the background pools call :func:`limit_worker_threads` when each of their
threads starts, and the main thread's setting is left alone by them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

_T = TypeVar("_T")

__all__ = [
    "ALL_CORES_MIN_PARAMETERS",
    "background_task",
    "background_work",
    "busy_background_threads",
    "fixed_main_threads",
    "install_main_thread_yield",
    "main_thread_count",
    "CPU_SPLIT_ENV",
    "CPU_THREADS_ENV",
    "CPUThreadPlan",
    "ThreadTimeline",
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

CPU_SPLIT_ENV = "FLOWGRPO_CPU_SPLIT"
"""How a main thread with every core shares them with the background: ``yield`` (default), ``yield-forward``,
``nice``, ``both``, ``none`` (see the module docstring)."""

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
    yield_to_background: bool = False
    """The main thread gives one core back per busy background thread (see `main_thread_count`)."""
    background_nice: bool = False
    """The background threads run at the lowest OS priority (nice 19), on the cores the main thread leaves idle."""
    yield_in_backward: bool = True
    """Yielding also follows the background at the start of each block's backward pass (not only its forward)."""

    def describe(self) -> str:
        yielding = ", one fewer per busy background thread" if self.yield_to_background else ""
        return (f"{self.torch_threads} torch thread(s) for the main thread{yielding}, {self.worker_torch_threads} per "
                f"background worker, {self.reward_threads} for onnxruntime rewards ({self.cores_per_process} core(s) "
                f"for this process; {self.source})")


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
    shares = setting == "auto" and main == cores > 1
    split = os.environ.get(CPU_SPLIT_ENV, "yield").strip().lower() if shares else "none"
    if split not in ("yield", "yield-forward", "nice", "both", "none"):
        raise ValueError(f"{CPU_SPLIT_ENV}={split!r} is not valid; use yield, yield-forward, nice, both or none.")
    return CPUThreadPlan(cores, main, 1, 1, source, yield_to_background=split in ("yield", "yield-forward", "both"),
                         background_nice=split in ("nice", "both"), yield_in_backward=split != "yield-forward")


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
    if _CURRENT.background_nice and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except OSError:
            pass


def reward_thread_count(default: int | None = None) -> int | None:
    """Intra-op threads for a reward's own runtime (onnxruntime): the applied plan's, else ``default``."""
    return _CURRENT.reward_threads if _CURRENT is not None else default


# ---- the main thread yields cores to busy background threads ------------------------------------------------------
#
# With every core of the share on the main thread (a large model), a background thread that decodes or scores takes
# a core from the main thread's OpenMP team; a descheduled team member then stalls the team at every barrier. So the
# background tasks count themselves busy (`background_work`), and the main thread, at the start of every block of the
# trained transformer (`install_main_thread_yield`), runs with one thread fewer per busy background thread (at least
# one), and with all of them again once the background is idle.

_busy_background = 0
_busy_lock = threading.Lock()


@contextmanager
def background_work():
    """Count the calling background thread as busy for the duration of the block."""
    global _busy_background
    with _busy_lock:
        _busy_background += 1
        _note_timeline()
    try:
        yield
    finally:
        with _busy_lock:
            _busy_background -= 1
            _note_timeline()


class ThreadTimeline:
    """How long the main thread ran with each torch thread count against the number of busy background tasks:
    what a split does, measured (``scripts/benchmark.py`` reports it per step as ``thread_timeline_s``).

    ``start()`` (in the main thread) begins recording; ``take()`` returns ``{"main=N busy=B": seconds}`` since the
    last ``take()`` or ``reset()`` and starts a new period; ``reset()`` discards the period so far; ``stop()`` ends
    recording. One timeline records at a time. With yielding, ``main=1 busy=1`` on 2 cores is the split at work,
    ``main=2 busy=1`` is oversubscription and ``main=1 busy=0`` a core left idle.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._main = 1
        self._busy = 0
        self._last = 0.0

    def start(self) -> ThreadTimeline:
        global _TIMELINE
        import torch

        with self._lock:
            self._main, self._busy, self._last = torch.get_num_threads(), _busy_background, time.perf_counter()
            self._seconds = {}
        _TIMELINE = self
        return self

    def stop(self) -> None:
        global _TIMELINE
        if _TIMELINE is self:
            _TIMELINE = None

    def note(self, main_threads: int | None = None) -> None:
        """Close the current interval; the state from now on: ``main_threads`` (unchanged when ``None``) and the
        busy count now."""
        with self._lock:
            now = time.perf_counter()
            key = f"main={self._main} busy={self._busy}"
            self._seconds[key] = self._seconds.get(key, 0.0) + (now - self._last)
            self._last = now
            if main_threads is not None:
                self._main = main_threads
            self._busy = _busy_background

    def take(self) -> dict[str, float]:
        self.note()
        with self._lock:
            seconds, self._seconds = self._seconds, {}
        return seconds

    def reset(self) -> None:
        self.take()


_TIMELINE: ThreadTimeline | None = None


def _note_timeline(main_threads: int | None = None) -> None:
    timeline = _TIMELINE
    if timeline is not None:
        timeline.note(main_threads)


def background_task(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` counted as busy background work: what the decode and reward pools submit."""
    with background_work():
        return fn(*args, **kwargs)


def busy_background_threads() -> int:
    """How many background tasks are running now."""
    return _busy_background


def main_thread_count(plan: CPUThreadPlan | None = None) -> int | None:
    """The torch threads the main thread should use now: the plan's, less one per busy background thread (at least
    one) when the plan yields; ``None`` without a plan (leave torch alone)."""
    plan = _CURRENT if plan is None else plan
    if plan is None:
        return None
    if not plan.yield_to_background:
        return plan.torch_threads
    return max(1, plan.torch_threads - _busy_background)


_FOLLOWING_SUSPENDED = 0  # > 0 inside `fixed_main_threads` (main thread only)


@contextmanager
def fixed_main_threads(threads: int):
    """Inside the block the main thread runs at ``threads`` torch threads and does not follow the background (for
    measurements: the bare passes at a chosen thread count); afterwards its previous count, and following again."""
    global _FOLLOWING_SUSPENDED
    import torch

    if int(threads) < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    previous = torch.get_num_threads()
    _FOLLOWING_SUSPENDED += 1
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        _FOLLOWING_SUSPENDED -= 1
        torch.set_num_threads(previous)


def _follow_background() -> None:
    """Set the main thread's torch threads to `main_thread_count` (no-op elsewhere, when unchanged, or inside
    `fixed_main_threads`)."""
    if _FOLLOWING_SUSPENDED:
        return
    want = main_thread_count()
    if want is not None and threading.current_thread() is threading.main_thread():
        import torch

        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
            _note_timeline(want)


def _yield_hook(module, args) -> None:
    _follow_background()


def _yield_in_backward_hook(module, args, output) -> None:
    """Forward hook: when the block's output will be differentiated, follow the background again at the start of
    the block's backward (a hook on the output's gradient; the CPU autograd engine runs it in the main thread)."""
    import torch

    if not torch.is_grad_enabled():
        return
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    for value in outputs:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(_yield_on_gradient)
            return


def _yield_on_gradient(grad):
    _follow_background()
    return None  # the gradient is left unchanged


def install_main_thread_yield(modules) -> list:
    """When the applied plan yields to the background, adjust the main thread's torch threads at the start of each
    of ``modules``' forward passes and of each block (every module held in an ``nn.ModuleList``) inside them, and at
    the start of each of their backward passes, so that it follows the background's load within one block in both
    directions. Returns the hook handles (empty when nothing yields)."""
    import torch

    if _CURRENT is None or not _CURRENT.yield_to_background:
        return []
    handles = []
    for root in modules:
        targets = [root] + [child for module in root.modules() if isinstance(module, torch.nn.ModuleList)
                            for child in module]
        handles += [target.register_forward_pre_hook(_yield_hook) for target in targets]
        if _CURRENT.yield_in_backward:
            handles += [target.register_forward_hook(_yield_in_backward_hook) for target in targets]
    return handles
