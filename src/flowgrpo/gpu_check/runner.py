"""Runs one check in its own process group with a time limit, and collects what it left behind.

A check's command starts in a new session (its own process group) with its output in ``<check dir>/output.log``.
While it runs, the runner notes every descendant process (``accelerate launch`` and ``torchrun`` start their
workers in sessions of their own, out of reach of a process-group signal) and samples ``nvidia-smi`` for the GPUs'
memory. At the time limit it sends SIGTERM to the group and to every descendant, waits ``kill_grace_s``, then
sends SIGKILL to whatever is left. Descendants still alive after a normal exit are killed too, so a check never
leaves workers holding GPU memory for the next one.

Afterwards it reads the check's ``result.json`` and the per-process peak memory files (:mod:`.probe`) and any JSON
file the check declares in ``collect``. Status: ``passed`` (exit 0, and the result file, when written, says so),
``failed`` or ``timed_out``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .plan import Check
from .probe import CHECK_DIR_ENV, MEMORY_DIR_ENV, RESULT_FILE, read_memory_records

__all__ = ["CheckResult", "GpuMemorySampler", "LOG_FILE", "NVIDIA_SMI_QUERY", "run_check"]

LOG_FILE = "output.log"
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")


class GpuMemorySampler:
    """Polls a ``nvidia-smi``-style command (CSV lines ``index, used MiB, total MiB``) in a thread; keeps each GPU's
    first and highest reading. ``available`` turns False when the command cannot run (no driver)."""

    def __init__(self, command: Sequence[str] = NVIDIA_SMI_QUERY, interval_s: float = 1.0):
        self.command = list(command)
        self.interval_s = interval_s
        self.peak_mib: dict[str, float] = {}
        self.baseline_mib: dict[str, float] = {}
        self.total_mib: dict[str, float] = {}
        self.samples = 0
        self.available = shutil.which(self.command[0]) is not None or os.path.isfile(self.command[0])
        self.error: str | None = None if self.available else f"{self.command[0]} not found"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, float] | None:
        """One reading ``{gpu index: used MiB}``, also folded into the peaks; ``None`` when it failed."""
        if not self.available:
            return None
        try:
            out = subprocess.run(self.command, capture_output=True, text=True, timeout=15, check=True).stdout
        except (OSError, subprocess.SubprocessError) as err:
            self.available, self.error = False, f"{type(err).__name__}: {err}"
            return None
        reading = {}
        for line in out.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 2:
                continue
            try:
                index, used = parts[0], float(parts[1])
            except ValueError:
                continue
            reading[index] = used
            self.baseline_mib.setdefault(index, used)
            self.peak_mib[index] = max(used, self.peak_mib.get(index, used))
            if len(parts) > 2:
                try:
                    self.total_mib[index] = float(parts[2])
                except ValueError:
                    pass
        self.samples += 1
        return reading

    def _loop(self) -> None:
        while not self._stop.is_set() and self.available:
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> GpuMemorySampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="gpu-check-nvidia-smi", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=20)
        if self.available:
            self.sample()  # one last reading after the work ended

    def as_dict(self) -> dict[str, Any]:
        return {"available": self.available, "samples": self.samples, "peak_mib": dict(self.peak_mib),
                "baseline_mib": dict(self.baseline_mib), "total_mib": dict(self.total_mib), "error": self.error}


@dataclass
class CheckResult:
    """What one check did: ``status`` is ``passed``, ``failed`` or ``timed_out``."""

    name: str
    description: str
    command: list[str]
    status: str
    returncode: int | None
    wall_s: float
    timeout_s: float
    started_at: str
    log: str
    output_tail: str
    metrics: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    summary: str = ""
    peak_memory: dict[str, Any] = field(default_factory=dict)
    killed_processes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tail(path: Path, lines: int, max_bytes: int = 256 * 1024) -> str:
    """The last ``lines`` lines of a log (progress-bar carriage returns count as line ends)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    kept = [ln for ln in text.split("\n") if ln.strip()]
    return "\n".join(kept[-lines:])


class _ProcessTree:
    """Every process started under a root pid, remembered while they live (psutil identities survive re-parenting)."""

    def __init__(self, pid: int):
        import psutil

        self._psutil = psutil
        self.root_pid = pid
        self.known: dict[int, Any] = {}
        self.snapshot()

    def snapshot(self) -> None:
        try:
            children = self._psutil.Process(self.root_pid).children(recursive=True)
        except self._psutil.Error:
            return
        for child in children:
            self.known.setdefault(child.pid, child)

    def alive(self) -> list[Any]:
        alive = []
        for proc in list(self.known.values()):
            try:
                if proc.is_running() and proc.status() != self._psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except self._psutil.Error:
                continue
        return alive

    def signal_all(self, sig: int) -> None:
        try:
            os.killpg(self.root_pid, sig)  # the check's own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in self.alive():
            try:
                proc.send_signal(sig)
            except self._psutil.Error:
                continue

    def terminate(self, grace_s: float) -> int:
        """SIGTERM everything, wait ``grace_s``, SIGKILL the rest; returns how many processes were signalled."""
        self.snapshot()
        victims = self.alive()
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        self.snapshot()
        if self.alive():
            self.signal_all(signal.SIGKILL)
            self._psutil.wait_procs(self.alive(), timeout=5)
        return len(victims)


