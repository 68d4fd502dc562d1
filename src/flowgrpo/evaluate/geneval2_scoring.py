"""GenEval 2 scoring of an image folder: Soft-TIFA per image, the benchmark's numbers, and GenEval2's own files.

Each image gets a record with its prompt's ``atom_count`` and ``skills``, its ``score_list`` (the judge's score of
each question of the prompt's ``vqa_list``, `flowgrpo.rewards.geneval2.GenEval2Reward.question_scores`) and its
``soft_tifa_am`` / ``soft_tifa_gm`` (arithmetic / geometric mean of the list). The summary holds what GenEval2's
scripts print, each over the images (one per prompt under the benchmark's protocol, as GenEval2 evaluates):

* ``soft_tifa_am`` and ``soft_tifa_gm``: 100 x the mean of the images' means (``evaluation.py``'s ``Score``);
* ``skills``: per skill (object, attribute, count, position, verb), 100 x the mean score of its questions
  (``soft_tifa_analysis.py``'s per-atom analysis, Soft-TIFA AM);
* ``atomicity``: per ``atom_count``, 100 x the mean geometric mean of its prompts (its per-atomicity analysis,
  Soft-TIFA GM).

Beside ``results.jsonl`` and the summary, the output folder gets GenEval2's file formats: ``geneval2_image_paths.json``
(``{prompt: image path}``, the ``--image_filepath_data`` its ``evaluation.py`` reads; the first sample of each prompt)
and ``geneval2_score_lists.json`` (the ``--output_file`` it writes and ``soft_tifa_analysis.py --score_data``
reads: one score list per prompt, in the benchmark file's order; the first sample's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .layout import PromptFolder

IMAGE_PATHS_FILE = "geneval2_image_paths.json"
SCORE_LISTS_FILE = "geneval2_score_lists.json"
#: GenEval2's skills, in the order its analysis prints them.
SKILLS = ("object", "attribute", "count", "position", "verb")


def score_folders_with_geneval2(folders: Sequence[PromptFolder], options: Mapping[str, Any], device: Any,
                                progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """One record per sample of ``folders`` (folder and sample order); ``options`` are the ``geneval2`` reward's
    arguments (its ``aggregation`` plays no part: both means are recorded); the judge runs on ``device`` unless
    ``options`` names a ``reward_device``."""
    from PIL import Image

    from ..rewards.geneval2 import GenEval2Reward, soft_tifa_mean

    options = {k: v for k, v in options.items() if k != "aggregation"}
    options.setdefault("reward_device", str(device))
    scorer = GenEval2Reward(**options)
    jobs = [(folder, path) for folder in folders for path in folder.samples]
    step = max(1, int(options.get("batch_size", 8)))
    records: list[dict[str, Any]] = []
    for start in range(0, len(jobs), step):
        chunk = jobs[start:start + step]
        images = [Image.open(path).convert("RGB") for _, path in chunk]
        lists = scorer.question_scores(images, [folder.metadata["vqa_list"] for folder, _ in chunk])
        for (folder, path), scores in zip(chunk, lists):
            records.append({"filename": str(path), "index": folder.index, "sample": int(path.stem),
                            "prompt": folder.metadata["prompt"], "atom_count": folder.metadata.get("atom_count"),
                            "skills": folder.metadata.get("skills"), "score_list": scores,
                            "soft_tifa_am": soft_tifa_mean(scores, "arithmetic"),
                            "soft_tifa_gm": soft_tifa_mean(scores, "geometric")})
        if progress is not None:
            progress(len(chunk))
    return records


def summarize_geneval2_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"images", "prompts", "soft_tifa_am", "soft_tifa_gm", "skills", "atomicity"}`` (module docstring)."""
    if not records:
        raise ValueError("no GenEval2 records to summarise")
    n = len(records)
    skill_sums: dict[str, list[float]] = {}
    for record in records:
        for skill, score in zip(record.get("skills") or [], record["score_list"]):
            skill_sums.setdefault(skill, []).append(score)
    atomicity: dict[int, list[float]] = {}
    for record in records:
        if record.get("atom_count") is not None:
            atomicity.setdefault(int(record["atom_count"]), []).append(record["soft_tifa_gm"])
    skills = {s: 100 * sum(skill_sums[s]) / len(skill_sums[s]) for s in SKILLS if s in skill_sums}
    skills.update({s: 100 * sum(v) / len(v) for s, v in skill_sums.items() if s not in SKILLS})
    return {"images": n, "prompts": len({r["index"] for r in records}),
            "soft_tifa_am": 100 * sum(r["soft_tifa_am"] for r in records) / n,
            "soft_tifa_gm": 100 * sum(r["soft_tifa_gm"] for r in records) / n,
            "skills": skills,
            "atomicity": {k: 100 * sum(v) / len(v) for k, v in sorted(atomicity.items())}}


def geneval2_summary_markdown(summary: Mapping[str, Any]) -> str:
    """The two Soft-TIFA numbers, the per-skill table (AM) and the per-atomicity table (GM)."""
    lines = ["# GenEval 2", "", f"{summary['images']} images of {summary['prompts']} prompts.", "",
             "| Soft-TIFA AM | Soft-TIFA GM |", "| :---: | :---: |",
             f"| **{summary['soft_tifa_am']:.2f}** | **{summary['soft_tifa_gm']:.2f}** |", ""]
    if summary["skills"]:
        names = list(summary["skills"])
        lines += ["Per skill (Soft-TIFA AM):", "", "| " + " | ".join(n.capitalize() for n in names) + " |",
                  "|" + " :---: |" * len(names),
                  "| " + " | ".join(f"{summary['skills'][n]:.2f}" for n in names) + " |", ""]
    if summary["atomicity"]:
        counts = list(summary["atomicity"])
        lines += ["Per atomicity (Soft-TIFA GM):", "", "| " + " | ".join(str(c) for c in counts) + " |",
                  "|" + " :---: |" * len(counts),
                  "| " + " | ".join(f"{summary['atomicity'][c]:.2f}" for c in counts) + " |", ""]
    return "\n".join(lines)


def write_official_files(output: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """``geneval2_image_paths.json`` and ``geneval2_score_lists.json`` (module docstring), from each prompt's first
    sample, prompts in index order."""
    from . import layout

    first: dict[int, Mapping[str, Any]] = {}
    for record in records:
        if record["index"] not in first or record["sample"] < first[record["index"]]["sample"]:
            first[record["index"]] = record
    ordered = [first[i] for i in sorted(first)]
    paths = {r["prompt"]: str(Path(r["filename"]).resolve()) for r in ordered}
    layout.write_text(output / IMAGE_PATHS_FILE, json.dumps(paths, indent=1) + "\n")
    lists = [[float(s) for s in r["score_list"]] for r in ordered]
    if not all(math.isfinite(s) for scores in lists for s in scores):
        raise ValueError("a GenEval2 score is not finite")
    layout.write_text(output / SCORE_LISTS_FILE, json.dumps(lists) + "\n")


__all__ = ["IMAGE_PATHS_FILE", "SCORE_LISTS_FILE", "SKILLS", "geneval2_summary_markdown",
           "score_folders_with_geneval2", "summarize_geneval2_records", "write_official_files"]
