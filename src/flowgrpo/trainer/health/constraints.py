"""Reward constraints: named rewards kept above a bound, each with a Lagrange multiplier (``reward_constraints``).

The problem (PPO-Lagrangian, Ray et al. 2019; constrained RLHF, Moskovitz et al. 2023): maximise the objective J_0
(the weighted training rewards) subject to J_i >= b_i for every constrained reward i. Its Lagrangian

    L(theta, lambda) = J_0(theta) + sum_i lambda_i (J_i(theta) - b_i),    lambda_i >= 0,

is maximised over the policy and minimised over the multipliers:

* the policy follows the advantage of L, normalised to keep its scale (``rollout/advantages.py``,
  `combine_constrained_advantages`): A = (A_0 + sum_i lambda_i A_i) / (1 + sum_i lambda_i), A_i reward i's own
  group-normalised advantage;
* each multiplier takes a projected dual-ascent step of size eta (``constraint_lr``, or the constraint's own
  ``lr``) on its constraint's slack
  s_i = J_i_hat - b_i:

      lambda_i <- max(0, lambda_i - eta s_i) = max(0, lambda_i + eta (b_i - J_i_hat)).

  A violated constraint (s_i < 0) raises its multiplier, a satisfied one lowers it towards 0, where the constraint
  no longer acts. Multipliers start at 0.

The estimate J_i_hat comes from the constraint's ``source``:

* ``rollouts``: the mean of reward i over the gathered rollout batch (unscored images left out), at every scored
  generation; the step is taken before that generation's advantages are formed, so a violation acts at once;
* ``evaluation``: the periodic evaluation's ``eval_rewards/<name>/mean``, at the evaluation's own settings (its
  guidance, steps, solver, prompts and seeds, and the weights it evaluates: the EMA's when there is one), at every
  evaluation; an evaluation at a step already observed (the evaluation on start of a resumed run) takes no step.

The bound: ``min`` gives b_i itself; ``min_delta`` gives b_i = J_i(start) + min_delta, with J_i(start) the first
value its source gives (the first scored generation, before any update; the evaluation on start).

Logged at every scored generation (``constraint/<name>/value``, ``/bound``, ``/slack``, ``/multiplier``: the value
and slack that the last step used, and the multiplier after it) and in every evaluation's metrics. The state (the
multipliers, the start values, the last values) is saved in every checkpoint with the health state and restored on
resume, so a resumed run continues with the same multipliers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..json_setting import decode_json_setting

__all__ = ["CONSTRAINT_SOURCES", "ConstraintSpec", "RewardConstraints", "check_constraint_rewards",
           "parse_reward_constraints"]

CONSTRAINT_SOURCES = ("rollouts", "evaluation")
_KEYS = ("min", "min_delta", "source", "lr")


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint: keep reward ``name`` at least ``min``, or at least its start value plus ``min_delta``,
    measured on ``source``; ``lr``: its own dual step size (None: ``constraint_lr``)."""

    name: str
    source: str = "rollouts"
    min: float | None = None
    min_delta: float | None = None
    lr: float | None = None

    def as_dict(self) -> dict[str, Any]:
        bound = {"min": self.min} if self.min is not None else {"min_delta": self.min_delta}
        return {**bound, "source": self.source, **({} if self.lr is None else {"lr": self.lr})}


