"""GenEval scoring of an image folder: the ``geneval`` scorer's official records, and the summary table.

Each image gets the record GenEval's ``evaluation/evaluate_images.py`` writes (``filename``, ``tag``, ``prompt``,
``correct``, ``reason``, ``metadata``, ``details``), from `flowgrpo.rewards.geneval.GenEvalReward.score_images`
(a transformers Mask2Former and CLIP ViT-L/14 instead of mmdet; see that module and docs/rewards.md). The summary is
that of GenEval's ``evaluation/summary_scores.py`` (`flowgrpo.rewards.geneval.summarize_geneval`): the accuracy of
each task (the fraction of its images judged correct), and the overall score, the mean of the task accuracies (of
the six tasks single_object, two_object, counting, colors, position, color_attr on the full prompt set).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .layout import PromptFolder

#: Column titles of GenEval's results table, in the order of its README.
TASK_TITLES = {"single_object": "Single object", "two_object": "Two object", "counting": "Counting",
               "colors": "Colors", "position": "Position", "color_attr": "Color attribution"}


def score_folders_with_geneval(folders: Sequence[PromptFolder], options: Mapping[str, Any], device: Any,
                               progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Official ``results.jsonl`` records of every sample of ``folders`` (folder and sample order).

    ``options`` are the ``geneval`` reward's arguments (``detector``, ``clip_model``, ``dtype``, ``batch_size``,
    ...); the models run on ``device`` unless ``options`` names a ``reward_device``.
    """
    from ..rewards.geneval import GenEvalReward

    options = dict(options)
    options.setdefault("reward_device", str(device))
    scorer = GenEvalReward(**options)
    jobs = [(folder, path) for folder in folders for path in folder.samples]
    step = max(1, int(options.get("batch_size", 8)))
    records: list[dict[str, Any]] = []
    for start in range(0, len(jobs), step):
        chunk = jobs[start:start + step]
        records += scorer.score_images([path for _, path in chunk], [folder.metadata for folder, _ in chunk],
                                       filenames=[str(path) for _, path in chunk])
        if progress is not None:
            progress(len(chunk))
    return records


def summarize_geneval_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``summary_scores.py``'s numbers (`summarize_geneval`) plus ``accuracy``: ``{task: accuracy, ...,
    "overall": mean of the task accuracies}``, and ``images`` / ``prompts`` counts."""
    from ..rewards.geneval import summarize_geneval

    summary = summarize_geneval(records)
    accuracy = {tag: summary["tasks"][tag]["accuracy"] for tag in _ordered_tags(summary["tasks"])}
    accuracy["overall"] = summary["overall"]
    return {"images": summary["total_images"], "prompts": summary["total_prompts"], "accuracy": accuracy, **summary}


def geneval_summary_markdown(summary: Mapping[str, Any]) -> str:
    """The table papers print (overall, then each task, as GenEval's README lays it out), and the text of
    ``summary_scores.py``."""
    from ..rewards.geneval import format_geneval_summary

    tags = _ordered_tags(summary["tasks"])
    titles = ["Overall"] + [TASK_TITLES.get(tag, tag) for tag in tags]
    values = [f"**{summary['overall']:.2f}**"] + [f"{summary['tasks'][tag]['accuracy']:.2f}" for tag in tags]
    lines = ["# GenEval", "", "| " + " | ".join(titles) + " |", "|" + " :---: |" * len(titles),
             "| " + " | ".join(values) + " |", "", "```", format_geneval_summary(summary), "```", ""]
    missing = [tag for tag in TASK_TITLES if tag not in summary["tasks"]]
    if missing:
        lines.insert(2, f"Tasks without images here: {', '.join(missing)}; overall is the mean of the tasks "
                        "present.\n")
    return "\n".join(lines)


def _ordered_tags(tasks: Mapping[str, Any]) -> list[str]:
    """GenEval's six tasks in their usual order, then any other tag in order of appearance."""
    return [t for t in TASK_TITLES if t in tasks] + [t for t in tasks if t not in TASK_TITLES]


__all__ = ["TASK_TITLES", "geneval_summary_markdown", "score_folders_with_geneval", "summarize_geneval_records"]
