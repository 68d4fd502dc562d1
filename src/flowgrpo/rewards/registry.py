"""The reward registry: names -> reward functions or reward classes.

A reward is any callable ``fn(prompts: list[str], images: list[PIL.Image.Image], **columns)
-> list[float | None]`` where ``columns`` holds the dataset's other columns (lists aligned with
``prompts``). ``None`` means "could not score this image": it is excluded from the statistics, never
counted as 0.

Register a function or a class under a name::

    @register_reward("my_reward")
    def my_reward(prompts, images, **columns):
        return [1.0 for _ in images]

    @register_reward("my_model_reward")
    class MyModelReward:
        def __init__(self, model_id="..."): ...
        def __call__(self, prompts, images, **columns): ...

``get_reward(name, **kwargs)`` instantiates a registered class with ``kwargs`` and binds ``kwargs`` to a
registered function with ``functools.partial``. Rewards register themselves when their module is imported; their
heavy dependencies (OCR engines, CLIP models, VLMs) load only when a reward is first called.

Rewards are plugins: every reward module, built-in or third-party, is found through the Python entry-point group
``flowgrpo.rewards`` and imported only when one of its rewards is asked for (`flowgrpo.plugins`). An entry point
names a reward and the module whose import registers it (with `register_reward`)::

    # a third-party package's pyproject.toml
    [project.entry-points."flowgrpo.rewards"]
    my_reward = "my_package.rewards"           # registers @register_reward("my_reward") at import
    my_other_reward = "my_package.rewards"     # one line per reward of the module

or a callable, registered under the entry point's name::

    [project.entry-points."flowgrpo.rewards"]
    my_reward = "my_package.rewards:my_reward"

A module may also be declared once under any name (``my_rewards = "my_package.rewards"``, the earlier form): such a
module is imported when a reward is not found among the entry points' names, and when the rewards are listed.

flowgrpo declares its own rewards the same way (setup.py: one entry point per reward, the toy world's among them), so
``import flowgrpo.rewards`` imports no reward module and nothing of ``flowgrpo.toy``. ``get_reward("pickscore")``
imports ``flowgrpo.rewards.clip_scorers`` only; `list_rewards` and the "did you mean" of an unknown name import every
plugin. A plugin that cannot be imported raises a `flowgrpo.plugins.PluginError` naming it when one of its rewards is
asked for; listing skips it with a warning that names it. Run from a source tree that was never installed (no entry
points of flowgrpo's distribution), the modules of `BUILTIN_REWARD_MODULES` stand in for them, without the toy
world's.
"""

from __future__ import annotations

import difflib
import functools
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from ..plugins import PluginError, PluginGroup

