"""The rollout backend a configuration asks for (``rollout_backend``, ``reward_backend``), built from the trainer's
parts; nothing is started here (`RolloutBackend.launch` does)."""

from __future__ import annotations

from typing import Any

from .backend import LocalRolloutBackend, RolloutBackend

__all__ = ["build_rollout_backend"]


def build_rollout_backend(trainer: Any, source: Any) -> RolloutBackend:
    """``rollout_backend: ray``: `RayRolloutBackend` (``source``: what its workers load, `backend.model_source`);
    otherwise the local backend, with reward workers when ``reward_backend: ray``."""
    args = trainer.args
    if args.rollout_backend == "ray":
        from .ray.backend import RayRolloutBackend

        return RayRolloutBackend(trainer, source)
    reward_workers = None
    if args.reward_backend == "ray":
        from .ray.reward_workers import RewardWorkers

        reward_workers = RewardWorkers(trainer)
    return LocalRolloutBackend(trainer.rollouts, reward_workers)
