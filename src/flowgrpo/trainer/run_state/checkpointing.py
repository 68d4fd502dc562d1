"""Crash-safe checkpoints: staged, flushed, renamed into place; found, checked and rotated by step.

A checkpoint of step N is written into a staging folder ``output_dir/.staging-checkpoint-N`` (every process writes
its share there), then the main process flushes every file to disk (``fsync``), writes a manifest of the files and
their sizes, flushes the folder, and renames it to ``output_dir/checkpoint-N``. A rename within one file system is
atomic, so whenever the run is killed, each ``checkpoint-N`` is either absent or complete; what a kill leaves
behind is a staging folder, which `remove_stale_staging` deletes at the next start.

*Complete* (`checkpoint_problem` returns ``None``) means: the folder is named ``checkpoint-N``, holds a readable
``trainer_state.json`` whose ``global_step`` is N, and, when it has a manifest (every checkpoint written here
does), every file listed there exists with the recorded size. Folders written by plain ``transformers.Trainer``
have no manifest; their ``trainer_state.json``, written last, is the completeness mark.

Resaving a step that already has a checkpoint moves the old folder to ``.replaced-checkpoint-N`` before the
rename and deletes it after; a kill in between is repaired at the next start (the old folder is put back).
Rotation (`rotate_checkpoints`) renames a folder to ``.deleting-checkpoint-N`` before deleting it, counts complete
checkpoints only and never removes the newest complete one.

Only the standard library is imported here: the module is cheap to load in a small process that only saves.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: Same prefix as ``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``.
CHECKPOINT_PREFIX = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "checkpoint_manifest.json"
MANIFEST_FORMAT = 1
STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"
DELETING_PREFIX = ".deleting-"

_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")

__all__ = [
    "CHECKPOINT_PREFIX",
    "MANIFEST_NAME",
    "CheckpointSaveError",
    "checkpoint_path",
    "checkpoint_problem",
    "checkpoint_step",
    "complete_checkpoints",
    "is_complete_checkpoint",
    "newest_complete_checkpoint",
    "remove_stale_staging",
    "rotate_checkpoints",
    "save_checkpoint_atomically",
    "staging_path",
]


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; ``path`` is where it was going. Earlier checkpoints are untouched."""

    def __init__(self, message: str, path: str | os.PathLike):
        super().__init__(message)
        self.path = str(path)


# --------------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------------


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a folder named ``checkpoint-N``, else ``None``."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}-{int(step)}"


def staging_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{STAGING_PREFIX}{CHECKPOINT_PREFIX}-{int(step)}"


def _replaced_path(final: Path) -> Path:
    return final.with_name(REPLACED_PREFIX + final.name)


