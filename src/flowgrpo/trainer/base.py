"""`FlowBaseTrainer`: the one base class of flowgrpo's trainers, on ``transformers.Trainer``.

It keeps TRL's shape (``_tag_names``, ``_name``, ``_paper``, ``create_model_card``) with a model card for diffusers
LoRAs (TRL's private base reads ``model.config.model_type`` for telemetry and writes a text-generation card; neither
fits diffusers models), makes the Hub uploads of ``Trainer`` (``push_to_hub()`` and ``hub_strategy="every_save"``)
carry the diffusers LoRA, the card and its sample images, and makes every trainer crash-safe (atomic checkpoints,
resume from the newest complete one, preemption signals, the non-finite step guard, a checkpoint of the last
completed step when a reward fails: ``run_state/crash_safety.py`` says what each hook does). Crash safety overrides
Trainer's own hooks (the save sequence, the moment before ``optimizer.step()``), which callbacks cannot reach, so it
lives here rather than in callbacks.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import HubStrategy, SaveStrategy
from transformers.utils import logging

from ..rewards.failures import RewardFailedError
from .collectives import any_process
from .run_state.checkpointing import (
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
from .run_state.crash_safety import (
    STEP_GUARD_STATE_NAME,
    get_rng_states,
    observe_loss,
    resolve_resume_checkpoint,
    set_rng_states,
)
from .run_state.preemption import PreemptionHandler
from .run_state.step_guard import NonFiniteStepGuard, TooManySkippedStepsError

logger = logging.get_logger(__name__)

__all__ = ["FlowBaseTrainer"]


class FlowBaseTrainer(Trainer):
    """See the module docstring."""

    _tag_names: list[str] = []
    _name: str = ""
    _paper: dict[str, str] = {}

    #: filled by subclasses: the base model id, the reward names, the last evaluation's scores and images
    _card_base_model: str | None = None
    _card_rewards: list[str] = []
    #: the Hub task of the card, and the second expert's LoRA file of a two-expert pipeline
    _card_pipeline_tag: str = "text-to-image"
    _card_second_expert_lora: str | None = None

    def _card_last_eval(self) -> dict | None:
        """The last evaluation's metrics, contact sheet and samples (subclasses)."""
        return None

    def _card_extra_sections(self) -> str:
        """Subclasses add the training setup and evaluation scores here (markdown)."""
        return ""

    def _card_repo_id(self) -> str:
        """Where the card's snippet loads from: the Hub repo when there is one, else the output folder."""
        return getattr(self, "hub_model_id", None) or self.args.hub_model_id or str(self.args.output_dir)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, license: str | None = None, **kwargs) -> None:
        """Write ``README.md`` (and ``images/``) in ``output_dir``: a diffusers model card with a
        ``load_lora_weights`` snippet, the rewards, the training setup, and the last evaluation's scores and
        samples. ``model_name`` and other keyword arguments of ``Trainer.create_model_card`` are accepted."""
        if not self.is_world_process_zero():
            return
        from .outputs.hub import write_card_images
        from .outputs.model_card import card_tag, render_model_card

        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        is_lora = bool(getattr(self, "is_peft", True))
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        tag_list = [t for t in self._tag_names if is_lora or t != "lora"]
        tag_list += [card_tag(r) for r in self._card_rewards] + extra_tags
        last_eval = self._card_last_eval()
        samples, sheet = write_card_images(output_dir, last_eval)
        card = render_model_card(
            repo_id=self._card_repo_id(), base_model=self._card_base_model, rewards=list(self._card_rewards),
            tags=tag_list, trainer_name=self._name or "Flow-GRPO", paper=self._paper, dataset_name=dataset_name,
            extra_sections=self._card_extra_sections(), samples=samples, contact_sheet=sheet,
            metrics=(last_eval or {}).get("metrics"), is_lora=is_lora, license=license,
            pipeline_tag=self._card_pipeline_tag, second_expert_lora=self._card_second_expert_lora,
        )
        Path(output_dir, "README.md").write_text(card, encoding="utf-8")

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """``hub_strategy`` pushes after each save: also bring the diffusers export and a fresh model card into
        ``output_dir``, which ``Trainer`` then uploads (its own copy list only knows transformers/peft files)."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        in_progress = getattr(self, "push_in_progress", None)
        if not self.args.hub_always_push and in_progress is not None and not in_progress.is_done():
            return  # Trainer skips this push too; do not touch files an upload may be reading
        from .outputs.hub import copy_checkpoint_exports

        copy_checkpoint_exports(checkpoint_folder, self.args.output_dir)
        self.create_model_card()
        super()._push_from_checkpoint(checkpoint_folder)

    # ================================================================================================
    # crash safety (run_state/crash_safety.py)
    # ================================================================================================
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
            cls.training_step = observe_loss(step)

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
        """Logical OR of ``flag`` over all processes (`collectives.any_process`)."""
        return any_process(self.accelerator, flag)

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
            set_rng_states(self._rng_snapshot)
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
            self._rng_snapshot = get_rng_states()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._step_guard is not None:
            logs = {**logs, "skipped_steps": float(self._step_guard.skipped_steps)}
            self._last_train_logs = dict(logs)
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------
    #: True while a checkpoint is written (what goes into checkpoints but not into exports: the old policy, the health
    #: state, the reference adapter)
    _in_checkpoint = False

    def _save_checkpoint(self, model, trial) -> None:
        self._in_checkpoint = True
        try:
            self._save_checkpoint_atomically(trial)
        finally:
            self._in_checkpoint = False

    def _save_checkpoint_atomically(self, trial) -> None:
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


