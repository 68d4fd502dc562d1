"""Pictures in and out of a rollout: decoded pixels as PIL images (or frame lists), and a dataset's ``image`` column
read as RGB PIL images."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..data.condition_images import load_condition_image

__all__ = ["load_images", "to_pil"]


def to_pil(images: torch.Tensor) -> list:
    """Decoded pixels in [0, 1] as PIL: ``(B, 3, H, W)`` -> B images, ``(B, F, 3, H, W)`` -> B lists of F frames."""
    from PIL import Image

    if images.dim() == 5:
        return [to_pil(video) for video in images]
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


def load_images(values: list) -> list:
    """The ``image`` column's values as RGB PIL images, or lists of them for rows holding several (each distinct path
    read once)."""
    loaded: dict[str, Any] = {}

    def load(value):
        if isinstance(value, (list, tuple)):
            return [load(v) for v in value]
        if isinstance(value, (str, os.PathLike)):
            key = os.fspath(value)
            if key not in loaded:
                loaded[key] = load_condition_image(value)
            return loaded[key]
        return load_condition_image(value)

    return [load(value) for value in values]
