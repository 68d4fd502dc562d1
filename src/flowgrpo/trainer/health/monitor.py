"""HealthMonitor: the run-long state of the diagnostics, alarms and guards, saved in every checkpoint.

It holds the hacking and diversity alarms (`alarms.py`), GARDO's gate fraction and reset schedule (`gardo.py`),
the reward constraints' multipliers (`constraints.py`) and the dynamic-sampling totals, and writes them to
``health_state.json`` in each checkpoint so that a resumed run continues with the same best values, baselines,
schedules and multipliers. It also picks the image feature of the diversity metric: the CLIP embedding of a loaded
CLIP-family reward, else 32x32 grey pixels.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from .alarms import DiversityAlarm, HackingAlarm
from .constraints import RewardConstraints
from .gardo import GateFraction, ReferenceResetSchedule
from .metrics import grey_features

__all__ = ["HEALTH_STATE_NAME", "HealthMonitor", "clip_feature_source"]

HEALTH_STATE_NAME = "health_state.json"


def clip_feature_source(reward_funcs: Sequence[Any]) -> Any | None:
    """The first loaded reward that embeds images with CLIP (``image_embeddings``), or None."""
    for func in reward_funcs:
        target = getattr(func, "func", func)
        if callable(getattr(target, "image_embeddings", None)):
            return target
    return None


class HealthMonitor:
    def __init__(self, args: Any, reward_funcs: Sequence[Any] = ()):
        self.hacking = HackingAlarm(args.hacking_tolerance)
        self.diversity = DiversityAlarm(args.diversity_collapse_ratio)
        self.gate_fraction = GateFraction()
        self.reset_schedule = ReferenceResetSchedule(args.gardo_kl_threshold, args.gardo_reset_steps)
        self.dropped_groups_total = 0
        self.hacking_alarm_on = False
        #: the reward constraints' multipliers and start values (None without ``reward_constraints``)
        self.constraints = RewardConstraints.from_args(args)
        self._clip = clip_feature_source(reward_funcs)

    # ---- features --------------------------------------------------------------------------------------------
    @property
    def feature_name(self) -> str:
        return "clip" if self._clip is not None else "grey32"

    def image_features(self, images: Sequence[Any]) -> torch.Tensor:
        """(n, d) float32 features of ``images`` (PIL images, or frame lists: first frame)."""
        if self._clip is not None:
            firsts = [im[0] if isinstance(im, (list, tuple)) else im for im in images]
            with torch.inference_mode():
                return self._clip.image_embeddings(firsts).float().cpu()
        return grey_features(images)

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"hacking": self.hacking.state_dict(), "diversity": self.diversity.state_dict(),
                 "gardo_gate_fraction": self.gate_fraction.state_dict(),
                 "gardo_reset_schedule": self.reset_schedule.state_dict(),
                 "dropped_groups_total": self.dropped_groups_total, "hacking_alarm_on": self.hacking_alarm_on}
        if self.constraints is not None:
            state["reward_constraints"] = self.constraints.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.hacking.load_state_dict(state.get("hacking", {}))
        self.diversity.load_state_dict(state.get("diversity", {}))
        self.gate_fraction.load_state_dict(state.get("gardo_gate_fraction", {}))
        self.reset_schedule.load_state_dict(state.get("gardo_reset_schedule", {}))
        self.dropped_groups_total = int(state.get("dropped_groups_total", 0))
        self.hacking_alarm_on = bool(state.get("hacking_alarm_on", False))
        if self.constraints is not None:
            self.constraints.load_state_dict(state.get("reward_constraints", {}))

    def save(self, folder: str | os.PathLike) -> None:
        with open(os.path.join(folder, HEALTH_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)

    def load(self, folder: str | os.PathLike) -> bool:
        path = os.path.join(folder, HEALTH_STATE_NAME)
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))
        return True
