"""Rollouts on their own workers, on Ray (``rollout_backend: ray``; docs/distributed.md): the actors
(`worker.RolloutWorker`, `worker.RewardWorker`, `worker.RolloutCoordinator`), the trainer's side
(`backend.RayRolloutBackend`, with `session.RaySession`, `reward_workers.RewardWorkers` and `read_ahead.ReadAhead`),
the weights they exchange (`weights`), the cluster's connection and its token (`cluster`) and rewards scored on
workers (`rewards`). What a worker needs for an algorithm is that algorithm's `WorkerNeeds`
(``flowgrpo.trainer.algorithm_spec``). Ray itself is imported only when a backend starts."""

from .worker import RewardWorker, RolloutCoordinator, RolloutWorker

__all__ = ["RewardWorker", "RolloutCoordinator", "RolloutWorker"]
