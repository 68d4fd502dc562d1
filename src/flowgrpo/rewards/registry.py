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
registered function with ``functools.partial``. The built-in rewards (``ocr``, ``jpeg_compressibility``,
``jpeg_incompressibility``, ``aesthetic``, ``clipscore``, ``pickscore``, ``remote``, ``vlm_judge``, ``hpsv3``,
``unifiedreward``, ``vqascore``, ``deqa``, ``videoalign``, ``geneval2``) register themselves when ``flowgrpo.rewards`` is imported; their heavy
dependencies (OCR engines, CLIP models, VLMs) load only when a reward is first called.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["register_reward", "get_reward", "list_rewards"]

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
    # Importing the package registers the built-in rewards (cheap: heavy dependencies load lazily).
    importlib.import_module("flowgrpo.rewards")


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
