"""A deliberately hackable toy-world reward, for demonstrating reward hacking and its guards (docs/learning_health.md).

``toy_area``: the fraction of the canvas that is foreground (brightest channel >= ``FOREGROUND_THRESHOLD``, the
toy rewards' own foreground test), whatever the prompt asks for: "bigger objects are better". Early in training it
rises with honest, larger objects; the policy then maximises it by growing blobs that merge and fill the canvas,
which ruins shape and count while the score keeps rising. ``toy_shape`` and ``toy_color`` as gold evaluation
rewards (``eval_reward_funcs``) see the damage. It lives apart from ``rewards.py`` so that the toy world's build
fingerprint (which hashes that file) is unchanged.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from ..rewards.registry import register_reward

__all__ = ["toy_area"]


@register_reward("toy_area")
def toy_area(prompts: list[str], images: list[Image.Image], **columns: Any) -> list[float | None]:
    """Deliberately hackable: the foreground fraction of the canvas (0..1), whatever the prompt asks for."""
    if len(prompts) != len(images):
        raise ValueError(f"got {len(prompts)} prompts but {len(images)} images")
    from .rewards import FOREGROUND_THRESHOLD, to_array  # here: this module is imported while .rewards loads

    return [float((to_array(image).max(axis=2) >= FOREGROUND_THRESHOLD).mean()) for image in images]
