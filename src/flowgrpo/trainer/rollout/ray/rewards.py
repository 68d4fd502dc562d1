"""Rewards scored by `RewardWorker` actors (``reward_backend: ray``), and the check every reward result from another
process passes before the trainer uses it.

`RayRewardSet` is a `RewardSet` whose ``submit`` sends the batch to the next reward worker (round robin) and returns a
future of its validated result, so both rollout backends use it where they use a local reward set. The grouping,
weights and group-wise combination stay the trainer's (`RewardSet.finish_groupwise`).

`validate_reward_result` holds a remote result to the rules of a local one: one score per sample for every reward of
the set, each a finite number or None (a non-finite score becomes None with a warning, as `RewardSet` does locally),
and the weighted total recomputed with the trainer's weights.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ....rewards import RewardResult, RewardSet

__all__ = ["RayRewardSet", "validate_reward_result"]

logger = logging.getLogger(__name__)


def validate_reward_result(result: Any, reward_set: RewardSet, n: int, where: str) -> RewardResult:
    """``result`` checked and normalised (see the module docstring); ``where`` names its source in errors."""
    if not isinstance(result, RewardResult):
        raise TypeError(f"{where} returned a {type(result).__name__}, not a RewardResult.")
    names = list(reward_set.names)
    if list(result.per_reward) != names:
        raise ValueError(f"{where} scored rewards {list(result.per_reward)}; the run's are {names}.")
    per_reward: dict[str, list[float | None]] = {}
    for name in names:
        scores = result.per_reward[name]
        if len(scores) != n:
            raise ValueError(f"{where}: reward {name!r} gave {len(scores)} scores for {n} samples.")
        clean, bad = [], 0
        for i, value in enumerate(scores):
            if value is None:
                clean.append(None)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: reward {name!r} gave {value!r} for sample {i}; expected a number or None.")
            if math.isfinite(float(value)):
                clean.append(float(value))
            else:
                bad += 1
                clean.append(None)
        if bad:
            logger.warning("%s: reward %r gave %d non-finite score(s) out of %d; treating them as unscored (None)",
                           where, name, bad, n)
        per_reward[name] = clean
    if len(result.total) != n:
        raise ValueError(f"{where}: {len(result.total)} totals for {n} samples.")
    return RewardResult(per_reward=per_reward, total=reward_set.weighted_total(per_reward, n),
                        weights=dict(zip(names, reward_set.weights)),
                        failed={k: min(n, int(v)) for k, v in result.failed.items()}, notes=dict(result.notes),
                        metrics=dict(result.metrics))


class RayRewardSet(RewardSet):
    """``reward_set`` (the trainer's own, for names, weights and group-wise rewards) scored by ``workers``
    (`RewardWorker` handles); each wait is bounded by ``timeout_s``."""

    def __init__(self, reward_set: RewardSet, workers: list, timeout_s: float):
        super().__init__(reward_set.funcs, reward_set.names, reward_set.weights, num_workers=1,
                         on_failure=reward_set.on_failure, offload=False)
        self.workers = list(workers)
        self.timeout_s = float(timeout_s)
        self._next = itertools.cycle(range(len(self.workers)))
        self._lock = threading.Lock()
        self._waiters = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.workers)),
                                           thread_name_prefix="flowgrpo-ray-reward")

    def submit(self, prompts, images, *, defer_groupwise: bool = False, **columns) -> Future:
        import ray

        with self._lock:
            index = next(self._next)
        prompts, images = list(prompts), list(images)
        ref = self.workers[index].score.remote(prompts, images, defer_groupwise, {k: list(v) for k, v in columns.items()})
        where = f"reward worker {index}"

        def wait() -> RewardResult:
            ready, _ = ray.wait([ref], timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"{where} did not score {len(prompts)} samples within {self.timeout_s:g} s "
                                   "(rollout_timeout_s).")
            return validate_reward_result(ray.get(ref), self, len(prompts), where)

        return self._waiters.submit(wait)

    def close(self, wait: bool = True) -> None:
        self._waiters.shutdown(wait=wait, cancel_futures=not wait)
        super().close(wait)
