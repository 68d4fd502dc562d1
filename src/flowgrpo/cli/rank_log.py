"""Per-process training records for debugging distributed runs (``FLOWGRPO_RANK_LOG_DIR``; see ``flowgrpo.cli.train``)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

#: the folder each rank of a launch writes its log to (`RankLogCallback`), when set
RANK_LOG_ENV = "FLOWGRPO_RANK_LOG_DIR"



def _sample_digest(sample: Any) -> str:
    """SHA-1 of a sample's pixels (every frame of a video, in order)."""
    digest = hashlib.sha1()
    for frame in sample if isinstance(sample, (list, tuple)) else [sample]:
        digest.update(frame.tobytes())
    return digest.hexdigest()


class RankLogCallback(TrainerCallback):
    """Appends per-process training records to ``<log_dir>/rank<N>.jsonl`` (see the module docstring)."""

    def __init__(self, trainer: Any, log_dir: str | os.PathLike):
        self.trainer = trainer
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" not in logs:  # evaluation and end-of-training summaries
            return
        trainer = self.trainer
        rank = trainer.accelerator.process_index
        record: dict[str, Any] = {
            "rank": rank, "world_size": trainer.accelerator.num_processes, "step": state.global_step,
            "logs": {k: (float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None)
                     for k, v in logs.items() if isinstance(v, (int, float))},
        }
        samples = trainer.rollouts.last_samples
        if samples:
            images, prompts, rewards = samples
            record["samples"] = [{"prompt": p, "reward": r, "image_sha1": _sample_digest(im)}
                                 for im, p, r in zip(images, prompts, rewards)]
        buffer = trainer.buffer or []
        advantages = [float(a) for batch in buffer for a in batch.get("advantages", []).reshape(-1).tolist()] \
            if buffer else []
        record["local_advantages"] = advantages
        digest = hashlib.sha1()
        model = trainer.accelerator.unwrap_model(trainer.model)
        for name, param in sorted(model.named_parameters()):
            if param.requires_grad:
                digest.update(name.encode())
                digest.update(param.detach().float().cpu().numpy().tobytes())
        record["trainable_sha1"] = digest.hexdigest()
        with open(self.log_dir / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


__all__ = ["RANK_LOG_ENV", "RankLogCallback"]
