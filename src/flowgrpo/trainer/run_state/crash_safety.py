"""Crash safety for every flowgrpo trainer: atomic checkpoints, resume from the newest complete one, preemption
signals, the non-finite step guard, and a checkpoint of the last completed step when a reward fails.

`CrashSafeTrainerMixin` sits between ``FlowBaseTrainer`` and ``transformers.Trainer`` and overrides Trainer's hooks
only; the training loop is Trainer's. What each hook does:

* ``train(resume_from_checkpoint=...)``: ``True``, ``"last"`` or ``"true"`` resume from the newest *complete*
  checkpoint of ``output_dir`` (`checkpointing.newest_complete_checkpoint`), or start fresh with one log line
  when there is none; an explicit ``checkpoint-N`` that is incomplete is a clear error. Before that the main
  process removes what interrupted saves left (`checkpointing.remove_stale_staging`). While training, the
  preemption signals (``args.preemption_signals``) are caught (`preemption.PreemptionHandler`).
* ``_save_checkpoint``: Trainer's sequence of writes (model, optimizer, scheduler, scaler, RNG, trainer state),
  into a staging folder published atomically (`checkpointing.save_checkpoint_atomically`); every process writes
  its share, the main process flushes and renames while the others wait; a failure on any process stops all of
  them with `checkpointing.CheckpointSaveError`, naming the path. Then the Hub push and the rotation
  (`_rotate_checkpoints`: complete checkpoints only, never the newest one).
* ``training_step`` (of every subclass, wrapped at class creation) reports its loss to the step guard, and
  ``_get_grad_norm`` (called once per optimizer step, right before ``optimizer.step()``) lets the guard skip
  the update (`step_guard.NonFiniteStepGuard`); the decision is reduced over processes.
* ``_maybe_log_save_evaluate`` (the end of every optimizer step): counts skipped steps; when
  ``max_consecutive_skipped_steps`` is reached, logs the step, saves nothing and raises
  `step_guard.TooManySkippedStepsError`; when a preemption signal reached any process (a flag reduced over
  processes, so every rank stops after the same step), saves a checkpoint, stops, and ``train`` then raises
  ``SystemExit(0)``. It also keeps the RNG states of the step's end, for the checkpoint below.
* A `RewardFailedError` raised by a step (a reward failed under ``on_failure="raise"``; trainers raise it on every
  process through ``_raise_if_reward_failed``) happens before that step's update: ``train`` saves a checkpoint of
  the last completed step (with that step's RNG states) unless one exists, and re-raises with the checkpoint's path
  in the message.
* ``log``: training logs carry ``skipped_steps`` (over the run; saved in checkpoints).
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging

from ...rewards.failures import RewardFailedError
from .checkpointing import (
    TRAINER_STATE_NAME,
    CheckpointSaveError,
    checkpoint_path,
    checkpoint_problem,
    checkpoint_step,
    newest_complete_checkpoint,
    remove_stale_staging,
    rotate_checkpoints,
    save_checkpoint_atomically,
)
from .preemption import PreemptionHandler
from .step_guard import NonFiniteStepGuard, TooManySkippedStepsError

logger = logging.get_logger(__name__)

#: The step guard's counters inside each checkpoint.
STEP_GUARD_STATE_NAME = "step_guard.json"
#: ``resume_from_checkpoint`` values that mean "the newest complete checkpoint in output_dir".
RESUME_LAST_VALUES = ("last", "true")

__all__ = ["RESUME_LAST_VALUES", "STEP_GUARD_STATE_NAME", "CrashSafeTrainerMixin", "resolve_resume_checkpoint"]


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


def _observe_loss(training_step: Callable) -> Callable:
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


class CrashSafeTrainerMixin:
    """Mixed into ``FlowBaseTrainer`` before ``transformers.Trainer`` (see the module docstring)."""

    _step_guard: NonFiniteStepGuard | None = None
    _preemption: PreemptionHandler | None = None
    _preemption_handled = False
    _update_started = False
    _rng_snapshot: dict | None = None
    _last_train_logs: dict | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("training_step")
        if step is not None and not getattr(step, "_observes_loss", False):
            cls.training_step = _observe_loss(step)

    # ------------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------------
    @property
    def step_guard(self) -> NonFiniteStepGuard:
        if self._step_guard is None:
            self._step_guard = NonFiniteStepGuard(getattr(self.args, "max_consecutive_skipped_steps", 5))
        return self._step_guard

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step's update was skipped by the non-finite guard."""
        return self._step_guard is not None and self._step_guard.last_step_skipped

    @property
    def stopped_by_preemption(self) -> bool:
        return self._preemption_handled

    def _is_main_process(self) -> bool:
        return bool(self.args.should_save)

    def _any_process(self, flag: bool | torch.Tensor) -> bool:
        """Logical OR of ``flag`` over all processes (a one-element all-reduce; local when there is one process)."""
        value = flag.detach().reshape(()).to(torch.int32) if isinstance(flag, torch.Tensor) else \
            torch.tensor(int(bool(flag)), dtype=torch.int32)
        if self.accelerator.num_processes > 1 and torch.distributed.is_available() and \
                torch.distributed.is_initialized():
            value = value.to(self.accelerator.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item())

    def _all_processes_ok(self, ok: bool) -> bool:
        return not self._any_process(not ok)

    # ------------------------------------------------------------------------------------------------
    # train: resume, stale staging, signals, reward failures
    # ------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        output_dir = self.args.output_dir
        if self._is_main_process():
            remove_stale_staging(output_dir)
        self.accelerator.wait_for_everyone()
        announce = logger.warning if self.args.process_index == 0 else None
        resume = resolve_resume_checkpoint(resume_from_checkpoint, output_dir, log=announce)

        self._step_guard = NonFiniteStepGuard(getattr(self.args, "max_consecutive_skipped_steps", 5))
        if resume is not None and os.path.isfile(os.path.join(resume, STEP_GUARD_STATE_NAME)):
            with open(os.path.join(resume, STEP_GUARD_STATE_NAME), encoding="utf-8") as f:
                self._step_guard.load_state_dict(json.load(f))
        self._update_started = False
        self._rng_snapshot = None
        self._preemption_handled = False
        signals = list(getattr(self.args, "preemption_signals", None) or [])
        self._preemption = PreemptionHandler(signals) if signals else None
        installed = self._preemption.installed_while() if self._preemption is not None else nullcontext()
        with installed:
            if self._preemption is not None and not self._preemption.installed:
                logger.warning(f"preemption_signals={signals} are not handled: train() runs outside the main thread, "
                               "where Python cannot install signal handlers.")
            try:
                output = super().train(resume_from_checkpoint=resume, trial=trial, **kwargs)
            except RewardFailedError as err:
                where = self._checkpoint_after_reward_failure(trial)
                err.args = (f"{err.args[0] if err.args else err} The last completed step "
                            f"({self.state.global_step}) {where}; once the reward works again, rerun the same "
                            "command with --resume_from_checkpoint last (or set reward_on_failure='skip' to score "
                            "failed samples None and go on).",)
                raise
        if self._preemption_handled:
            if self.args.process_index == 0:
                newest = newest_complete_checkpoint(self._get_output_dir(trial))
                logger.warning(f"Stopped by {self._preemption.signal_name} after step {self.state.global_step}; "
                               f"checkpoint: {newest}. Rerun the same command with --resume_from_checkpoint last.")
            raise SystemExit(0)
        return output

    def _checkpoint_after_reward_failure(self, trial: Any) -> str:
        """Save the last completed step if needed; returns where it is, for the error message."""
        try:
            saved = self._save_last_completed_step(trial)
        except CheckpointSaveError as save_error:
            return f"could not be saved ({save_error})"
        if saved is not None:
            return f"is saved in {saved}"
        newest = newest_complete_checkpoint(self._get_output_dir(trial))
        if newest is not None and checkpoint_step(newest) == self.state.global_step:
            return f"is saved in {newest}"
        return f"has no checkpoint; the newest complete one is {newest}" if newest else "has no checkpoint"

    def _save_last_completed_step(self, trial: Any = None) -> str | None:
        """Checkpoint of ``state.global_step`` when the failed step had not begun its update and none exists."""
        step = self.state.global_step
        if step <= 0 or self._update_started:
            return None
        final = checkpoint_path(self._get_output_dir(trial), step)
        missing = self._is_main_process() and checkpoint_problem(final) is not None
        if not self._any_process(missing):
            return None
        if self._rng_snapshot is not None:
            _set_rng_states(self._rng_snapshot)
        self._save_checkpoint(self.model_wrapped, trial)
        return str(final)

    def _raise_if_reward_failed(self, error: BaseException | None) -> None:
        """Raise `RewardFailedError` on every process when a reward raised on any (the flag is reduced, so that no
        process is left waiting in the reward gather); ``train`` then saves the last completed step. Trainers call it
        with the reward exception of the step's rollout (``None`` when every reward worked)."""
        if not self._any_process(error is not None):
            return
        step = self.state.global_step + 1
        if error is None:
            raise RewardFailedError(f"A reward failed on another process while scoring the rollout of step {step}.")
        notes = "; ".join(getattr(error, "__notes__", []))
        raise RewardFailedError(f"A reward failed while scoring the rollout of step {step} ({notes or 'reward'}): "
                                f"{type(error).__name__}: {error}.") from error

    # ------------------------------------------------------------------------------------------------
    # the optimizer step and the end of the step
    # ------------------------------------------------------------------------------------------------
    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._update_started = True
        guard = self.step_guard
        scaler = getattr(self.accelerator, "scaler", None)
        if guard.decide(grad_norm, any_process=self._any_process, device=self.accelerator.device,
                        scaler_active=scaler is not None):
            if scaler is None:
                guard.drop_gradients(self.optimizer)
            if self.args.process_index == 0:
                logger.warning(f"Step {self.state.global_step + 1}: non-finite loss ({guard.last_loss:.4g}) or "
                               f"gradient norm ({guard.last_grad_norm:.4g}); the update is skipped (weights and "
                               "optimizer state unchanged).")
        return grad_norm

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        after_update = self._update_started
        guard = self.step_guard
        if after_update:
            guard.record(self.state.global_step)
        abort = after_update and guard.limit_reached
        stop = False
        if not abort and self._preemption is not None and not self._preemption_handled:
            stop = self._any_process(self._preemption.requested)
        if abort:
            self.control.should_save = False
            self.control.should_evaluate = False
            self.control.should_log = True
            self.control.should_training_stop = True
        elif stop:
            self.control.should_save = True
            self.control.should_evaluate = False
            self.control.should_training_stop = True
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if abort:
            trial = args[3] if len(args) > 3 else kwargs.get("trial")
            newest = newest_complete_checkpoint(self._get_output_dir(trial))
            raise TooManySkippedStepsError(guard.failure_message(self.state.global_step, self._last_train_logs,
                                                                 newest))
        if stop:
            self._preemption_handled = True
        if after_update:
            self._update_started = False
            self._rng_snapshot = _get_rng_states()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._step_guard is not None:
            logs = {**logs, "skipped_steps": float(self._step_guard.skipped_steps)}
            self._last_train_logs = dict(logs)
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, written through a staging folder and renamed into place (see the module doc)."""
        args = self.args
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and \
                self.state.best_global_step:
            best = checkpoint_path(run_dir, self.state.best_global_step)
            if self.state.best_global_step == step or best.exists():
                self.state.best_model_checkpoint = str(best)

        def write(folder: Path) -> None:
            folder = str(folder)
            self.save_model(folder, _internal_call=True)
            if not args.save_only_model:
                self._save_optimizer_and_scheduler(folder)
                self._save_scaler(folder)
                self._save_rng_state(folder)
            if args.should_save:
                for cb in [c for c in self.callback_handler.callbacks + [self.control]
                           if isinstance(c, ExportableState)]:
                    name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(cb_state)
                    else:
                        self.state.stateful_callbacks[name] = cb_state
                with open(os.path.join(folder, STEP_GUARD_STATE_NAME), "w", encoding="utf-8") as f:
                    json.dump(self.step_guard.state_dict(), f)
                self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))

        final = save_checkpoint_atomically(run_dir, step, write, is_main_process=self._is_main_process(),
                                           all_processes_ok=self._all_processes_ok)
        if args.push_to_hub:
            self._push_from_checkpoint(str(final))
        if args.should_save:
            self._rotate_checkpoints(run_dir)

    def _rotate_checkpoints(self, output_dir: str) -> list[str]:
        """Keep the newest ``save_total_limit`` complete checkpoints (and the best model's); never the newest."""
        return rotate_checkpoints(output_dir, self.args.save_total_limit, keep=[self.state.best_model_checkpoint])


def _get_rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])