__all__ = ["BUILTIN_REWARD_MODULES", "ENTRY_POINT_GROUP", "PLUGINS", "get_reward", "has_reward", "list_rewards",
           "load_reward_plugins", "register_reward"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_REGISTRY: dict[str, Any] = {}
_LOCK = threading.Lock()


def _same_definition(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are the same object or the same definition re-executed (module reload)."""
    if a is b:
        return True
    return (
        getattr(a, "__module__", None) is not None
        and getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[T], T]:
    """Decorator registering a reward function or class under ``name``.

    Args:
        name: the registry name (what users put in ``reward_funcs``). Must be a non-empty string without
            ``":"`` (that character marks ``package.module:function`` paths).
        overwrite: replace an existing, different registration instead of raising.

    Raises:
        ValueError: ``name`` is invalid, or already registered for a different object (and not ``overwrite``).
        TypeError: the decorated object is not callable.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if ":" in name:
        raise ValueError(f"reward name {name!r} may not contain ':' (reserved for 'package.module:function' paths)")

    def decorator(obj: T) -> T:
        if not callable(obj):
            raise TypeError(f"register_reward({name!r}) needs a function or a class, got {type(obj).__name__}")
        with _LOCK:
            existing = _REGISTRY.get(name)
            if existing is not None and not overwrite and not _same_definition(existing, obj):
                raise ValueError(
                    f"reward name {name!r} is already registered to "
                    f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', repr(existing))}; "
                    f"choose another name or pass overwrite=True"
                )
            _REGISTRY[name] = obj
        return obj

    return decorator


def list_rewards() -> list[str]:
    """Sorted names of every registered reward (imports every reward plugin; a broken one is skipped with a
    warning)."""
    load_reward_plugins()
    with _LOCK:
        return sorted(_REGISTRY)


def has_reward(name: str) -> bool:
    """Whether ``name`` is a reward, importing only the plugins that may provide it: the entry point of that name,
    else the module-level entry points not imported yet (until one registers it).

    Raises:
        flowgrpo.plugins.PluginError: the entry point named ``name`` cannot be imported.
    """
    if _registered(name):
        return True
    if name in PLUGINS:
        _load_plugin(name)  # a broken plugin of this very name: its error, naming it
        if _registered(name):
            return True
    for other in PLUGINS.names():
        if PLUGINS.is_loaded(other) or PLUGINS.entry_point(other).attr is not None:
            continue  # a callable entry point provides its own name only
        try:
            _load_plugin(other)
        except PluginError:
            continue  # named when the rewards are listed, and in the unknown-name error
        if _registered(name):
            return True
    return False


def get_reward(name: str, **kwargs: Any) -> Callable[..., list[float | None]]:
    """The reward registered as ``name``, ready to call.

    A registered class is instantiated as ``cls(**kwargs)``; for a registered function, ``kwargs`` are bound
    with ``functools.partial`` (no kwargs: the function itself is returned).

    Raises:
        ValueError: unknown ``name``; the message lists the registered names and the closest match.
        flowgrpo.plugins.PluginError: the plugin that declares ``name`` cannot be imported (the message names it).
    """
    if not has_reward(name):
        available = list_rewards()
        close = difflib.get_close_matches(str(name), available, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        broken = "".join(f" The plugin {failure.name} = {failure.value} could not be loaded and may provide it "
                         f"({type(failure.error).__name__}: {failure.error})." for failure in PLUGINS.failures.values())
        raise ValueError(
            f"unknown reward {name!r}.{hint} Available rewards: {', '.join(available) or '(none)'}. "
            f"Custom rewards: pass a callable, a 'package.module:function' path, or register one with "
            f"@flowgrpo.rewards.register_reward(name).{broken}"
        )
    with _LOCK:
        obj = _REGISTRY[name]
    if isinstance(obj, type):
        return obj(**kwargs)
    if kwargs:
        bound = functools.partial(obj, **kwargs)
        functools.update_wrapper(bound, obj)
        return bound
    return obj


# ---- plugins ---------------------------------------------------------------------------------------------------
ENTRY_POINT_GROUP = "flowgrpo.rewards"
#: the reward modules of flowgrpo.rewards, as setup.py declares them (the fallback of an uninstalled source tree)
BUILTIN_REWARD_MODULES = ("ocr", "jpeg", "clip_scorers", "remote", "vlm_judge", "geneval", "imagereward", "hpsv2",
                          "hpsv3", "unifiedreward", "vqascore", "deqa", "editreward", "edit_judges", "clap", "videoalign",
                          "geneval2")
#: the ``flowgrpo.rewards`` entry points, read when a reward is first asked for; a source tree that was never installed
#: declares each built-in module under its own name instead (found as module-level plugins)
PLUGINS = PluginGroup(ENTRY_POINT_GROUP, builtin={module: f"flowgrpo.rewards.{module}" for module in BUILTIN_REWARD_MODULES})
_warned: set[str] = set()


def _registered(name: str) -> bool:
    with _LOCK:
        return name in _REGISTRY


def _load_plugin(name: str) -> None:
    """Import the entry point ``name``: a module registers its own rewards, a callable is registered as ``name``."""
    loaded = PLUGINS.load(name)
    if isinstance(loaded, ModuleType):
        return
    if not callable(loaded):
        entry_point = PLUGINS.entry_point(name)
        raise TypeError(f"the {ENTRY_POINT_GROUP!r} entry point {entry_point.name} = {entry_point.value} is neither "
                        "a module nor a callable reward; point it at the module that registers the reward or at the "
                        "reward function itself.")
    if not _registered(name):
        register_reward(name)(loaded)


def load_reward_plugins() -> list[str]:
    """Import every ``flowgrpo.rewards`` entry point not imported yet; returns the names of the entry points
    imported now. One that cannot be imported is skipped with a warning naming it (once per process); asking for
    one of its rewards raises its error."""
    loaded = []
    for name in PLUGINS.names():
        if PLUGINS.is_loaded(name):
            continue
        try:
            _load_plugin(name)
        except PluginError:
            continue
        loaded.append(name)
    for name, failure in PLUGINS.failures.items():
        if name not in _warned:
            _warned.add(name)
            logger.warning(f"{failure} It is skipped: its rewards are not available.")
    return loaded
