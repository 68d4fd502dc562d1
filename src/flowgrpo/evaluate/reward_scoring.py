"""Scoring with the project's rewards (the ocr, pickscore and toy benchmarks): one record per image, and a summary.

Each image record (a line of ``results.jsonl``) holds ``filename``, ``index`` (the prompt's folder), ``sample``,
``prompt`` and one field per reward with that image's score (``null`` when the reward could not score it, e.g. a
toy prompt that names no colour for ``toy_color``). Every reward receives the prompt's other metadata columns, as in
training (e.g. OCR's ``ocr_text``).

The summary gives, per reward, the mean over the images it scored, their standard deviation (population), their
count and the standard error of the mean, std / sqrt(count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .layout import PromptFolder


def build_reward_set(names: Sequence[str], reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """The benchmark's rewards, each weighted 1 (the weights play no part in the per-reward scores)."""
    from ..rewards import resolve_reward_funcs

    kwargs = {name: dict((reward_kwargs or {}).get(name) or {}) for name in names}
    return resolve_reward_funcs(list(names), None, kwargs, num_workers=1)


def score_folders_with_rewards(folders: Sequence[PromptFolder], reward_set: Any, batch_size: int = 16,
                               progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Score every sample of ``folders`` with ``reward_set``; one record per image, in folder and sample order."""
    from PIL import Image

    jobs = [(folder, path) for folder in folders for path in folder.samples]
    records: list[dict[str, Any]] = []
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start:start + batch_size]
        images = [Image.open(path).convert("RGB") for _, path in chunk]
        prompts = [folder.metadata["prompt"] for folder, _ in chunk]
        keys = sorted({k for folder, _ in chunk for k in folder.metadata if k != "prompt"})
        columns = {k: [folder.metadata.get(k) for folder, _ in chunk] for k in keys}
        result = reward_set(prompts, images, **columns)
        for j, (folder, path) in enumerate(chunk):
            record = {"filename": str(path), "index": folder.index, "sample": int(path.stem),
                      "prompt": folder.metadata["prompt"]}
            for name in reward_set.names:
                value = result.per_reward[name][j]
                record[name] = None if value is None or math.isnan(value) else float(value)
            records.append(record)
        if progress is not None:
            progress(len(chunk))
    return records


def summarize_reward_records(records: Sequence[Mapping[str, Any]], reward_names: Sequence[str]) -> dict[str, Any]:
    """``{"images", "prompts", "rewards": {name: {"mean", "std", "count", "stderr"}}}`` over ``records``."""
    summary: dict[str, Any] = {"images": len(records), "prompts": len({r["index"] for r in records}), "rewards": {}}
    for name in reward_names:
        values = [float(r[name]) for r in records if r.get(name) is not None]
        if values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            stats = {"mean": mean, "std": std, "count": len(values), "stderr": std / math.sqrt(len(values))}
        else:
            stats = {"mean": None, "std": None, "count": 0, "stderr": None}
        summary["rewards"][name] = stats
    return summary


def reward_summary_markdown(benchmark: str, summary: Mapping[str, Any]) -> str:
    """The summary as a markdown table (one row per reward)."""
    lines = [f"# {benchmark}", "", f"{summary['images']} images of {summary['prompts']} prompts.", "",
             "| reward | mean | std | stderr | images scored |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, stats in summary["rewards"].items():
        if stats["count"]:
            lines.append(f"| {name} | {stats['mean']:.4f} | {stats['std']:.4f} | {stats['stderr']:.4f} | "
                         f"{stats['count']} |")
        else:
            lines.append(f"| {name} | n/a | n/a | n/a | 0 |")
    return "\n".join(lines) + "\n"


__all__ = ["build_reward_set", "reward_summary_markdown", "score_folders_with_rewards", "summarize_reward_records"]
