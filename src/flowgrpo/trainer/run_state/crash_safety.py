"""Crash safety's pieces that need no trainer: resuming from the newest complete checkpoint, the step guard's view of
each step's loss, and the RNG states of the last completed step.

The trainer side (`flowgrpo.trainer.base.FlowBaseTrainer`) overrides ``transformers.Trainer``'s hooks with them:

* ``train(resume_from_checkpoint=...)``: ``True``, ``"last"`` or ``"true"`` resume from the newest *complete*
  checkpoint of ``output_dir`` (`resolve_resume_checkpoint`), or start fresh with one log line when there is none; an
  explicit ``checkpoint-N`` that is incomplete is a clear error. Before that the main process removes what
  interrupted saves left (`checkpointing.remove_stale_staging`). While training, the preemption signals
  (``args.preemption_signals``) are caught (`preemption.PreemptionHandler`).
* ``_save_checkpoint``: Trainer's sequence of writes (model, optimizer, scheduler, scaler, RNG, trainer state), into a
  staging folder published atomically (`checkpointing.save_checkpoint_atomically`); every process writes its share,
  the main process flushes and renames while the others wait; a failure on any process stops all of them with
  `checkpointing.CheckpointSaveError`, naming the path. Then the Hub push and the rotation (complete checkpoints
  only, never the newest one).
* ``training_step`` (of every subclass, wrapped at class creation by `observe_loss`) reports its loss to the step
  guard, and ``_get_grad_norm`` (called once per optimizer step, right before ``optimizer.step()``) lets the guard
  skip the update (`step_guard.NonFiniteStepGuard`); the decision is reduced over processes.
* ``_maybe_log_save_evaluate`` (the end of every optimizer step): counts skipped steps; when
  ``max_consecutive_skipped_steps`` is reached, logs the step, saves nothing and raises
  `step_guard.TooManySkippedStepsError`; when a preemption signal reached any process (a flag reduced over
  processes, so every rank stops after the same step), saves a checkpoint, stops, and ``train`` then raises
  ``SystemExit(0)``. It also keeps the RNG states of the step's end (`get_rng_states`), for the checkpoint below.
* A `RewardFailedError` raised by a step (a reward failed under ``on_failure="raise"``; raised on every process)
  happens before that step's update: ``train`` saves a checkpoint of the last completed step (with that step's RNG
  states) unless one exists, and re-raises with the checkpoint's path in the message.
* ``log``: training logs carry ``skipped_steps`` (over the run; saved in checkpoints).

These are overrides of Trainer's own hooks (the save sequence, the moment before ``optimizer.step()``), which
callbacks cannot reach; so crash safety lives in the base trainer, not in callbacks.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .checkpointing import checkpoint_problem, checkpoint_step, newest_complete_checkpoint

#: The step guard's counters inside each checkpoint.
STEP_GUARD_STATE_NAME = "step_guard.json"
#: ``resume_from_checkpoint`` values that mean "the newest complete checkpoint in output_dir".
RESUME_LAST_VALUES = ("last", "true")

__all__ = ["RESUME_LAST_VALUES", "STEP_GUARD_STATE_NAME", "get_rng_states", "observe_loss",
           "resolve_resume_checkpoint", "set_rng_states"]


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str | os.PathLike,
                              log: Callable[[str], None] | None = None) -> str | None:
    """The checkpoint folder ``train(resume_from_checkpoint=...)`` loads, or ``None`` for a fresh start.

    ``True`` / ``"last"`` / ``"true"``: the newest complete checkpoint of ``output_dir`` (``None``, and one line to
    ``log``, when there is none). ``False`` / ``None`` / ``"false"`` / ``""``: a fresh start. A path: itself; a
    ``checkpoint-N`` folder that is missing or incomplete raises ValueError naming the newest complete one.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() in ("false", "no", ""):
        return None
    if resume_from_checkpoint is True or str(resume_from_checkpoint).strip().lower() in RESUME_LAST_VALUES:
        found = newest_complete_checkpoint(output_dir)
        if found is None and log is not None:
            log(f"resume_from_checkpoint={resume_from_checkpoint!r}: no complete checkpoint in {output_dir}; "
                "starting from scratch.")
        elif log is not None:
            log(f"Resuming from {found}, the newest complete checkpoint in {output_dir}.")
        return found
    path = os.fspath(resume_from_checkpoint)
    if checkpoint_step(path) is not None:
        problem = checkpoint_problem(path) if os.path.exists(path) else "it does not exist"
        if problem is not None:
            newest = newest_complete_checkpoint(Path(path).parent)
            hint = f"the newest complete one there is {newest}" if newest else "there is no complete one there"
            raise ValueError(f"Cannot resume from {path}: {problem}. {hint[0].upper() + hint[1:]}; pass it, or "
                             "resume_from_checkpoint='last' to pick it.")
    return path


def observe_loss(training_step: Callable) -> Callable:
    """Wrap a ``training_step`` so that the step guard sees the loss it returns (outermost call only)."""

    @functools.wraps(training_step)
    def wrapper(self, *args, **kwargs):
        depth = self.__dict__.get("_loss_observer_depth", 0)
        self._loss_observer_depth = depth + 1
        try:
            loss = training_step(self, *args, **kwargs)
        finally:
            self._loss_observer_depth = depth
        guard = self.__dict__.get("_step_guard")
        if depth == 0 and guard is not None:
            guard.observe_loss(loss)
        return loss

    wrapper._observes_loss = True
    return wrapper


def get_rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])
