"""Sound for the rewards that score it (``accepts_audio``): which rewards ask, whether the family makes any, and the
decoded ``audio`` / ``audio_sampling_rate`` columns.

Only LTX-2 generates sound. Its audio latents are decoded (audio VAE, then vocoder) only when a training or gold
reward asks for them, so a run whose rewards score pictures alone pays nothing for the sound.
"""

from __future__ import annotations

from typing import Any

import torch

from ...rewards.composition import AUDIO_COLUMNS
from .sliced_decode import decode_in_slices

__all__ = ["audio_reward_names", "check_audio_rewards", "audio_columns"]


def audio_reward_names(*reward_sets: Any) -> list[str]:
    """The rewards of ``reward_sets`` (``None`` skipped) that score sound."""
    return [name for rs in reward_sets if rs is not None for name in rs.audio_rewards]


def check_audio_rewards(adapter_cls: type, names: list[str]) -> None:
    """Refuse rewards that score sound on a family that generates none (before anything is loaded)."""
    if names and not getattr(adapter_cls, "makes_audio", False):
        raise ValueError(f"the reward(s) {names} score sound (accepts_audio), but {adapter_cls.__name__} generates "
                         "none; only LTX-2 does. Use them with an LTX-2 pipeline, or drop them from reward_funcs / "
                         "eval_reward_funcs.")


def audio_columns(adapter: Any, latents: torch.Tensor, height: int, width: int, batch_size: int | None
                  ) -> dict[str, list]:
    """``{"audio": [(channels, samples) float32 arrays], "audio_sampling_rate": [rate, ...]}`` for the samples of
    ``latents`` (decoded ``batch_size`` at a time, like the pictures)."""
    waveforms = decode_in_slices(adapter.decode_audio, latents, height, width, batch_size)
    rate = adapter.audio_sampling_rate()
    audio_key, rate_key = AUDIO_COLUMNS
    return {audio_key: [w.detach().float().cpu().numpy() for w in waveforms], rate_key: [rate] * len(waveforms)}
