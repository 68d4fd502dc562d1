"""What a training run prints: one progress bar with the key figures, and a short table at each evaluation.

transformers' own ``ProgressCallback`` writes every logged dictionary (about 30 keys per step here) under its bar,
and the rollout had a bar of its own; a run of 60 steps filled the terminal with dictionaries. `TrainingConsole`
replaces it (and ``PrinterCallback``, its ``disable_tqdm`` twin) on the main process:

* a bar over the optimizer steps whose postfix holds ``reward`` (the mean of the weighted total) ``± reward_std``,
  the mean of each reward (the first `MAX_REWARDS_SHOWN`), the loss, and with rollouts on Ray workers the staleness
  (``rollout/staleness_max``: how many optimizer steps old the weights that sampled the step's samples were); the bar's rate is the time per step
  (``s/step``). While a step samples, the bar's description shows how far its rollout is (``rollout 40%``);
* at each evaluation, a table: per reward its mean, std, images scored, and the change since the first evaluation
  with its standard error when there is one;
* with ``disable_tqdm``, or when standard error is not a terminal (a cluster job's log file, CI), one line per
  logging step with the same figures and the seconds per step, and the same tables: a log file never receives the
  bar's refreshes.

The full dictionaries still reach every ``report_to`` logger and ``trainer_state.json``; the configuration flag
``print_full_logs`` prints them on the terminal too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import TrainerCallback

#: tqdm's default layout with the time per step (``rate_inv_fmt``: ``2.31s/step``) instead of steps per second.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"

#: Rewards whose mean the bar shows (the others stay in the loggers and the evaluation table).
MAX_REWARDS_SHOWN = 4


def _number(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{float(value):.{digits}f}"


def train_figures(logs: Mapping[str, Any], reward_names: Sequence[str]) -> str:
    """The key figures of a training log: ``reward 0.412±0.120 | ocr 0.400 | jpeg -0.120 | loss 0.0012``, and with
    rollouts on Ray workers the staleness of the trained samples (``| stale 1``)."""
    parts = []
    if "reward" in logs:
        parts.append(f"reward {_number(logs['reward'])}±{_number(logs.get('reward_std'))}")
    for name in reward_names[:MAX_REWARDS_SHOWN]:
        key = f"rewards/{name}/mean"
        if key in logs and len(reward_names) > 1:
            parts.append(f"{name} {_number(logs[key])}")
    if "loss" in logs:
        parts.append(f"loss {float(logs['loss']):.4g}")
    if "rollout/staleness_max" in logs:  # rollouts on Ray workers: how many steps old the trained samples were
        parts.append(f"stale {_number(logs['rollout/staleness_max'], 0)}")
    return " | ".join(parts)


def evaluation_table(logs: Mapping[str, Any], reward_names: Sequence[str], step: int) -> str:
    """A short table of an evaluation log (keys ``eval_reward``, ``eval_rewards/<name>/{mean,std,count,change,
    change_se}``)."""
    head = f"evaluation at step {step}"
    if "eval_reward" in logs:
        head += f": reward {_number(logs['eval_reward'])} ± {_number(logs.get('eval_reward_std'))}"
    rows = [("reward", "mean", "std", "images", "change since first")]
    for name in reward_names:
        prefix = f"eval_rewards/{name}/"
        if prefix + "mean" not in logs:
            continue
        change = ""
        if prefix + "change" in logs:
            change = f"{float(logs[prefix + 'change']):+.3f} ± {_number(logs.get(prefix + 'change_se'))}"
        count = logs.get(prefix + "count")
        rows.append((name, _number(logs[prefix + "mean"]), _number(logs.get(prefix + "std")),
                     "" if count is None else str(int(count)), change))
    if len(rows) == 1:
        return head
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def full_dictionary(logs: Mapping[str, Any]) -> str:
    """A logged dictionary as transformers prints it (floats to 4 significant digits), without ``total_flos``."""
    return str({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"})


class RolloutProgress:
    """What a rollout updates while it samples: the training bar's description shows ``rollout NN%``."""

    def __init__(self, console: TrainingConsole | None, total: int):
        self.console = console
        self.total = max(1, int(total))
        self.done = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.console is not None:
            self.console.set_phase(f"rollout {min(100, 100 * self.done // self.total)}%")

    def close(self) -> None:
        if self.console is not None:
            self.console.set_phase(None)


class TrainingConsole(TrainerCallback):
    """The run's terminal output (see the module docstring); only the main process prints.

    Args:
        reward_names: the rewards, in the order of the reward set.
        show_bar: a tqdm bar (else one line per logging step).
        print_full_logs: also print every logged dictionary.
    """

    def __init__(self, reward_names: Sequence[str], show_bar: bool = True, print_full_logs: bool = False):
        self.reward_names = list(reward_names)
        self.show_bar = show_bar
        self.print_full_logs = print_full_logs
        self.bar = None
        self._step_times: list[float] = []
        self._last_step_end: float | None = None
        self._max_steps = 0

    # ---- what the trainer calls --------------------------------------------------------------------------------
    def rollout_progress(self, total: int) -> RolloutProgress:
        return RolloutProgress(self if self.bar is not None else None, total)

    def set_phase(self, phase: str | None) -> None:
        if self.bar is not None:
            self.bar.set_description_str(phase or "training", refresh=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    # ---- callback events ---------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._max_steps = state.max_steps
        self._last_step_end = time.perf_counter()
        if state.is_world_process_zero and self.show_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="training", unit="step",
                            dynamic_ncols=True, bar_format=BAR_FORMAT)

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._last_step_end is not None:
            self._step_times.append(now - self._last_step_end)
        self._last_step_end = now
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.print_full_logs:
            self.write(full_dictionary(logs))
        if any(key.startswith("eval_") for key in logs):
            self.write(evaluation_table(logs, self.reward_names, state.global_step))
            return
        figures = train_figures(logs, self.reward_names)
        if not figures:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=True)
        elif not self.print_full_logs:
            seconds = sum(self._step_times) / len(self._step_times) if self._step_times else math.nan
            self._step_times.clear()
            self.write(f"step {state.global_step}/{self._max_steps} | {figures} | {_number(seconds, 2)} s/step")

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def rollout_progress(console: TrainingConsole | None, total: int) -> RolloutProgress:
    """The progress object a rollout updates (shown on the console's bar; silent without a console)."""
    return console.rollout_progress(total) if console is not None else RolloutProgress(None, total)


def terminal_is_interactive() -> bool:
    """Whether standard error (where the bar draws) is a terminal; a file or a pipe gets lines instead."""
    import sys

    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def install_training_console(trainer: Any) -> TrainingConsole | None:
    """Replace transformers' ``ProgressCallback`` / ``PrinterCallback`` of ``trainer`` by a `TrainingConsole`.

    In a notebook, where transformers shows its own HTML progress table, nothing is replaced (returns ``None``)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    names = {type(cb).__name__ for cb in trainer.callback_handler.callbacks}
    if "NotebookProgressCallback" in names:
        return None
    for callback in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    args = trainer.args
    console = TrainingConsole(trainer.reward_set.names, show_bar=not args.disable_tqdm and terminal_is_interactive(),
                              print_full_logs=bool(getattr(args, "print_full_logs", False)))
    trainer.add_callback(console)
    return console


__all__ = ["BAR_FORMAT", "MAX_REWARDS_SHOWN", "RolloutProgress", "TrainingConsole", "evaluation_table",
           "full_dictionary", "install_training_console", "rollout_progress", "terminal_is_interactive",
           "train_figures"]
