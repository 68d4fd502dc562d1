"""The checks of the rollout backend's configuration fields (``OnlineRLConfig``'s "rollout backend" section), run when
a configuration is built, before anything is loaded or any cluster is reached. Standard library only: configurations
import without torch, diffusers or Ray."""

from __future__ import annotations

import math
from typing import Any

from .json_setting import decode_json_setting

__all__ = ["REWARD_BACKENDS", "ROLLOUT_BACKENDS", "WEIGHT_SYNCS", "WORKER_RESOURCE_KEYS", "check_rollout_backend_settings",
           "parse_worker_resources"]

ROLLOUT_BACKENDS = ("local", "ray")
REWARD_BACKENDS = ("local", "ray")
#: the transports of ``weight_sync`` (`rollout.ray.weight_sync`)
WEIGHT_SYNCS = ("object_store", "collective")
#: the keys of ``rollout_worker_resources`` / ``reward_worker_resources`` (``ray.remote(...).options`` arguments)
WORKER_RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")


def parse_worker_resources(value: Any, name: str) -> dict | None:
    """``value`` (a dict, a JSON string or None) as a dict of Ray resources; a clear error for unknown keys or
    negative amounts."""
    if value is None:
        return None
    value = decode_json_setting(value, name, 'write e.g. \'{"num_gpus": 1, "num_cpus": 4}\'.')
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a mapping of Ray resources, e.g. {{num_gpus: 1, num_cpus: 4}}.")
    unknown = sorted(set(value) - set(WORKER_RESOURCE_KEYS))
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; use {', '.join(WORKER_RESOURCE_KEYS)}.")
    for key in ("num_cpus", "num_gpus", "memory"):
        amount = value.get(key)
        if amount is not None and (isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0
                                   or not math.isfinite(amount)):
            raise ValueError(f"{name}[{key!r}]={amount!r} must be a number >= 0.")
    if "resources" in value and not isinstance(value["resources"], dict):
        raise ValueError(f"{name}['resources']={value['resources']!r} must be a mapping of custom resources.")
    return dict(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}.")


def _positive_int(args: Any, name: str, minimum: int) -> None:
    value = getattr(args, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


def check_rollout_backend_settings(args: Any) -> None:
    """Validate (and normalise) the rollout-backend fields of ``args`` in place."""
    _check_choice("rollout_backend", args.rollout_backend, ROLLOUT_BACKENDS)
    _check_choice("reward_backend", args.reward_backend, REWARD_BACKENDS)
    _check_choice("weight_sync", args.weight_sync, WEIGHT_SYNCS)
    for name, minimum in (("rollout_workers", 1), ("reward_workers", 1), ("max_staleness", 0),
                          ("weight_sync_steps", 1), ("max_worker_restarts", 0)):
        _positive_int(args, name, minimum)
    for name in ("rollout_timeout_s", "rollout_startup_timeout_s", "ray_start_timeout_s", "weight_sync_bucket_mb"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number > 0.")
    args.rollout_worker_resources = parse_worker_resources(args.rollout_worker_resources, "rollout_worker_resources")
    args.reward_worker_resources = parse_worker_resources(args.reward_worker_resources, "reward_worker_resources")
    cap = args.truncated_importance_cap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1
                            or not math.isfinite(cap)):
        raise ValueError(f"truncated_importance_cap={cap!r} must be a finite number >= 1 (e.g. 2.0), or unset.")

    if args.rollout_backend == "local":
        # The fields that only mean something on workers: refused rather than silently ignored.
        asked = [name for name, default in (("max_staleness", 0), ("weight_sync_steps", 1), ("rollout_workers", 1),
                                            ("truncated_importance_cap", None), ("weight_sync", "object_store"))
                 if getattr(args, name) != default]
        if args.rollout_worker_resources is not None:
            asked.append("rollout_worker_resources")
        if asked:
            raise ValueError(f"{', '.join(asked)} set, but rollout_backend='local' samples in the training processes; "
                             "set rollout_backend: ray (docs/distributed.md) or leave them unset.")
        return
    if args.weight_sync_steps - 1 > args.max_staleness:
        raise ValueError(f"weight_sync_steps={args.weight_sync_steps} with max_staleness={args.max_staleness}: weights "
                         f"reach the workers every {args.weight_sync_steps} steps, so a group may be sampled by "
                         f"weights {args.weight_sync_steps - 1} steps old; set max_staleness >= "
                         f"{args.weight_sync_steps - 1} or lower weight_sync_steps.")
    from .registry import spec_of

    refused = spec_of(args).facts(args).workers.refusal  # an algorithm whose rollouts workers cannot reproduce yet
    if refused:
        raise ValueError(f"rollout_backend='ray' with {type(args).__name__}: {refused} Use rollout_backend: local.")
