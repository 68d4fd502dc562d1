"""Rewards: a registry of reward functions, the built-in rewards, and their weighted composition.

A reward is called as ``fn(prompts, images, **columns) -> list[float | None]`` (see `registry`).
Importing this package registers the built-in rewards without loading their heavy dependencies (OCR
engines, CLIP models); those load when a reward is first called.
"""

from __future__ import annotations

import importlib
import importlib.util

from .composition import (
    AUDIO_COLUMNS,
    RewardOutput,
    RewardResult,
    RewardSet,
    accepts_audio,
    accepts_video,
    resolve_reward_funcs,
    reward_statistics,
)
from .failures import RewardFailedError
from .registry import get_reward, list_rewards, register_reward

__all__ = [
    "register_reward",
    "get_reward",
    "list_rewards",
    "resolve_reward_funcs",
    "RewardSet",
    "RewardResult",
    "RewardOutput",
    "reward_statistics",
    "RewardFailedError",
    "accepts_video",
    "accepts_audio",
    "AUDIO_COLUMNS",
]

# Modules whose import registers built-in rewards. Each must keep heavy imports inside functions.
BUILTIN_REWARD_MODULES = ("ocr", "jpeg", "clip_scorers", "remote", "vlm_judge", "geneval", "imagereward", "hpsv2",
                          "hpsv3", "unifiedreward", "vqascore", "deqa", "videoalign", "geneval2")

for _module in BUILTIN_REWARD_MODULES:
    if importlib.util.find_spec(f"{__name__}.{_module}") is not None:
        importlib.import_module(f"{__name__}.{_module}")
del _module

# The toy world's rewards (toy_color, toy_shape, toy_position, toy_count, toy_geneval, toy_shape_score) live
# with the world in flowgrpo.toy (numpy + PIL only) and register here too, so `get_reward("toy_shape")` needs no
# extra import.
importlib.import_module("flowgrpo.toy.rewards")
# The deliberately hackable toy_area (for the reward-hacking demonstration, docs/learning_health.md).
importlib.import_module("flowgrpo.toy.hackable")
