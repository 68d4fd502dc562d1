"""``reward_backend: ray``: `RewardWorkers`, the `RewardWorker` actors of a run, and the switch of the trainer's
engine to them (`RayRewardSet`)."""

from __future__ import annotations

from typing import Any

from ..backend import RolloutWorkerError
from .session import NAMESPACE, RaySession, resource_options, worker_env

__all__ = ["RewardWorkers"]


class RewardWorkers:
    """``reward_backend: ray``: `RewardWorker` actors scoring for the rollout engine's reward set, which the engine
    then uses in place of its own (`RayRewardSet`); evaluation keeps scoring in the trainer. Built from the parts it
    uses: the configuration, the `RolloutEngine` and the accelerator (or a session shared with the rollout
    workers)."""

    def __init__(self, args: Any, engine: Any, accelerator: Any, session: RaySession | None = None):
        self.args = args
        self.engine = engine
        self.session = session or RaySession(args, accelerator)
        self._owns_session = session is None
        self.handles: list = []
        self._local = None

    def launch(self) -> None:
        """Create the reward actors (they load their rewards in the background)."""
        if self.handles:
            return
        import ray

        from .worker import RewardWorker

        args = self.args
        self.session.open()
        resources = dict(args.reward_worker_resources or {"num_cpus": 1})
        reward_set = self.engine.rewards
        threads = int(resources.get("num_cpus") or 1)
        funcs = self._reward_specs(reward_set)

        def make(name: str):
            return ray.remote(RewardWorker).options(
                name=name, namespace=NAMESPACE, runtime_env={"env_vars": worker_env(threads)},
                **resource_options(resources)).remote(funcs, reward_set.weights, args.reward_kwargs,
                                                        reward_set.on_failure, args.reward_offload, threads)

        self.handles = [self.session.create_or_find(f"{self.session.run}-reward-{i}", make)
                        for i in range(args.reward_workers)]

    def start(self) -> None:
        """Wait until every reward actor is ready, then score through them."""
        if self._local is not None:
            return
        from .rewards import RayRewardSet

        self.launch()
        args = self.args
        reward_set = self.engine.rewards
        names = [f"reward worker {i}" for i in range(len(self.handles))]
        described = self.session.wait([h.describe.remote() for h in self.handles], args.rollout_startup_timeout_s,
                                      "at start", names)
        for info in described:
            if info["names"] != list(reward_set.names):
                raise RolloutWorkerError(f"A reward worker built rewards {info['names']}, the trainer "
                                         f"{list(reward_set.names)}.")
        self._local = reward_set
        self.engine.rewards = RayRewardSet(reward_set, self.handles, args.rollout_timeout_s)

    def _reward_specs(self, reward_set: Any) -> list:
        """The reward functions as the workers rebuild them: registry names or ``module:function`` paths; a callable
        defined where a worker cannot import it is refused before any actor starts."""
        from ....rewards import list_rewards

        registered = set(list_rewards())
        specs = []
        for name, fn in zip(reward_set.names, reward_set.funcs):
            if name in registered:
                specs.append(name)
                continue
            module = getattr(fn, "__module__", None)
            qualname = getattr(fn, "__qualname__", "")
            if module in (None, "__main__") or "<locals>" in qualname:
                raise ValueError(f"reward_backend='ray' rebuilds each reward on its workers, but reward {name!r} is a "
                                 f"callable defined in {module or 'an unknown module'}; register it "
                                 "(@register_reward) or pass it as 'package.module:function'.")
            specs.append(f"{module}:{qualname}")
        return specs

    def close(self) -> None:
        import ray

        if self._local is not None:
            self.engine.rewards.close(wait=False)
            self.engine.rewards = self._local
            self._local = None
        if self.session.is_main:
            for handle in self.handles:
                try:
                    ray.kill(handle)
                except Exception:  # already gone
                    pass
        self.handles = []
        if self._owns_session:
            self.session.close()
