"""What a check's child processes hand back to the runner: a result file and each process's peak GPU memory.

The runner gives every check a folder and two environment variables:

* ``FLOWGRPO_GPU_CHECK_DIR``: the check's folder; the child writes ``result.json`` there with :func:`write_result`
  (``passed``, ``metrics``, ``failures``, ``summary``).
* ``FLOWGRPO_GPU_CHECK_MEMORY_DIR``: every process that used CUDA writes ``<tag>-rank<R>-pid<P>.json`` there at
  exit (:func:`record_peak_memory`, installed by :func:`install_memory_recorder`) with
  ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of each device it touched.

Scripts that know nothing of this (``src/train.py``, ``scripts/benchmark.py``) run under the probe, also under
``accelerate launch -m``::

    python -m flowgrpo.gpu_check.probe scripts/benchmark.py --preset sd35m-random
    accelerate launch --config_file accelerate_configs/zero2.yaml -m flowgrpo.gpu_check.probe src/train.py recipe.yaml

This module imports nothing heavy: torch is only consulted when the process has imported it already (a process that
never imported torch never used the GPU).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHECK_DIR_ENV", "MEMORY_DIR_ENV", "RESULT_FILE", "install_memory_recorder", "main", "read_memory_records",
           "record_peak_memory", "write_result"]

CHECK_DIR_ENV = "FLOWGRPO_GPU_CHECK_DIR"
MEMORY_DIR_ENV = "FLOWGRPO_GPU_CHECK_MEMORY_DIR"
RESULT_FILE = "result.json"
MIB = 2**20


def _rank() -> int:
    for name in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def write_result(passed: bool, metrics: dict[str, Any] | None = None, failures: list[str] | None = None,
                 summary: str = "", check_dir: str | os.PathLike | None = None) -> Path | None:
    """Write the check's ``result.json`` (into ``check_dir`` or ``$FLOWGRPO_GPU_CHECK_DIR``); returns its path, or
    ``None`` when neither is set (a child run by hand)."""
    folder = check_dir if check_dir is not None else os.environ.get(CHECK_DIR_ENV)
    if not folder:
        return None
    path = Path(folder) / RESULT_FILE
    _write_json(path, {"passed": bool(passed), "metrics": metrics or {}, "failures": list(failures or []),
                       "summary": summary})
    return path


def record_peak_memory(tag: str = "process", memory_dir: str | os.PathLike | None = None) -> Path | None:
    """Write this process's peak CUDA memory per device it used; nothing when it never initialised CUDA."""
    folder = memory_dir if memory_dir is not None else os.environ.get(MEMORY_DIR_ENV)
    torch = sys.modules.get("torch")
    if not folder or torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        devices = {}
        for index in range(torch.cuda.device_count()):
            reserved = torch.cuda.max_memory_reserved(index)
            if reserved == 0:
                continue
            devices[str(index)] = {
                "name": torch.cuda.get_device_name(index),
                "max_memory_allocated_mib": torch.cuda.max_memory_allocated(index) / MIB,
                "max_memory_reserved_mib": reserved / MIB,
            }
    except Exception as err:  # a broken CUDA state at exit must not hide the process's own exit status
        devices = {"error": f"{type(err).__name__}: {err}"}
    rank = _rank()
    path = Path(folder) / f"{tag}-rank{rank}-pid{os.getpid()}.json"
    _write_json(path, {"tag": tag, "rank": rank, "pid": os.getpid(), "devices": devices})
    return path


_INSTALLED: set[str] = set()


def install_memory_recorder(tag: str = "process") -> None:
    """Record this process's peak CUDA memory when it exits (once per tag)."""
    if tag not in _INSTALLED:
        _INSTALLED.add(tag)
        atexit.register(record_peak_memory, tag)


def read_memory_records(memory_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record written into ``memory_dir`` (unreadable files are skipped)."""
    records = []
    folder = Path(memory_dir)
    if not folder.is_dir():
        return records
    for path in sorted(folder.glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return records


def main(argv: list[str] | None = None) -> int:
    """``python -m flowgrpo.gpu_check.probe SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` and record its peak."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m flowgrpo.gpu_check.probe SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    if not Path(script).is_file():
        print(f"flowgrpo.gpu_check.probe: no such script {script!r} (relative paths are read from {Path.cwd()})",
              file=sys.stderr)
        return 2
    tag = Path(script).stem
    install_memory_recorder(tag)
    sys.argv = argv
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
