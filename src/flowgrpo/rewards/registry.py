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
``flowgrpo.rewards``.

An entry point names a module, whose import registers its rewards with `register_reward`::

    # a third-party package's pyproject.toml
    [project.entry-points."flowgrpo.rewards"]
    my_rewards = "my_package.rewards"          # registers with @register_reward("my_reward") at import

or a callable, registered under the entry point's name::

    [project.entry-points."flowgrpo.rewards"]
    my_reward = "my_package.rewards:my_reward"

flowgrpo declares its own reward modules the same way (setup.py), the toy world's among them, so that
``flowgrpo.rewards`` itself imports no reward module and nothing of ``flowgrpo.toy``. `load_reward_plugins` runs once,
when ``flowgrpo.rewards`` is imported. A built-in module that fails to import raises; a third-party one is skipped
with a warning that names it. Run from a source tree that was never installed (no entry points of flowgrpo's
distribution), the built-in modules of `BUILTIN_REWARD_MODULES` are imported instead, without the toy world's.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["BUILTIN_REWARD_MODULES", "ENTRY_POINT_GROUP", "get_reward", "list_rewards", "load_reward_plugins",
           "register_reward"]

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


def _ensure_builtins() -> None:
    load_reward_plugins()  # cheap: the reward modules load their heavy dependencies lazily


def list_rewards() -> list[str]:
    """Sorted names of every registered reward."""
    _ensure_builtins()
    with _LOCK:
        return sorted(_REGISTRY)


def get_reward(name: str, **kwargs: Any) -> Callable[..., list[float | None]]:
    """The reward registered as ``name``, ready to call.

    A registered class is instantiated as ``cls(**kwargs)``; for a registered function, ``kwargs`` are bound
    with ``functools.partial`` (no kwargs: the function itself is returned).

    Raises:
        ValueError: unknown ``name``; the message lists the registered names and the closest match.
    """
    _ensure_builtins()
    with _LOCK:
        obj = _REGISTRY.get(name)
        available = sorted(_REGISTRY)
    if obj is None:
        close = difflib.get_close_matches(str(name), available, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {name!r}.{hint} Available rewards: {', '.join(available) or '(none)'}. "
            f"Custom rewards: pass a callable, a 'package.module:function' path, or register one with "
            f"@flowgrpo.rewards.register_reward(name)."
        )
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

_loaded = False


def _is_builtin(entry_point: EntryPoint) -> bool:
    return entry_point.value.split(":")[0].startswith("flowgrpo.")


def _load_one(entry_point: EntryPoint) -> None:
    loaded = entry_point.load()
    if isinstance(loaded, ModuleType):
        return  # importing it registered its rewards
    if not callable(loaded):
        raise TypeError(f"the {ENTRY_POINT_GROUP!r} entry point {entry_point.name} = {entry_point.value} is neither "
                        "a module nor a callable reward.")
    if entry_point.name not in list_rewards():
        register_reward(entry_point.name)(loaded)


def load_reward_plugins() -> list[str]:
    """Import every ``flowgrpo.rewards`` entry point (once); returns the names of the entry points loaded."""
    global _loaded
    if _loaded:
        return []
    _loaded = True
    points = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (not _is_builtin(ep), ep.name))
    if not any(_is_builtin(ep) for ep in points):  # a source tree that was never installed
        for module in BUILTIN_REWARD_MODULES:
            importlib.import_module(f"flowgrpo.rewards.{module}")
    loaded = []
    for entry_point in points:
        if _is_builtin(entry_point):
            _load_one(entry_point)
        else:
            try:
                _load_one(entry_point)
            except Exception as err:  # a broken third-party plugin must not take the built-in rewards down
                logger.warning(f"The reward plugin {entry_point.name} = {entry_point.value} (entry point group "
                               f"{ENTRY_POINT_GROUP!r}) could not be loaded and is skipped: "
                               f"{type(err).__name__}: {err}")
                continue
        loaded.append(entry_point.name)
    return loaded