def _peak_from_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    per_process = []
    peak_alloc = peak_reserved = 0.0
    for rec in records:
        for device, values in (rec.get("devices") or {}).items():
            if not isinstance(values, dict):
                continue
            alloc = float(values.get("max_memory_allocated_mib", 0.0))
            reserved = float(values.get("max_memory_reserved_mib", 0.0))
            peak_alloc, peak_reserved = max(peak_alloc, alloc), max(peak_reserved, reserved)
            per_process.append({"tag": rec.get("tag"), "rank": rec.get("rank"), "pid": rec.get("pid"),
                                "device": device, "max_memory_allocated_mib": alloc,
                                "max_memory_reserved_mib": reserved})
    return {"torch_max_allocated_mib": peak_alloc if per_process else None,
            "torch_max_reserved_mib": peak_reserved if per_process else None, "per_process": per_process}


def _clear_previous(folder: Path, collect: Sequence[str]) -> None:
    """Results of an earlier run in the same folder must not be read as this run's."""
    for name in (RESULT_FILE, LOG_FILE, *collect):
        (folder / name).unlink(missing_ok=True)
    memory = folder / "memory"
    if memory.is_dir():
        for path in memory.glob("*.json"):
            path.unlink(missing_ok=True)


def run_check(check: Check, folder: str | os.PathLike, *, cwd: str | os.PathLike | None = None,
              env: Mapping[str, str] | None = None, tail_lines: int = 40, kill_grace_s: float = 10.0,
              poll_s: float = 0.2, gpu_sampler: GpuMemorySampler | None = None) -> CheckResult:
    """Run ``check`` with its output and files in ``folder``; never raises for a failing or hanging check."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _clear_previous(folder, check.collect)
    memory_dir = folder / "memory"
    memory_dir.mkdir(exist_ok=True)
    log_path = folder / LOG_FILE
    child_env = dict(os.environ if env is None else env)
    child_env.update({CHECK_DIR_ENV: str(folder), MEMORY_DIR_ENV: str(memory_dir), "PYTHONUNBUFFERED": "1"})

    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    sampler = gpu_sampler
    if sampler is not None:
        sampler.start()
    tic = time.monotonic()
    timed_out = False
    killed = 0
    returncode: int | None = None
    failures: list[str] = []
    notes: list[str] = []
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(check.command)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(list(check.command), cwd=cwd, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            failures.append(f"could not start {check.command[0]!r}: {err}")
            proc = None
        if proc is not None:
            tree = _ProcessTree(proc.pid)
            deadline = tic + check.timeout_s
            last_snapshot = 0.0
            try:
                while proc.poll() is None:
                    now = time.monotonic()
                    if now >= deadline:
                        timed_out = True
                        killed = tree.terminate(kill_grace_s)
                        proc.wait(timeout=30)
                        break
                    if now - last_snapshot >= 1.0:
                        tree.snapshot()
                        last_snapshot = now
                    time.sleep(poll_s)
            except BaseException:  # interrupted: take the check's processes down with us
                tree.terminate(kill_grace_s)
                raise
            finally:
                returncode = proc.poll()
                leftovers = tree.alive()
                if leftovers and not timed_out:
                    killed += tree.terminate(kill_grace_s)
                    notes.append(f"{len(leftovers)} process(es) were still running after the check exited and were "
                                 f"killed: {sorted(p.pid for p in leftovers)}")
    wall = time.monotonic() - tic
    if sampler is not None:
        sampler.stop()

    result_data: dict[str, Any] = {}
    result_path = folder / RESULT_FILE
    if result_path.is_file():
        try:
            result_data = json.loads(result_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            failures.append(f"unreadable {RESULT_FILE}: {err}")
    metrics = dict(result_data.get("metrics") or {})
    failures += [str(f) for f in result_data.get("failures") or []]
    for name in check.collect:
        path = folder / name
        if path.is_file():
            try:
                metrics[Path(name).stem] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                failures.append(f"unreadable {name}: {err}")
        elif returncode == 0:
            failures.append(f"the check exited 0 but did not write {name}")

    if timed_out:
        status = "timed_out"
        failures.insert(0, f"time limit of {check.timeout_s:.0f} s reached; the process tree was terminated")
    elif returncode == 0 and result_data.get("passed", True) and not failures:
        status = "passed"
    else:
        status = "failed"
        if returncode not in (0, None):
            failures.insert(0, f"exit status {returncode}")
    peak = _peak_from_records(read_memory_records(memory_dir))
    if sampler is not None:
        peak["nvidia_smi"] = sampler.as_dict()
    return CheckResult(
        name=check.name, description=check.description, command=list(check.command), status=status,
        returncode=returncode, wall_s=round(wall, 3), timeout_s=check.timeout_s, started_at=started_at,
        log=str(log_path), output_tail=_tail(log_path, tail_lines), metrics=metrics, failures=failures,
        summary=str(result_data.get("summary") or ""), peak_memory=peak, killed_processes=killed,
        notes=notes,
    )
