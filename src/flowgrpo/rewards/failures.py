"""What happens when a reward fails mid-run: the ``on_failure`` policy and the count of failed samples.

Two policies, for any reward (a registry name, a path, any callable):

* ``"raise"``: the exception stops the run. In training the trainer turns it into `RewardFailedError` on every
  process and first saves a checkpoint of the last completed optimizer step, so that rerunning with
  ``--resume_from_checkpoint last`` once the reward works again loses nothing.
* ``"skip"``: the batch's scores from that reward become ``None`` (excluded from advantages and statistics, never
  counted as 0), a warning is logged, and training goes on. The number of such samples is logged per step as
  ``rewards/<name>/failed``.

``"none"`` is accepted as another spelling of ``"skip"`` (the name the remote reward and the VLM judge used for
it). Rewards that handle their own failures (`RemoteReward`, `VLMJudgeReward` with ``on_failure="skip"``) return
``None`` for the images they could not score and report them with `report_failed_samples`, so they are counted
in ``rewards/<name>/failed`` too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

ON_FAILURE_CHOICES = ("raise", "skip")
ON_FAILURE_ALIASES = {"none": "skip"}

__all__ = [
    "ON_FAILURE_CHOICES",
    "RewardFailedError",
    "collect_failed_samples",
    "normalize_on_failure",
    "report_failed_samples",
    "resolve_on_failure",
]


class RewardFailedError(RuntimeError):
    """A reward raised while scoring a training batch and its policy is ``on_failure="raise"``."""

    def __init__(self, message: str, reward_name: str | None = None):
        super().__init__(message)
        self.reward_name = reward_name


def normalize_on_failure(value: Any, where: str = "on_failure") -> str:
    """``"raise"`` or ``"skip"`` (``"none"`` -> ``"skip"``); anything else is a ValueError naming ``where``."""
    text = str(value).strip().lower() if isinstance(value, str) else value
    text = ON_FAILURE_ALIASES.get(text, text)
    if text not in ON_FAILURE_CHOICES:
        raise ValueError(f"{where}={value!r} is not valid; choose 'raise' (stop the run, after saving the last "
                         "completed step) or 'skip' (score the failed samples None and go on).")
    return text


def resolve_on_failure(on_failure: str | Mapping[str, str] | None, names: list[str]) -> dict[str, str]:
    """One policy per reward name from a single policy or a ``{name: policy}`` mapping (others: ``"raise"``)."""
    if on_failure is None:
        return {n: "raise" for n in names}
    if isinstance(on_failure, Mapping):
        unknown = [k for k in on_failure if k not in names]
        if unknown:
            raise ValueError(f"on_failure has entries for {unknown} but the rewards are {names}.")
        return {n: normalize_on_failure(on_failure.get(n, "raise"), f"on_failure[{n!r}]") for n in names}
    policy = normalize_on_failure(on_failure)
    return {n: policy for n in names}


_local = threading.local()


@contextmanager
def collect_failed_samples() -> Iterator[list[int]]:
    """Collect, in this thread, the counts reported by `report_failed_samples` inside the block (their sum is
    ``sum(counter)``)."""
    outer = getattr(_local, "counter", None)
    counter: list[int] = []
    _local.counter = counter
    try:
        yield counter
    finally:
        _local.counter = outer


def report_failed_samples(count: int) -> None:
    """Called by a reward that swallowed a failure: ``count`` of its samples are ``None`` because scoring failed.

    Outside `collect_failed_samples` (a reward called on its own) this does nothing."""
    counter = getattr(_local, "counter", None)
    if counter is not None and count > 0:
        counter.append(int(count))
