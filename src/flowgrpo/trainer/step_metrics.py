"""`StepMetrics`: the values the trainer's parts record between two logging steps, averaged when logged."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

__all__ = ["StepMetrics", "finite_mean"]


def finite_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN when none is: e.g. a metric every sample of a step lacked)."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


class StepMetrics:
    """``train[key]`` / ``eval[key]``: the values recorded since the last log (a part appends; the trainer's ``log``
    averages and clears them)."""

    def __init__(self):
        self.train: defaultdict[str, list[float]] = defaultdict(list)
        self.eval: defaultdict[str, list[float]] = defaultdict(list)

    def means(self, mode: str) -> dict[str, float]:
        """The mean of each key's values of ``mode`` (``"train"`` or ``"eval"``)."""
        return {k: finite_mean(v) for k, v in self._values(mode).items()}

    def clear(self, mode: str) -> None:
        self._values(mode).clear()

    def _values(self, mode: str) -> defaultdict[str, list[float]]:
        if mode not in ("train", "eval"):
            raise ValueError(f"mode={mode!r}; choose 'train' or 'eval'.")
        return self.train if mode == "train" else self.eval
