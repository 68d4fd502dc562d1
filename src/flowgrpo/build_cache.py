"""Build a folder once, atomically, even when several processes ask for it at the same time.

Used by the caches of built artefacts (tiny pipelines, the toy world): a folder is built in a private staging folder
next to its target and renamed into place, so that an interrupted build is never mistaken for a finished one; an
exclusive lock on ``.<name>.lock`` beside the target makes concurrent callers (parallel test workers, the ranks of a
launch) wait for the first builder instead of building the same thing again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["build_folder_once", "exclusive_lock"]


@contextmanager
def exclusive_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the duration of the block.

    The lock is released when the block ends or the process dies. Where the platform has no ``fcntl`` (Windows),
    the block runs unlocked: the atomic rename still keeps every finished folder complete.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux/macOS
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_folder_once(target: str | os.PathLike[str], build: Callable[[Path], object],
                      marker: str = "model_index.json", what: str = "folder") -> Path:
    """Return ``target``, calling ``build(staging_path)`` first if ``target/marker`` does not exist yet.

    ``build`` writes the folder at the path it is given (which does not exist yet); the result is renamed to
    ``target`` in one step. Concurrent callers wait on a lock and then find the finished folder.

    Raises:
        RuntimeError: ``target`` exists but holds no ``marker`` (something else is in the way; the message says to
            delete it).
    """
    target = Path(target)
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    with exclusive_lock(lock):
        if (target / marker).is_file():  # built by another process while this one waited
            # a caller that came after the builder removed the lock made a new one: remove it too (safe for the
            # same reason as below; the folder is complete)
            lock.unlink(missing_ok=True)
            return target
        if target.exists() and not (target.is_dir() and not any(target.iterdir())):
            raise RuntimeError(f"Cannot create the {what} {target}: it exists but holds no {marker}. Delete it and "
                               "retry.")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging / "build")
            if target.is_dir():
                target.rmdir()  # an empty folder left in the way
            os.rename(staging / "build", target)
            # Safe to remove while held: whoever locks it (or a stale copy of it) next re-checks the marker first.
            lock.unlink(missing_ok=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
