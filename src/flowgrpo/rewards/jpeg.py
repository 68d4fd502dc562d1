"""JPEG file size rewards: a cheap, deterministic proxy for image complexity (from the DDPO paper).

Each image is encoded as RGB JPEG at ``quality`` (95 by default) with Pillow, and its size measured in
kilobytes (1 kB = 1000 bytes):

* ``jpeg_compressibility`` = ``-size_kB``: smaller files score higher, so RL makes images simpler
  (flatter colours, less texture). Always negative.
* ``jpeg_incompressibility`` = ``+size_kB``: larger files score higher (more detail and texture).

Scale: a 512x512 photo-like image is typically 30-150 kB at quality 95, a flat colour a few kB; the size
grows roughly with the pixel count, so compare scores only between runs at the same resolution.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .registry import register_reward

__all__ = ["jpeg_size_kb", "jpeg_compressibility", "jpeg_incompressibility"]

DEFAULT_QUALITY = 95


def jpeg_size_kb(image: Any, quality: int = DEFAULT_QUALITY) -> float:
    """Size in kB (1000 bytes) of ``image`` encoded as RGB JPEG at ``quality``."""
    if not isinstance(image, Image.Image):
        import numpy as np

        if not isinstance(image, np.ndarray):
            raise TypeError(f"JPEG rewards need PIL images (or HxWxC uint8 arrays), got {type(image).__name__}")
        image = Image.fromarray(image)
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=int(quality))
    return buffer.tell() / 1000.0


@register_reward("jpeg_compressibility")
def jpeg_compressibility(
    prompts: Sequence[str], images: Sequence[Any], quality: int = DEFAULT_QUALITY, **columns: Any
) -> list[float | None]:
    """``-size_kB`` of each image as JPEG at ``quality``: smaller files score higher (simpler images)."""
    return [-jpeg_size_kb(image, quality) for image in images]


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(
    prompts: Sequence[str], images: Sequence[Any], quality: int = DEFAULT_QUALITY, **columns: Any
) -> list[float | None]:
    """``+size_kB`` of each image as JPEG at ``quality``: larger files score higher (more detailed images)."""
    return [jpeg_size_kb(image, quality) for image in images]
