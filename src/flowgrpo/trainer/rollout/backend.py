"""Where a trainer's rollouts are sampled: the one small interface both backends implement (`RolloutBackend`), the
local backend (today's path: the trainer's own `RolloutEngine`, in the training processes). The Ray backend is
`rollout.ray.backend.RayRolloutBackend` (``rollout_backend: ray``); `rollout.backend_choice` picks one.

The trainer calls, in this order: `launch` at the end of its construction (workers start loading), `start` when
training starts (waits for them; `summary` is then printed once), `read_ahead` on the dataloader's iterator (the Ray
backend reads the coming generations' prompts ahead so that it can sample them early; the local backend returns the
iterator unchanged), `generate` once per generation, `save` / `load` with each checkpoint, and `close` when training
ends. Scoring (gathers, advantages, the health hook) always runs in the training processes, through the trainer's
`RolloutEngine.score`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .generation import Generation

__all__ = ["LocalRolloutBackend", "RolloutBackend", "RolloutWorkerError", "model_source"]


class RolloutWorkerError(RuntimeError):
    """A rollout (or reward) worker failed beyond recovery: it did not answer within ``rollout_timeout_s``, died with
    no restart left, or answered with other weights than it was sent. The trainer stops with a checkpoint of the last
    completed step (``--resume_from_checkpoint last`` continues); ``worker`` names it."""

    def __init__(self, message: str, worker: str | None = None):
        super().__init__(message)
        self.worker = worker


class RolloutBackend:
    """The interface (see the module docstring). ``staleness``: how many optimizer steps old the weights that sampled
    the generation `generate` returned last are (0 for the local backend)."""

    #: how many optimizer steps old the weights of the last generation's samples are
    staleness: int = 0
    #: whether the trainer logs ``rollout/*`` metrics of this backend (first-pass ratio, ...)
    logs_rollout_metrics: bool = False

    def launch(self) -> None:
        """At the end of the trainer's construction: start what loads in the background (workers)."""

    def start(self) -> None:
        """When ``train()`` starts: wait until the backend is ready."""

    def summary(self) -> str | None:
        """One line the console prints once at start-up (where the rollouts run, the layout, the staleness bound), or
        None (the local backend: nothing to say)."""
        return None

    def read_ahead(self, iterator: Iterator, position: int) -> Iterator:
        """The dataloader iterator the trainer reads its batches from; ``position``: the micro-step of its next
        batch."""
        return iterator

    def generate(self, inputs: list[dict], gen_index: int, step: int) -> Generation:
        """This process's share of generation ``gen_index``, sampled, decoded and with its rewards submitted."""
        raise NotImplementedError

    def save(self, folder: str, step: int) -> None:
        """Write what resuming needs into a checkpoint folder of optimizer step ``step`` (nothing for the local
        backend)."""

    def load(self, folder: str) -> None:
        """Read what `save` wrote (a checkpoint without it starts afresh)."""

    def close(self) -> None:
        """When ``train()`` ends, however it ends."""


class LocalRolloutBackend(RolloutBackend):
    """Rollouts in the training processes: the trainer's own `RolloutEngine` (today's code path). With
    ``reward_backend: ray`` its rewards go to reward workers (`rollout.ray.reward_workers.RewardWorkers`)."""

    def __init__(self, engine: Any, reward_workers: Any = None):
        self.engine = engine
        self.reward_workers = reward_workers

    def launch(self) -> None:
        if self.reward_workers is not None:
            self.reward_workers.launch()

    def start(self) -> None:
        if self.reward_workers is not None:
            self.reward_workers.start()

    def generate(self, inputs: list[dict], gen_index: int, step: int) -> Generation:
        return self.engine.generate(inputs, gen_index, step)

    def close(self) -> None:
        if self.reward_workers is not None:
            self.reward_workers.close()


def model_source(model: Any, pipeline_kwargs: dict | None, args: Any) -> Any:
    """What rollout workers load the pipeline from, taken before the trainer adds its LoRA to it: the model path or
    hub id with ``pipeline_kwargs``, or a pickled copy of a loaded pipeline (put in Ray's object store at start);
    ``(model, pipeline_kwargs)``, or None with the local backend."""
    if args.rollout_backend != "ray":
        return None
    if isinstance(model, str):
        return model, dict(pipeline_kwargs or {})
    import pickle

    return pickle.dumps(model), None
