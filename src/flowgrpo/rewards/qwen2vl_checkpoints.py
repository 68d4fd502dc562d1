"""Qwen2-VL / Qwen2.5-VL reward checkpoints (HPSv3, EditReward, VideoAlign's VideoReward): their keys in the layout of
today's transformers (:func:`convert_qwen2vl_keys`) and their strict load into the model built for them
(:func:`load_exact_state`).

HPSv3, EditReward and VideoAlign's VideoReward are Qwen2(.5)-VL backbones with reward heads, saved with transformers
4.45-4.51, whose ``Qwen2VLForConditionalGeneration`` kept the language model under ``model.*`` and the vision tower
under ``visual.*``. From transformers 4.52 both sit inside ``Qwen2VLModel`` / ``Qwen2_5_VLModel``:
``model.language_model.*`` and ``model.visual.*``. The rewards here build that model (without the language-model
head) plus their heads, so a checkpoint loads after::

    model.<x>                               -> model.language_model.<x>
    visual.<x>                              -> model.visual.<x>
    model.language_model.*, model.visual.*  kept (already in today's layout)
    <head>.*                                kept (the reward's own heads: rm_head.*, rm_heads.*)
    lm_head.weight                          dropped (scoring never uses the language-model head)

The model is then built from the base model's config with empty weights and takes the converted tensors as they are:
every key it has must be in the checkpoint and every key of the checkpoint in it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["convert_qwen2vl_keys", "load_exact_state"]


def convert_qwen2vl_keys(state: Mapping[str, Any], heads: Sequence[str], *, checkpoint: str,
                         expected: str) -> dict[str, Any]:
    """``state`` with its keys in today's Qwen2-VL layout (see the module docstring), values unchanged.

    Args:
        state: the checkpoint's tensors by key.
        heads: the key prefixes of the reward's heads, kept as they are (e.g. ``("rm_head.",)``).
        checkpoint: what the checkpoint should be, for the error (``"an HPSv3"``).
        expected: the keys it should hold, for the error (``"model.*, visual.*, rm_head.* and lm_head.weight"``).

    Raises:
        ValueError: a key of neither layout nor a head: "not <checkpoint> checkpoint: unexpected keys [...]
            (expected <expected>)", naming up to eight of them.
    """
    kept = ("model.language_model.", "model.visual.", *heads)
    converted: dict[str, Any] = {}
    unknown = []
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        if key.startswith(kept):
            new = key
        elif key.startswith("visual."):
            new = "model." + key
        elif key.startswith("model."):
            new = "model.language_model." + key[len("model."):]
        else:
            unknown.append(key)
            continue
        converted[new] = value
    if unknown:
        raise ValueError(f"not {checkpoint} checkpoint: unexpected keys {sorted(unknown)[:8]} (expected {expected})")
    return converted


def load_exact_state(model: Any, state: Mapping[str, Any], *, checkpoint: str, base_model: str) -> None:
    """Load ``state`` into ``model`` (built with empty weights) strictly, taking its tensors (``assign=True``).

    Raises:
        ValueError: the keys differ: "<checkpoint> does not fit the model built from <base_model>: missing [...],
            unexpected [...]" (up to eight of each).
    """
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not fit the model built from {base_model!r}: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    model.load_state_dict(state, strict=True, assign=True)
