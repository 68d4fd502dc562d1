r"""Alarms over a run's trajectories: reward hacking (training reward up, gold reward down) and diversity collapse.

**Hacking alarm** (`HackingAlarm`). The trainer feeds it the training reward of every optimizer step
(`observe_train_reward`) and, at every evaluation, the gold rewards' means (`update`). For each gold reward g it
keeps its best value b_g, the step s_g of that evaluation and, from the training rewards, the training reward
around s_g:

    T(s_g) = mean of the training rewards of the last W steps up to s_g (the first W steps after s_g when none
             came before, e.g. for an evaluation on start),     W = the steps since the previous evaluation,
    T_now  = mean of the training rewards since the previous evaluation.

The alarm fires at an evaluation where, for some gold reward, ``b_g - value_g > tolerance`` (fallen by more than
``hacking_tolerance`` from its best) while ``T_now > T(s_g)`` (the training reward rose meanwhile). A gold reward
that falls together with the training reward is a collapse, not hacking, and leaves it quiet.

**Diversity alarm** (`DiversityAlarm`). With d_1 the first finite within-group diversity of the run and d_now
the mean of the last `DIVERSITY_WINDOW` values, it fires while ``d_now < diversity_collapse_ratio * d_1``.

Both keep their state in plain dicts (`state_dict` / `load_state_dict`), saved in every checkpoint, so that a
resumed run compares against the same best values, steps and baselines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["DIVERSITY_WINDOW", "DiversityAlarm", "HackingAlarm", "HackingVerdict"]

DIVERSITY_WINDOW = 5


def _finite(value: float | None) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def _mean(values: list[float]) -> float:
    values = [v for v in values if _finite(v)]
    return sum(values) / len(values) if values else math.nan


@dataclass
class HackingVerdict:
    """What one evaluation showed: ``fired`` and, per gold reward that fell, (best, now, best step)."""

    step: int
    fired: bool
    train_reward_now: float
    fallen: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    def message(self, tolerance: float) -> str:
        parts = [f"{name} {now:.4f} (best {best:.4f} at step {at})" for name, (best, now, at) in self.fallen.items()]
        return (f"Reward hacking at step {self.step}: the training reward rose to {self.train_reward_now:.4f} while "
                f"the gold evaluation reward fell by more than hacking_tolerance={tolerance:g}: {'; '.join(parts)}.")


class HackingAlarm:
    """See the module docstring. ``greater_is_better`` per gold reward is True (rewards)."""

    def __init__(self, tolerance: float):
        if tolerance < 0:
            raise ValueError(f"hacking_tolerance={tolerance} must be >= 0.")
        self.tolerance = float(tolerance)
        self.train_steps: list[int] = []
        self.train_rewards: list[float] = []
        self.best: dict[str, tuple[float, int]] = {}
        self.last_eval_step: int | None = None
        self.fired_steps: list[int] = []

    def observe_train_reward(self, step: int, reward: float) -> None:
        if _finite(reward):
            self.train_steps.append(int(step))
            self.train_rewards.append(float(reward))

    def _window(self, start: int, end: int) -> float:
        """Mean training reward of steps in (start, end]."""
        return _mean([r for s, r in zip(self.train_steps, self.train_rewards) if start < s <= end])

    def _train_at(self, step: int, width: int) -> float:
        before = self._window(step - width, step)
        return before if _finite(before) else self._window(step, step + width)

    def update(self, step: int, gold: Mapping[str, float]) -> HackingVerdict:
        """Compare the gold means of the evaluation at ``step`` with their best; returns the verdict."""
        previous = self.last_eval_step if self.last_eval_step is not None else -1
        width = max(1, step - previous)
        now = self._window(previous, step)
        verdict = HackingVerdict(step=int(step), fired=False, train_reward_now=now)
        for name, value in gold.items():
            if not _finite(value):
                continue
            if name not in self.best or value > self.best[name][0]:
                self.best[name] = (float(value), int(step))
                continue
            best, best_step = self.best[name]
            if best - value > self.tolerance:
                then = self._train_at(best_step, width)
                if _finite(now) and _finite(then) and now > then:
                    verdict.fallen[name] = (best, float(value), best_step)
        verdict.fired = bool(verdict.fallen)
        if verdict.fired:
            self.fired_steps.append(int(step))
        self.last_eval_step = int(step)
        return verdict

    def state_dict(self) -> dict:
        return {"tolerance": self.tolerance, "train_steps": list(self.train_steps),
                "train_rewards": list(self.train_rewards),
                "best": {k: [v, s] for k, (v, s) in self.best.items()},
                "last_eval_step": self.last_eval_step, "fired_steps": list(self.fired_steps)}

    def load_state_dict(self, state: Mapping) -> None:
        self.train_steps = [int(s) for s in state.get("train_steps", [])]
        self.train_rewards = [float(r) for r in state.get("train_rewards", [])]
        self.best = {k: (float(v[0]), int(v[1])) for k, v in state.get("best", {}).items()}
        self.last_eval_step = state.get("last_eval_step")
        self.fired_steps = [int(s) for s in state.get("fired_steps", [])]


class DiversityAlarm:
    """See the module docstring; ``ratio`` 0 disables it (it never fires)."""

    def __init__(self, ratio: float, window: int = DIVERSITY_WINDOW):
        if not 0 <= ratio < 1:
            raise ValueError(f"diversity_collapse_ratio={ratio} must be in [0, 1) (0 disables the alarm).")
        self.ratio = float(ratio)
        self.window = int(window)
        self.first: float | None = None
        self.recent: list[float] = []

    def update(self, diversity: float) -> bool:
        """Add one step's diversity; returns whether the alarm is on."""
        if not _finite(diversity):
            return False
        if self.first is None:
            self.first = float(diversity)
        self.recent = (self.recent + [float(diversity)])[-self.window:]
        return self.active

    @property
    def active(self) -> bool:
        if self.ratio <= 0 or self.first is None or not self.recent:
            return False
        return _mean(self.recent) < self.ratio * self.first

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "first": self.first, "recent": list(self.recent)}

    def load_state_dict(self, state: Mapping) -> None:
        self.first = state.get("first")
        self.recent = [float(v) for v in state.get("recent", [])]
