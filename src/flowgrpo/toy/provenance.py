"""What a toy-world run was made from: the code digest, the commit and the teachers' weights, so that a run is reused
only when the code that made it is the code that would make it again.

The **code digest** of a run is the SHA-256 of the lines ``"<module>:<sha256 of its source file>"``, sorted, over
every ``flowgrpo`` module loaded in the process when the run ends (its trainer, the rewards, the toy world's modules
and everything they import; a process that made several runs also lists the modules of the earlier ones, which only
makes the digest stricter). It is recorded with the module names (``code_record``), so that it can be recomputed
from the files of any checkout (`digest_now`): equal digests mean that every module the run imported has the same
source today. Source files that changed while the run was in flight make its record inconsistent
(``"consistent": false``), and such a run is never reused. The commit and whether the tree was clean (``git status``
without changes or untracked files under the code's paths, `CODE_PATHS`) are recorded beside it, for the reader:
they say where to find the code, the digest says whether it is the same.

A **weights digest** (`weights_digest`) is the SHA-256 of a folder's files (names and contents, sorted), for the
teachers that on-policy distillation reads from a path.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["CODE_PATHS", "code_record", "digest_now", "git_state", "module_manifest", "reusable_code", "weights_digest"]

_PACKAGE = "flowgrpo"
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # src/flowgrpo


def _module_path(name: str) -> Path | None:
    """The source file of module ``name`` of this checkout (``None`` when there is none)."""
    parts = name.split(".")
    if parts[0] != _PACKAGE:
        return None
    base = _PACKAGE_ROOT.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_manifest(names: Iterable[str] | None = None) -> dict[str, str]:
    """``{module: sha256 of its source}`` for ``names`` (default: every ``flowgrpo`` module loaded now); a module
    without a source file in this checkout maps to ``"missing"``."""
    if names is None:
        names = [name for name, module in list(sys.modules.items())
                 if (name == _PACKAGE or name.startswith(_PACKAGE + ".")) and getattr(module, "__file__", None)]
    out = {}
    for name in sorted(set(names)):
        path = _module_path(name)
        out[name] = _file_digest(path) if path is not None else "missing"
    return out


def _digest(manifest: Mapping[str, str]) -> str:
    text = "\n".join(f"{name}:{manifest[name]}" for name in sorted(manifest))
    return hashlib.sha256(text.encode()).hexdigest()


#: The paths of a checkout that hold the code a run is made from (its archives and pages under docs/ do not count)
CODE_PATHS = ("src", "scripts", "recipes", "setup.py", "pyproject.toml")


def git_state(repo: str | Path | None = None) -> dict[str, Any]:
    """``{"commit": full hash or None, "clean": bool or None}`` of the git checkout at ``repo`` (default: this
    package's); ``clean``: ``git status --porcelain`` lists no change and no untracked file under `CODE_PATHS` (the
    run archives and pages a leaderboard writes as it goes leave it clean)."""
    repo = Path(repo) if repo is not None else _PACKAGE_ROOT
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip() or str(repo)
        status = subprocess.run(["git", "status", "--porcelain", "--", *CODE_PATHS], cwd=top, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "clean": None}
    if commit.returncode != 0 or status.returncode != 0:
        return {"commit": None, "clean": None}
    return {"commit": commit.stdout.strip(), "clean": not status.stdout.strip()}


def code_record(start: Mapping[str, str] | None = None, repo: str | Path | None = None) -> dict[str, Any]:
    """What a finished run records of its code: ``{"digest", "modules", "consistent", "commit", "clean"}``. ``start``:
    the `module_manifest` taken when the run began; a module whose source differs now makes the record
    inconsistent."""
    manifest = module_manifest()
    consistent = all(manifest.get(name, digest) == digest for name, digest in (start or {}).items())
    return {"digest": _digest(manifest), "modules": sorted(manifest), "consistent": consistent, **git_state(repo)}


def digest_now(modules: Iterable[str]) -> str:
    """The code digest of ``modules`` from this checkout's source files today."""
    return _digest(module_manifest(modules))


def reusable_code(record: Mapping[str, Any] | None) -> bool:
    """Whether a run's code record matches this checkout: recorded, consistent, and its digest recomputed today from
    the same modules is the recorded one."""
    if not record or not record.get("consistent") or not record.get("modules"):
        return False
    return digest_now(record["modules"]) == record.get("digest")


def weights_digest(folder: str | Path) -> str | None:
    """SHA-256 of the files of ``folder`` (relative names and contents, sorted); None when it is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
