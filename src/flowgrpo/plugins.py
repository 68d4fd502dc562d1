"""Plugins: the entry points of one group, read when first needed and loaded one name at a time.

A package extends flowgrpo by declaring entry points (``[project.entry-points."<group>"]`` in its
``pyproject.toml``, ``entry_points=`` in a ``setup.py``); flowgrpo declares its own parts the same way. Each entry
point is ``name = module`` or ``name = module:attribute``. Nothing is imported until a name is asked for::

    from flowgrpo.plugins import PluginGroup, PluginError

    rewards = PluginGroup("flowgrpo.rewards", builtin={"ocr": "flowgrpo.rewards.ocr"})
    rewards.names()              # the declared names, in declaration order: reads the installed metadata once
    "ocr" in rewards             # the same, for one name
    rewards.load("ocr")          # imports the entry point's module (and attribute): the loaded object
    rewards.is_loaded("ocr")     # True once loaded (or found broken)
    rewards.load_all()           # {name: object} of every entry point; the broken ones are in .failures
    rewards.failures             # {name: PluginError} of the entry points that could not be loaded

Interface:

* ``PluginGroup(group, builtin=None)``. ``builtin``: ``{name: "module[:attribute]"}``, the entry points that
  flowgrpo's own distribution declares in this group, used in their place when none of them is installed (a source
  tree on ``PYTHONPATH`` that was never ``pip install``-ed). Without it, only the installed entry points count.
* ``names() -> list[str]``: every declared name, once each; imports nothing.
* ``load(name) -> object``: the object of the entry point ``name``; loaded once and kept (a second call returns the
  same object). Several distributions declaring the same name: the first one found is used. Raises ``KeyError``
  for a name no entry point declares, :class:`PluginError` for one that cannot be loaded (each call tries the
  import again, so a plugin repaired in the meantime loads).
* ``load_all() -> dict[str, object]``: every entry point not loaded or found broken yet, then all loaded objects; an
  entry point that fails is recorded in ``failures`` and left out, so one broken plugin never hides the others.
* ``refresh()``: forget the metadata read so far (loaded objects are kept), e.g. after installing a package.

A plugin fails "only when it is used": reading names never imports anything, and a broken entry point raises only
when its own name is loaded. The error (:class:`PluginError`, an ``ImportError``) names the group, the entry point,
its module, the distribution that declares it and the original error, and says how to fix it.

Thread-safe: loading holds a lock of the group (re-entrant: a plugin module may use the group while it is imported).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

__all__ = ["PluginError", "PluginGroup"]


class PluginError(ImportError):
    """An entry point that could not be loaded.

    Attributes: ``group``, ``name``, ``value`` (``"module[:attribute]"``), ``distribution`` (``"name version"`` or
    None) and ``error`` (the original exception, also the ``__cause__``).
    """

    def __init__(self, group: str, entry_point: EntryPoint, error: BaseException):
        dist = getattr(entry_point, "dist", None)
        distribution = f"{dist.name} {dist.version}" if dist is not None else None
        origin = f" (declared by the distribution {distribution})" if distribution else ""
        fix = (f"fix or uninstall {dist.name} (pip uninstall {dist.name})" if dist is not None
               else f"fix the module {entry_point.module}")
        super().__init__(
            f"The {group!r} plugin {entry_point.name!r} could not be loaded: its entry point {entry_point.name} = "
            f"{entry_point.value}{origin} raised {type(error).__name__}: {error}. To use {entry_point.name!r}, {fix}; "
            "nothing else depends on it.")
        # set after ImportError.__init__, which resets ``name``
        self.group, self.name, self.value = group, entry_point.name, entry_point.value
        self.distribution, self.error = distribution, error


class PluginGroup:
    """The entry points of ``group``, read on first use and loaded by name (see the module docstring)."""

    def __init__(self, group: str, builtin: Mapping[str, str] | None = None):
        self.group = group
        self.builtin = dict(builtin or {})
        self.failures: dict[str, PluginError] = {}
        self._points: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, Any] = {}
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"PluginGroup({self.group!r}: {len(self._entry_points())} entry points, {len(self._loaded)} loaded)"

    # ---- reading the metadata (no import) ---------------------------------------------------------------------
    def _entry_points(self) -> dict[str, EntryPoint]:
        with self._lock:
            if self._points is None:
                points: dict[str, EntryPoint] = {}
                for entry_point in entry_points(group=self.group):
                    points.setdefault(entry_point.name, entry_point)
                if self.builtin and not self._builtin_installed(points.values()):
                    for name, value in self.builtin.items():
                        points.setdefault(name, EntryPoint(name=name, value=value, group=self.group))
                self._points = points
            return self._points

    def _builtin_installed(self, points) -> bool:
        """Whether the distribution that owns the built-in entry points is installed: one of the installed entry
        points lives in the built-in ones' top-level package."""
        packages = {value.split(":")[0].split(".")[0] for value in self.builtin.values()}
        return any(point.value.split(":")[0].split(".")[0] in packages for point in points)

    def names(self) -> list[str]:
        """Every declared name (installed entry points, else the built-in ones), in the order found."""
        return list(self._entry_points())

    def __contains__(self, name: object) -> bool:
        return name in self._entry_points()

    def entry_point(self, name: str) -> EntryPoint:
        """The entry point declared as ``name`` (``KeyError`` when none is)."""
        points = self._entry_points()
        if name not in points:
            raise KeyError(f"no {self.group!r} entry point is named {name!r}; declared: {', '.join(points) or '(none)'}")
        return points[name]

    def refresh(self) -> None:
        """Read the installed entry points again on next use (loaded objects are kept)."""
        with self._lock:
            self._points = None

    # ---- loading ----------------------------------------------------------------------------------------------
    def is_loaded(self, name: str) -> bool:
        """True when ``name`` was loaded, or tried and found broken (see ``failures``)."""
        return name in self._loaded or name in self.failures

    def load(self, name: str) -> Any:
        """The object the entry point ``name`` names, imported on first call (see the module docstring)."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            entry_point = self.entry_point(name)
            try:
                loaded = entry_point.load()
            except Exception as err:  # any error of the plugin's import: named, with the plugin, to the caller
                failure = PluginError(self.group, entry_point, err)
                self.failures[name] = failure
                raise failure from err
            self.failures.pop(name, None)
            self._loaded[name] = loaded
            return loaded

    def load_all(self) -> dict[str, Any]:
        """Every entry point loaded (each once); the broken ones are left out and recorded in ``failures``."""
        with self._lock:
            for name in self.names():
                if not self.is_loaded(name):
                    try:
                        self.load(name)
                    except PluginError:
                        continue
            return dict(self._loaded)
