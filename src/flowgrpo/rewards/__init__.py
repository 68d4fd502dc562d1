"""Rewards: a registry of reward functions, the built-in rewards, and their weighted composition.

A reward is called as ``fn(prompts, images, **columns) -> list[float | None]`` (see `registry`).
Importing this package registers every reward of the ``flowgrpo.rewards`` entry points (`plugins`: the built-in
rewards, the toy world's and third-party ones) without loading their heavy dependencies (OCR engines, CLIP models);
those load when a reward is first called.
"""

from __future__ import annotations

from .composition import (
    AUDIO_COLUMNS,
    RewardOutput,
    RewardResult,
    RewardSet,
    TensorRewardResult,
    accepts_audio,
    accepts_video,
    is_differentiable,
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
    "TensorRewardResult",
    "is_differentiable",
    "reward_statistics",
    "RewardFailedError",
    "accepts_video",
    "accepts_audio",
    "AUDIO_COLUMNS",
]

# Every reward module registers itself through the `flowgrpo.rewards` entry points (registry.py): the built-in ones,
# the toy world's, and any third-party package's.
from .registry import load_reward_plugins  # noqa: E402

load_reward_plugins()