def parse_reward_constraints(value: Any) -> list[ConstraintSpec]:
    """The constraints of ``reward_constraints``: a mapping (or its JSON text) from reward name to ``{"min": x}`` or
    ``{"min_delta": x}`` with an optional ``"source"`` (``rollouts``, the default, or ``evaluation``) and an optional
    ``"lr"`` (this constraint's dual step size, for rewards of different scales or measured at different rates;
    default ``constraint_lr``). None or an empty mapping: no constraint. Raises ValueError naming the bad entry and
    the fix."""
    if value is None or value == "":
        return []
    value = decode_json_setting(value, "reward_constraints", "give a mapping such as "
                                "'{\"toy_color\": {\"min_delta\": -0.02, \"source\": \"evaluation\"}}'.")
    if not isinstance(value, Mapping):
        raise ValueError(f"reward_constraints={value!r} must be a mapping from reward name to its bound, e.g. "
                         "{'toy_color': {'min_delta': -0.02, 'source': 'evaluation'}}.")
    specs = []
    for name, entry in value.items():
        where = f"reward_constraints[{name!r}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}={entry!r} must be a mapping with one bound, 'min' or 'min_delta', and a "
                             "'source' ('rollouts' or 'evaluation').")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; the keys are 'min' or 'min_delta', 'source' and "
                             "'lr'.")
        bounds = [key for key in ("min", "min_delta") if entry.get(key) is not None]
        if len(bounds) != 1:
            raise ValueError(f"{where}={dict(entry)!r} gives {'both bounds' if bounds else 'no bound'}; give exactly "
                             "one: 'min' (an absolute floor) or 'min_delta' (relative to the value at the start, e.g. "
                             "-0.02).")
        bound = entry[bounds[0]]
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise ValueError(f"{where}.{bounds[0]}={bound!r} must be a finite number.")
        source = entry.get("source", "rollouts")
        if source not in CONSTRAINT_SOURCES:
            raise ValueError(f"{where}.source={source!r} is not valid; choose 'rollouts' (each scored generation) or "
                             "'evaluation' (the periodic evaluation).")
        lr = entry.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0):
            raise ValueError(f"{where}.lr={lr!r} must be a number >= 0 (this constraint's dual step size), or left "
                             "out for constraint_lr.")
        specs.append(ConstraintSpec(name=str(name), source=source, lr=None if lr is None else float(lr),
                                    **{bounds[0]: float(bound)}))
    return specs


def check_constraint_rewards(args: Any, reward_names: Sequence[str], gold_names: Sequence[str] = (),
                             has_eval_dataset: bool = True) -> list[str]:
    """The checks of the constraints that need the rewards and datasets, before anything loads. Returns the
    constrained rewards that are not among ``reward_names`` (the trainer scores them with weight 0). A name must be a
    training reward or a registered reward, never a gold evaluation reward (those are never trained on)."""
    specs = parse_reward_constraints(getattr(args, "reward_constraints", None))
    if not specs:
        return []
    from ..registry import spec_of

    refusal = spec_of(args).advantage_free  # the algorithm's spec: why its loss reads no advantage
    if refusal:
        raise ValueError(f"reward_constraints act through the advantages, which {refusal}; remove "
                         "reward_constraints (or train with an advantage-based trainer).")
    from ...rewards import list_rewards

    gold = [spec.name for spec in specs if spec.name in set(gold_names)]
    if gold:
        raise ValueError(f"reward_constraints {gold} are gold evaluation rewards (eval_reward_funcs), which are never "
                         "trained on; constrain a training reward, or remove them from eval_reward_funcs.")
    known = set(list_rewards())
    added = [spec.name for spec in specs if spec.name not in reward_names]
    unknown = [name for name in added if name not in known]
    if unknown:
        raise ValueError(f"reward_constraints name unknown reward(s) {unknown}: a constraint keeps a reward of "
                         f"reward_funcs ({list(reward_names)}) or a registered reward (scored with weight 0); fix the "
                         "name, or add the reward to reward_funcs.")
    if not has_eval_dataset:
        names = [spec.name for spec in specs if spec.source == "evaluation"]
        if names:
            raise ValueError(f"reward_constraints {names} read the periodic evaluation (source: evaluation), but the "
                             "trainer has no eval_dataset; pass one (eval_dataset_name in a recipe), or use source: "
                             "rollouts.")
    return added


def _mean(values: torch.Tensor) -> float:
    values = values.double()
    valid = values[~torch.isnan(values)]
    return float(valid.mean()) if valid.numel() else math.nan


