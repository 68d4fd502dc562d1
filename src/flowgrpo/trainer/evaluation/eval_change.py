"""How much an evaluation changed since the first one, and how sure that is.

Evaluation samples the same prompts from the same seeds every time (deterministic ODE sampling), so evaluations at
two steps form pairs: image i before and image i after differ only by what training changed. For a reward r the
change and its standard error over the n images scored both times are

    d_i = r_i(now) - r_i(first),   change = mean(d),   change_se = std(d) / sqrt(n)

(population std). Pairing removes the spread between prompts and seeds that two independent evaluations would add:
on the toy world the paired standard error of the shape score is several times smaller than the unpaired
sqrt(se_first^2 + se_now^2).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

__all__ = ["EvaluationBaseline", "paired_change"]


def paired_change(first: Sequence[float | None], now: Sequence[float | None]) -> tuple[float, float, int]:
    """``(mean of now - first, its standard error, pairs)`` over the positions where both are scored numbers;
    ``(nan, nan, 0)`` without pairs."""
    if len(first) != len(now):
        raise ValueError(f"paired_change needs evaluations of the same images, got {len(first)} and {len(now)}.")
    diffs = [b - a for a, b in zip(first, now) if _scored(a) and _scored(b)]
    if not diffs:
        return math.nan, math.nan, 0
    mean = math.fsum(diffs) / len(diffs)
    std = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / len(diffs))
    return mean, std / math.sqrt(len(diffs)), len(diffs)


def _scored(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


class EvaluationBaseline:
    """The per-image rewards of the first evaluation of each evaluation set, to compare later evaluations with.

    An evaluation set is identified by its metric prefix and the ordered list of its prompts (the seeds follow from
    the image indices). Not saved in checkpoints: after resuming, the first evaluation of the resumed run is the
    baseline.
    """

    def __init__(self) -> None:
        self._first: dict[str, dict[str, list[float | None]]] = {}

    @staticmethod
    def key(prefix: str, prompts: Sequence[str]) -> str:
        digest = hashlib.sha1("\x1f".join(prompts).encode("utf-8")).hexdigest()
        return f"{prefix}:{len(prompts)}:{digest}"

    def compare(self, prefix: str, prompts: Sequence[str], per_image: dict[str, list[float | None]]
                ) -> dict[str, tuple[float, float, int]]:
        """Remember ``per_image`` (reward name -> one value per image) when this set is new and return ``{}``;
        else return ``{name: paired_change(first, now)}`` for every reward of both."""
        key = self.key(prefix, prompts)
        first = self._first.get(key)
        if first is None:
            self._first[key] = {name: list(values) for name, values in per_image.items()}
            return {}
        return {name: paired_change(first[name], values) for name, values in per_image.items() if name in first}
