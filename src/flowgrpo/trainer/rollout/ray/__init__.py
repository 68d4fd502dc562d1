"""Rollouts on their own workers, on Ray (``rollout_backend: ray``; docs/distributed.md): the actors
(`worker.RolloutWorker`, `worker.RewardWorker`, `worker.RolloutCoordinator`), the trainer's side (`backend.RayRolloutBackend`,
built from `worker_set.WorkerSet`, `requests.RolloutRequests`, `weight_sync.WeightSync`,
`in_flight_checkpoint.InFlightCheckpoint`, `session.RaySession`, `reward_workers.RewardWorkers` and
`read_ahead.ReadAhead`), where the workers come from (`pool.RolloutWorkerPool`), the weights they exchange (`weights`,
and `collective` for ``weight_sync: collective``), the cluster's connection, its private folder and its token
(`cluster`) and rewards scored on workers (`rewards`). What a worker needs for an algorithm is that algorithm's
`WorkerNeeds` (``flowgrpo.trainer.algorithm_spec``). Ray itself is imported only when a backend starts."""

from .worker import RewardWorker, RolloutCoordinator, RolloutWorker

__all__ = ["RewardWorker", "RolloutCoordinator", "RolloutWorker"]
