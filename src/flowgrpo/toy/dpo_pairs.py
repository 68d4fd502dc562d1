"""Preference pairs on the toy world, for offline Diffusion-DPO (``recipes/toy_dpo.yaml``).

For each training prompt of a toy world, the pretrained pipeline draws ``images_per_prompt`` images (seeded, CFG as
the world's own generation settings); the toy rewards of the recipes score them (``toy_shape_score`` + 0.5
``toy_color`` by default), and the best and the worst image become the pair's ``chosen`` and ``rejected``. Prompts
whose images all score the same give no pair. Written as ``train.jsonl`` (``prompt``, ``chosen``, ``rejected``: image
paths relative to the file, read back by the launch script's prompt-file reader) with the PNGs in ``images/`` and a
``pairs.json`` summary (settings, pair count, the mean score of the chosen and rejected images).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PAIRS_FILE", "make_toy_dpo_pairs"]

PAIRS_FILE = "train.jsonl"


def make_toy_dpo_pairs(world_dir: str | os.PathLike, output_dir: str | os.PathLike, images_per_prompt: int = 8,
                       rewards: Sequence[str] = ("toy_shape_score", "toy_color"),
                       reward_weights: Sequence[float] = (1.0, 0.5), seed: int = 0, max_prompts: int | None = None,
                       num_inference_steps: int | None = None, batch_size: int = 64) -> Path:
    """Write the pairs of the toy world at ``world_dir`` into ``output_dir`` (see the module docstring); returns the
    path of ``train.jsonl``."""
    from diffusers import StableDiffusion3Pipeline

    from ..rewards import resolve_reward_funcs
    from .build import quiet_toy_truncation_warnings, read_prompts
    from .learning import read_world_metadata

    if images_per_prompt < 2:
        raise ValueError(f"images_per_prompt={images_per_prompt}: a pair needs at least 2 images per prompt.")
    world_dir, output = Path(world_dir), Path(output_dir)
    settings = read_world_metadata(world_dir)["generation"]
    quiet_toy_truncation_warnings(settings["max_sequence_length"])
    steps = num_inference_steps or settings["num_inference_steps"]
    prompts = read_prompts(world_dir, "train")[:max_prompts]
    pipe = StableDiffusion3Pipeline.from_pretrained(str(world_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    score = resolve_reward_funcs(list(rewards), list(reward_weights))
    (output / "images").mkdir(parents=True, exist_ok=True)
    jobs = [(p, k) for p in range(len(prompts)) for k in range(images_per_prompt)]
    images, totals = {}, {}
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start:start + batch_size]
        texts = [prompts[p] for p, _ in chunk]
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + p * 1009 + k) for p, k in chunk]
        with torch.no_grad():
            out = pipe(prompt=texts, num_inference_steps=steps, guidance_scale=settings["guidance_scale"],
                       height=settings["resolution"], width=settings["resolution"], generator=gens,
                       max_sequence_length=settings["max_sequence_length"], output_type="pil").images
        result = score(texts, out)
        for (p, k), image, total in zip(chunk, out, result.total):
            images[p, k], totals[p, k] = image, float(total)
    rows, chosen_scores, rejected_scores = [], [], []
    for p, prompt in enumerate(prompts):
        scores = [totals[p, k] for k in range(images_per_prompt)]
        best, worst = max(range(len(scores)), key=scores.__getitem__), min(range(len(scores)), key=scores.__getitem__)
        if scores[best] <= scores[worst]:
            continue
        names = {}
        for role, k in (("chosen", best), ("rejected", worst)):
            names[role] = f"images/{p:04d}_{role}.png"
            images[p, k].save(output / names[role])
        rows.append({"prompt": prompt, **names})
        chosen_scores.append(scores[best])
        rejected_scores.append(scores[worst])
    path = output / PAIRS_FILE
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    summary = {"world": str(world_dir), "pairs": len(rows), "prompts": len(prompts),
               "images_per_prompt": images_per_prompt, "rewards": list(rewards), "reward_weights": list(reward_weights),
               "seed": seed, "num_inference_steps": steps,
               "chosen_score_mean": sum(chosen_scores) / max(1, len(chosen_scores)),
               "rejected_score_mean": sum(rejected_scores) / max(1, len(rejected_scores))}
    (output / "pairs.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path
