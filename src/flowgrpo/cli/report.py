"""Pictures of a finished run, from what the trainer left in ``output_dir``: the reward curve and before/after.

    from flowgrpo.cli.report import summarize_run
    summary = summarize_run("outputs/demo")   # writes reward_curve.png and before_after.png there

* ``reward_curve.png``: the training reward (mean over each generation batch, with a moving average) against the
  optimizer step, and the evaluation reward at each evaluation, from ``trainer_state.json``'s ``log_history``.
* ``before_after.png``: the first and the last evaluation's contact sheets (``eval_step_<N>.png``) side by side.
  Evaluation samples the same prompts from the same seeds every time (ODE sampling), so the two sheets differ only
  by what training changed.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

REWARD_CURVE_FILE = "reward_curve.png"
BEFORE_AFTER_FILE = "before_after.png"
_EVAL_SHEET = re.compile(r"^eval_step_(\d+)\.png$")


def read_log_history(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """``log_history`` of ``output_dir/trainer_state.json`` (or of the newest checkpoint when the run stopped early)."""
    out = Path(output_dir)
    state = out / "trainer_state.json"
    if not state.is_file():
        checkpoints = sorted(out.glob("checkpoint-*/trainer_state.json"),
                             key=lambda p: int(p.parent.name.split("-")[-1]))
        if not checkpoints:
            raise FileNotFoundError(f"No trainer_state.json in {str(out)!r} or its checkpoints: did the run finish?")
        state = checkpoints[-1]
    return list(json.loads(state.read_text(encoding="utf-8")).get("log_history", []))


def reward_series(log_history: list[dict[str, Any]], key: str = "reward") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one logged key, skipping records without it and non-finite values."""
    steps, values = [], []
    for record in log_history:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(int(record.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def plot_reward_curve(log_history: list[dict[str, Any]], path: str | os.PathLike, title: str = "Flow-GRPO") -> Path:
    """Plot the training and evaluation rewards of ``log_history`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards = reward_series(log_history, "reward")
    eval_steps, eval_rewards = reward_series(log_history, "eval_reward")
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if rewards:
        ax.plot(steps, rewards, color="tab:blue", alpha=0.35, lw=1, label="train reward (batch mean)")
        window = max(1, len(rewards) // 10)
        if window > 1:
            smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
                      for i in range(len(rewards))]
            ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"train reward ({window}-step mean)")
    if eval_rewards:
        ax.plot(eval_steps, eval_rewards, "o-", color="tab:orange", lw=2, label="eval reward (fixed seeds, ODE)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if rewards or eval_rewards:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def eval_sheets(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The evaluation contact sheets of a run, ``[(step, path)]`` sorted by step."""
    found = []
    for p in Path(output_dir).iterdir():
        match = _EVAL_SHEET.match(p.name)
        if match:
            found.append((int(match.group(1)), p))
    return sorted(found)


def before_after_sheet(output_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path | None:
    """Put the first and last evaluation sheets side by side; ``None`` when there are fewer than two."""
    from PIL import Image

    from ..trainer.outputs.contact_sheet import side_by_side

    sheets = eval_sheets(output_dir)
    if len(sheets) < 2:
        return None
    (first_step, first), (last_step, last) = sheets[0], sheets[-1]
    with Image.open(first) as a, Image.open(last) as b:
        combined = side_by_side(a.convert("RGB"), b.convert("RGB"),
                                titles=(f"before (step {first_step})", f"after (step {last_step})"))
    path = Path(path) if path is not None else Path(output_dir) / BEFORE_AFTER_FILE
    combined.save(path)
    return path


def summarize_run(output_dir: str | os.PathLike, title: str = "Flow-GRPO") -> dict[str, Any]:
    """Write ``reward_curve.png`` and ``before_after.png`` into ``output_dir``; returns what was found.

    The returned dict holds ``reward_curve`` and ``before_after`` (paths or ``None``), the first and last training
    rewards (``train_reward_first``, ``train_reward_last``: means over the first and last tenth of the steps) and
    the first and last evaluation rewards with their steps (``eval_first``, ``eval_last``: ``(step, reward)``),
    and ``eval_components``: ``{reward name: (first, last)}`` of each reward's evaluation mean
    (``eval_rewards/<name>/mean``), zero-weight monitors included, and ``eval_noise``: ``{reward name: standard
    error of last - first}``: the paired one the trainer logs (``eval_rewards/<name>/change_se``: image by image over
    the same prompts and seeds), else sqrt(std_first^2 / n_first + std_last^2 / n_last) from each evaluation's
    per-image std and count. A change beyond twice it is beyond the evaluation's sampling noise.
    """
    out = Path(output_dir)
    history = read_log_history(out)
    steps, rewards = reward_series(history, "reward")
    eval_steps, eval_rewards = reward_series(history, "eval_reward")
    summary: dict[str, Any] = {
        "reward_curve": str(plot_reward_curve(history, out / REWARD_CURVE_FILE, title=title)),
        "before_after": None, "train_reward_first": None, "train_reward_last": None,
        "eval_first": None, "eval_last": None, "eval_components": {}, "eval_noise": {},
    }
    sheet = before_after_sheet(out)
    summary["before_after"] = str(sheet) if sheet is not None else None
    if rewards:
        k = max(1, len(rewards) // 10)
        summary["train_reward_first"] = sum(rewards[:k]) / k
        summary["train_reward_last"] = sum(rewards[-k:]) / k
    if eval_rewards:
        summary["eval_first"] = (eval_steps[0], eval_rewards[0])
        summary["eval_last"] = (eval_steps[-1], eval_rewards[-1])
    keys = sorted({k for entry in history for k in entry
                   if k.startswith("eval_rewards/") and k.endswith("/mean")})
    for key in keys:
        _, values = reward_series(history, key)
        if len(values) >= 2:
            name = key[len("eval_rewards/"):-len("/mean")]
            summary["eval_components"][name] = (values[0], values[-1])
            noise = _difference_standard_error(history, name)
            if noise is not None:
                summary["eval_noise"][name] = noise
    return summary


def _difference_standard_error(history: list[dict[str, Any]], name: str) -> float | None:
    """Standard error of (last - first) evaluation mean of reward ``name``: the paired one when the last evaluation
    logged it, else from both evaluations' std and count; ``None`` without either."""
    records = [r for r in history if isinstance(r.get(f"eval_rewards/{name}/mean"), (int, float))
               and math.isfinite(r[f"eval_rewards/{name}/mean"])]
    if len(records) < 2:
        return None
    paired = records[-1].get(f"eval_rewards/{name}/change_se")
    if isinstance(paired, (int, float)) and math.isfinite(paired):
        return float(paired)
    variance = 0.0
    for record in (records[0], records[-1]):
        std, count = record.get(f"eval_rewards/{name}/std"), record.get(f"eval_rewards/{name}/count")
        if not isinstance(std, (int, float)) or not isinstance(count, (int, float)) or count < 1:
            return None
        variance += std**2 / count
    return math.sqrt(variance)


__all__ = ["BEFORE_AFTER_FILE", "REWARD_CURVE_FILE", "before_after_sheet", "eval_sheets", "plot_reward_curve",
           "read_log_history", "reward_series", "summarize_run"]
