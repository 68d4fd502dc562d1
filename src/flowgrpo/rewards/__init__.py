"""Rewards: a registry of reward functions, the built-in rewards, and their weighted composition.

A reward is called as ``fn(prompts, images, **columns) -> list[float | None]`` (see `registry`).
The rewards are plugins of the ``flowgrpo.rewards`` entry points (the built-in rewards, the toy world's and
third-party ones): importing this package imports none of their modules; a reward's module is imported when the
reward is first asked for (`get_reward`, `resolve_reward_funcs`) or the rewards are listed (`list_rewards`), and its
heavy dependencies (OCR engines, CLIP models) when it is first called.
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
from .registry import get_reward, has_reward, list_rewards, register_reward

__all__ = [
    "register_reward",
    "get_reward",
    "has_reward",
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