class RewardConstraints:
    """The multipliers and their dual ascent (see the module docstring).

    Args:
        specs: the constraints (`parse_reward_constraints`).
        lr: the dual step size eta (``constraint_lr``).
    """

    def __init__(self, specs: Sequence[ConstraintSpec], lr: float):
        self.specs = {spec.name: spec for spec in specs}
        self.lr = float(lr)
        self.multipliers: dict[str, float] = {name: 0.0 for name in self.specs}
        self.start: dict[str, float | None] = {name: None for name in self.specs}
        self.values: dict[str, float | None] = {name: None for name in self.specs}
        self.last_evaluation_step: int | None = None

    @classmethod
    def from_args(cls, args: Any) -> RewardConstraints | None:
        """The constraints of a configuration (None without any)."""
        specs = parse_reward_constraints(getattr(args, "reward_constraints", None))
        return cls(specs, getattr(args, "constraint_lr", 1.0)) if specs else None

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def bound(self, name: str) -> float | None:
        """b_i, or None while a relative bound waits for its start value."""
        spec = self.specs[name]
        if spec.min is not None:
            return spec.min
        start = self.start[name]
        return None if start is None else start + spec.min_delta

    def slack(self, name: str) -> float | None:
        """s_i = J_i_hat - b_i of the last value (None before the first)."""
        value, bound = self.values[name], self.bound(name)
        return None if value is None or bound is None or math.isnan(value) else value - bound

    def observe(self, name: str, value: float) -> None:
        """One dual step of constraint ``name`` from its estimate ``value`` (NaN: nothing was scored, no step)."""
        if value is None or math.isnan(value):
            return
        if self.start[name] is None:
            self.start[name] = float(value)
        self.values[name] = float(value)
        slack = self.slack(name)
        lr = self.lr if self.specs[name].lr is None else self.specs[name].lr
        self.multipliers[name] = max(0.0, self.multipliers[name] - lr * slack)

    def observe_rollouts(self, per_reward: Mapping[str, torch.Tensor]) -> None:
        """The dual step of every rollout-sourced constraint from a gathered batch's scores (``per_reward``)."""
        for name, spec in self.specs.items():
            if spec.source == "rollouts":
                self.observe(name, _mean(per_reward[name]))

    def observe_evaluation(self, metrics: Mapping[str, float], prefix: str, step: int) -> None:
        """The dual step of every evaluation-sourced constraint from an evaluation's metrics (``prefix``: the
        evaluation's metric prefix, ``eval``; the means at eval_guidance_scale). An evaluation at a step at or before
        the last one observed takes no step."""
        if not any(spec.source == "evaluation" for spec in self.specs.values()):
            return
        if self.last_evaluation_step is not None and step <= self.last_evaluation_step:
            return
        self.last_evaluation_step = int(step)
        for name, spec in self.specs.items():
            if spec.source == "evaluation":
                self.observe(name, float(metrics.get(f"{prefix}_rewards/{name}/mean", math.nan)))

    @property
    def active(self) -> bool:
        """Whether a multiplier is above 0 (otherwise the advantages are the objective's)."""
        return any(m > 0 for m in self.multipliers.values())

    def metrics(self) -> dict[str, float]:
        """``constraint/<name>/{value,bound,slack,multiplier}``; those not known yet are left out."""
        out: dict[str, float] = {}
        for name in self.specs:
            for key, value in (("value", self.values[name]), ("bound", self.bound(name)),
                               ("slack", self.slack(name)), ("multiplier", self.multipliers[name])):
                if value is not None:
                    out[f"constraint/{name}/{key}"] = float(value)
        return out

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"multipliers": dict(self.multipliers), "start": dict(self.start), "values": dict(self.values),
                "last_evaluation_step": self.last_evaluation_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, target in (("multipliers", self.multipliers), ("start", self.start), ("values", self.values)):
            saved = state.get(key, {})
            for name in self.specs:
                if name in saved:
                    target[name] = saved[name]
        self.last_evaluation_step = state.get("last_evaluation_step")
