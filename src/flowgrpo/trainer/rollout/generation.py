"""`Generation`: one generation batch as this process sampled it, with its rewards possibly still in flight."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ...rewards import RewardResult

__all__ = ["Generation", "done_future"]


def done_future(value: Any) -> Future:
    """A future that already holds ``value``."""
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass
class Generation:
    """This process's share of a generation batch, split in micro-batches.

    Attributes:
        records: per micro-batch, what the algorithm's rollout recorded plus ``"embeds"``; scoring adds
            ``"advantages"`` (and GARDO's ``"kl_gate"``).
        jobs: per micro-batch, a future of ``(images, reward future, decode seconds)``: the decoded images and their
            rewards, worked out in the background while the next micro-batch samples.
        chunks: per micro-batch, its rows of the generation.
        prompts: the prompt of every row; ``group_ids``: the group (prompt index) of every row.
        timing: seconds spent per phase (``text_encoding``, ``rollout``, ``vae_decode``, ``sampling_total``, ...).
        step: the optimizer step whose rollout this is (0-based: the number of steps done before it).
        constraint_terms: set by scoring with reward constraints: the multipliers and the constrained rewards'
            gathered scores (``advantages.ConstraintTerms``), for a strategy that forms its own advantages.
    """

    records: list[dict]
    jobs: list[Future]
    chunks: list[slice]
    prompts: list[str]
    group_ids: torch.Tensor
    timing: dict[str, float] = field(default_factory=dict)
    step: int = 0
    constraint_terms: Any = None
    #: run once before the rewards are read, on every process at the same point (sequence parallelism: the SP group
    #: leader's scores are handed to the group's other processes, which do not score); None: nothing to do
    settle_scores: Callable[[Generation], None] | None = None

    def settle(self) -> None:
        """Run `settle_scores` (once)."""
        if self.settle_scores is not None:
            settle, self.settle_scores = self.settle_scores, None
            settle(self)

    def local_results(self) -> tuple[list[list], list[RewardResult], list[float]]:
        """Wait for the decoding and this process's rewards (no gather): images per micro-batch, reward results,
        decode seconds. A reward's exception is raised here."""
        self.settle()
        images, results, seconds = [], [], []
        for job in self.jobs:
            pil, future, decode_seconds = job.result()
            images.append(pil)
            results.append(future.result())
            seconds.append(decode_seconds)
        return images, results, seconds

    @classmethod
    def already_scored(cls, records: list[dict], images: list, result: RewardResult, chunks: list[slice],
                       prompts: list[str], group_ids: torch.Tensor, timing: dict[str, float],
                       step: int) -> Generation:
        """A generation whose images and rewards are known (dynamic sampling's merged batch): one finished job."""
        job = done_future((images, done_future(result), 0.0))
        return cls(records=records, jobs=[job], chunks=chunks, prompts=prompts, group_ids=group_ids, timing=timing,
                   step=step)
