"""Non-finite guard: an optimizer step whose loss or gradient norm is not finite changes nothing.

Per optimizer step the trainer reports every micro-batch's loss (`NonFiniteStepGuard.observe_loss`, no device
sync) and then the gradient norm (`decide`). When any loss or the norm is NaN/inf on any process (the flag is
reduced over processes, so every rank takes the same decision), the step is skipped: every gradient is dropped
(``param.grad = None``), so ``optimizer.step()`` leaves the weights and the optimizer state (moments, step
counts) as they were, as torch optimizers skip parameters without a gradient. The step still counts as a
step: it consumed its batch, ``global_step`` advances and the LR schedule advances with it, so the schedule stays a
function of ``global_step`` and a resumed run (which restores the scheduler from the checkpoint) is exact.

``skipped_steps`` counts skipped steps over the run (it is saved in checkpoints); ``max_consecutive`` skipped
steps in a row stop the run with `TooManySkippedStepsError`.

Under fp16 loss scaling a non-finite gradient is an overflow that the gradient scaler already skips (and answers
by lowering the scale); the guard leaves such steps to the scaler and only acts on a non-finite loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NonFiniteStepGuard", "TooManySkippedStepsError"]


class TooManySkippedStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu())
    return float(value)


class NonFiniteStepGuard:
    """Decides, per optimizer step, whether to skip the update (see the module docstring)."""

    def __init__(self, max_consecutive: int = 5):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive_skipped_steps={max_consecutive} must be >= 1.")
        self.max_consecutive = int(max_consecutive)
        self.skipped_steps = 0
        self.consecutive = 0
        self.first_skipped_step: int | None = None
        self.last_step_skipped = False
        self.last_loss = math.nan
        self.last_grad_norm = math.nan
        self._loss_sum: torch.Tensor | None = None

    # ---- per micro-batch ------------------------------------------------------------------------
    def observe_loss(self, loss: Any) -> None:
        """Add a micro-batch's loss to this step's sum (kept on the device: no synchronisation here). Any NaN or
        inf loss makes the sum non-finite."""
        if loss is None:
            return
        value = loss.detach().float().sum() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        if self._loss_sum is not None and value.device != self._loss_sum.device:
            value = value.to(self._loss_sum.device)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    # ---- per optimizer step ---------------------------------------------------------------------
    def decide(self, grad_norm: Any, *, any_process: Callable[[torch.Tensor], torch.Tensor],
               device: torch.device, scaler_active: bool = False) -> bool:
        """Whether to skip this step's update; ``any_process(flag)`` reduces a bool tensor with a logical OR."""
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros(())
        flag = ~torch.isfinite(loss_sum.to(device))
        if grad_norm is not None and not scaler_active:
            norm = grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
            flag = flag | ~torch.isfinite(norm.float().to(device))
        skip = bool(any_process(flag.reshape(())))
        self.last_loss = _as_float(self._loss_sum)
        self.last_grad_norm = _as_float(grad_norm)
        self._loss_sum = None
        self.last_step_skipped = skip
        return skip

    @staticmethod
    def drop_gradients(optimizer: Any) -> None:
        """Drop every gradient the optimizer would apply, so that its step changes nothing."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    def record(self, step: int) -> None:
        """Account for optimizer step ``step`` (after `decide`)."""
        if self.last_step_skipped:
            self.skipped_steps += 1
            self.consecutive += 1
            if self.consecutive == 1:
                self.first_skipped_step = step
        else:
            self.consecutive = 0
            self.first_skipped_step = None

    @property
    def limit_reached(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def failure_message(self, step: int, logs: dict[str, float] | None, newest_checkpoint: str | None) -> str:
        """The error of `TooManySkippedStepsError`: the streak, and the last step's reward and loss statistics."""
        stats = {k: v for k, v in (logs or {}).items()
                 if isinstance(v, (int, float)) and ("reward" in k or "loss" in k or k in ("grad_norm", "kl"))}
        stats.setdefault("loss", self.last_loss)
        stats["grad_norm"] = self.last_grad_norm
        shown = ", ".join(f"{k}={v:.6g}" for k, v in stats.items())
        first = self.first_skipped_step if self.first_skipped_step is not None else step
        kept = f"The newest checkpoint is {newest_checkpoint}." if newest_checkpoint else "No checkpoint was saved."
        return (
            f"Stopping at step {step}: {self.consecutive} optimizer steps in a row (steps {first}-{step}) had a "
            f"non-finite loss or gradient norm, so their updates were skipped (max_consecutive_skipped_steps="
            f"{self.max_consecutive}). Last step: {shown}. Nothing was saved for these steps. {kept} Common causes: a "
            "learning rate too high for this model, a reward returning extreme values, or fp16 overflow; lower "
            "learning_rate (or use bf16), check the rewards, then rerun with --resume_from_checkpoint last."
        )

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive,
                "first_skipped_step": self.first_skipped_step}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive = int(state.get("consecutive", 0))
        first = state.get("first_skipped_step")
        self.first_skipped_step = int(first) if first is not None else None
