"""The rollout backend a configuration asks for (``rollout_backend``, ``reward_backend``), built from the trainer's
parts; nothing is started here (`RolloutBackend.launch` does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .backend import LocalRolloutBackend, RolloutBackend

__all__ = ["build_rollout_backend"]


def build_rollout_backend(args: Any, policy: Any, engine: Any, accelerator: Any, metrics: Any, algorithm: Any,
                          source: Any, *, stale_replay: Callable[[list[dict]], dict] | None = None) -> RolloutBackend:
    """``rollout_backend: ray``: `RayRolloutBackend` from the trainer's parts (``source``: what its workers load,
    `backend.model_source`; ``algorithm``: the run's `AlgorithmFacts`; ``stale_replay``: the algorithm's correction
    of stale generations); otherwise the local backend, with reward workers when ``reward_backend: ray``."""
    if args.rollout_backend == "ray":
        from .ray.backend import RayRolloutBackend

        return RayRolloutBackend(args, policy, engine, accelerator, metrics, algorithm, source,
                                 stale_replay=stale_replay)
    reward_workers = None
    if args.reward_backend == "ray":
        from .ray.reward_workers import RewardWorkers

        reward_workers = RewardWorkers(args, engine, accelerator)
    return LocalRolloutBackend(engine, reward_workers)
