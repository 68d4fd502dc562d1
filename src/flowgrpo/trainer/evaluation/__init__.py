"""Evaluation (`Evaluator`): deterministic sampling with fixed seeds, rewards, and the paired change since the first
one."""

from .eval_change import EvaluationBaseline
from .evaluator import Evaluator

__all__ = ["EvaluationBaseline", "Evaluator"]