# --------------------------------------------------------------------------------------------------
# completeness
# --------------------------------------------------------------------------------------------------


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` when it is one (see the module docstring)."""
    path = Path(path)
    step = checkpoint_step(path)
    if step is None:
        return f"{path.name!r} is not named {CHECKPOINT_PREFIX}-<step>"
    return _folder_problem(path, step)


def _folder_problem(path: Path, step: int) -> str | None:
    if not path.is_dir():
        return "it is not a folder"
    state_file = path / TRAINER_STATE_NAME
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"it has no {TRAINER_STATE_NAME}"
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"its {TRAINER_STATE_NAME} cannot be read ({err})"
    if not isinstance(state, dict) or state.get("global_step") != step:
        found = state.get("global_step") if isinstance(state, dict) else state
        return f"its {TRAINER_STATE_NAME} records global_step={found!r}, not {step}"
    manifest_file = path / MANIFEST_NAME
    if not manifest_file.exists():
        return None  # written by transformers.Trainer: trainer_state.json comes last
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("step") != step or not isinstance(files, dict):
            raise ValueError(f"manifest of step {manifest.get('step')!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST_NAME} cannot be read ({err})"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    return None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return checkpoint_problem(path) is None


def _checkpoint_folders(output_dir: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(output_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(checkpoint_step(p), p) for p in entries if p.is_dir()]
    return sorted((step, p) for step, p in found if step is not None)


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete ``checkpoint-N`` folders of ``output_dir``, oldest step first."""
    return [p for _, p in _checkpoint_folders(Path(output_dir)) if checkpoint_problem(p) is None]


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The complete checkpoint with the highest step (incomplete ones are skipped with a warning), or ``None``."""
    for _, path in reversed(_checkpoint_folders(Path(output_dir))):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning("Skipping %s: not a complete checkpoint (%s).", path, problem)
    return None


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms cannot open folders; the rename still orders the data on POSIX
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if not directory or err.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _flush_and_list(folder: Path) -> dict[str, int]:
    """fsync every file under ``folder`` (and every sub-folder); returns {relative path: size}."""
    files: dict[str, int] = {}
    for root, dirs, names in os.walk(folder):
        root_path = Path(root)
        for name in sorted(names):
            path = root_path / name
            if path.is_symlink():
                continue
            _fsync_path(path)
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
        for name in dirs:
            _fsync_path(root_path / name, directory=True)
    return files


def _write_manifest(staging: Path, step: int, files: dict[str, int]) -> None:
    files = {k: v for k, v in files.items() if k != MANIFEST_NAME}
    target = staging / MANIFEST_NAME
    with open(target, "w", encoding="utf-8") as f:
        json.dump({"format": MANIFEST_FORMAT, "step": step, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _prepare_staging(staging: Path) -> None:
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)


def _publish(staging: Path, final: Path, step: int) -> None:
    """Flush ``staging``, write its manifest, rename it to ``final`` (replacing an older one), flush the parent."""
    files = _flush_and_list(staging)
    _write_manifest(staging, step, files)
    _fsync_path(staging, directory=True)
    replaced = None
    if final.exists():
        replaced = _replaced_path(final)
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(staging, final)
    _fsync_path(final.parent, directory=True)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _discard(staging: Path) -> None:
    try:
        shutil.rmtree(staging)
    except FileNotFoundError:
        pass
    except OSError as err:  # never hide the save error behind a clean-up error
        logger.warning("Could not remove the staging folder %s: %s", staging, err)


def save_checkpoint_atomically(
    output_dir: str | os.PathLike,
    step: int,
    write: Callable[[Path], None],
    *,
    is_main_process: bool = True,
    all_processes_ok: Callable[[bool], bool] | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``output_dir`` through a staging folder; returns ``output_dir/checkpoint-N``.

    ``write(folder)`` writes this process's files into ``folder``. With several processes every one calls this
    function; ``all_processes_ok(ok)`` must then be a barrier that returns whether every process passed ``True``
    (an all-reduce of the flag), so that one process's failure stops them all. The main process prepares the
    staging folder and publishes it (flush, manifest, rename) once everyone has written.

    Raises:
        CheckpointSaveError: a write or the rename failed (a full disk, a permission, a missing mount...). The
            message names the checkpoint's path and the cause; the staging folder is removed and every earlier
            checkpoint is left as it was.
    """
    agree = all_processes_ok or (lambda ok: ok)
    output_dir = Path(output_dir)
    final = checkpoint_path(output_dir, step)
    staging = staging_path(output_dir, step)

    def fail(stage: str, error: BaseException | None) -> CheckpointSaveError:
        if is_main_process:
            _discard(staging)
        newest = newest_complete_checkpoint(output_dir) if is_main_process else None
        kept = f"The newest complete checkpoint, {newest}, is intact" if newest else "Earlier checkpoints are intact"
        cause = f"{type(error).__name__}: {error}" if error is not None else "it failed on another process (see " \
                                                                             "that process's error)"
        hint = " Free disk space" if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) \
            else " Fix the cause"
        return CheckpointSaveError(
            f"Saving checkpoint {final} failed while {stage}: {cause}. {kept}; nothing was written at {final}."
            f"{hint}, then rerun the same command with --resume_from_checkpoint last (or "
            "trainer.train(resume_from_checkpoint=True)).", final,
        )

    error: BaseException | None = None
    if is_main_process:
        try:
            _prepare_staging(staging)
        except OSError as err:
            error = err
    if not agree(error is None):
        raise fail("creating the staging folder", error) from error
    try:
        write(staging)
    except Exception as err:  # reported to every process, then raised with the path
        error = err
    if not agree(error is None):
        raise fail(f"writing into {staging}", error) from error
    if is_main_process:
        try:
            _publish(staging, final, step)
        except OSError as err:
            error = err
    if not agree(error is None):
        raise fail(f"flushing and renaming {staging}", error) from error
    return final


# --------------------------------------------------------------------------------------------------
# clean-up and rotation
# --------------------------------------------------------------------------------------------------


def remove_stale_staging(output_dir: str | os.PathLike) -> list[str]:
    """Remove what interrupted saves and rotations left in ``output_dir``; returns the removed paths.

    Run it before training starts, on the main process only, while no save is under way. A
    ``.replaced-checkpoint-N`` whose ``checkpoint-N`` is missing (a kill between the two renames of a resave) is
    moved back rather than removed.
    """
    output_dir = Path(output_dir)
    removed: list[str] = []
    try:
        entries = sorted(output_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        name = entry.name
        if name.startswith(REPLACED_PREFIX):
            final = entry.with_name(name[len(REPLACED_PREFIX):])
            step = checkpoint_step(final)
            if step is not None and not final.exists() and _folder_problem(entry, step) is None:
                os.replace(entry, final)
                logger.warning("Restored %s from %s (a resave was interrupted).", final, entry)
                continue
        if name.startswith((STAGING_PREFIX, REPLACED_PREFIX, DELETING_PREFIX)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(str(entry))
    if removed:
        logger.warning("Removed %d folder(s) left by an interrupted save: %s", len(removed), ", ".join(removed))
    return removed


def rotate_checkpoints(
    output_dir: str | os.PathLike, save_total_limit: int | None, keep: Iterable[str | os.PathLike | None] = (),
) -> list[str]:
    """Delete the oldest complete checkpoints beyond ``save_total_limit``; returns the deleted paths.

    Only complete checkpoints count and only they are deleted (an incomplete ``checkpoint-N`` is not this
    module's; it is left alone). The newest complete checkpoint and the folders in ``keep`` (e.g. the best
    model's) are never deleted, even when that leaves more than ``save_total_limit``.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    complete = complete_checkpoints(output_dir)
    if len(complete) <= save_total_limit:
        return []
    protected = {Path(p).resolve() for p in keep if p}
    protected.add(complete[-1].resolve())
    excess = len(complete) - save_total_limit
    deleted: list[str] = []
    for path in complete:
        if excess <= 0:
            break
        if path.resolve() in protected:
            continue
        doomed = path.with_name(DELETING_PREFIX + path.name)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(str(path))
        excess -= 1
    if deleted:
        logger.info("Deleted older checkpoint(s) %s (save_total_limit=%d).", ", ".join(deleted), save_total_limit)
    return deleted
