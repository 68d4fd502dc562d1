"""The source images of editing rewards: the dataset's ``image`` column, one source per edited sample.

Editing datasets carry the image to edit in their ``image`` column; the trainer loads it as a PIL image (a list of
them for rows with several sources, as Qwen-Image-Edit-Plus takes) and passes the column to every reward with the
other columns. An editing reward compares each edited image with its source, so it cannot score a batch without that
column: `source_images` refuses such a batch before any model runs, naming the column and how to provide it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from .vlm_models import as_rgb

__all__ = ["SOURCE_IMAGE_COLUMN", "source_images"]

#: the dataset column holding the image each sample edits
SOURCE_IMAGE_COLUMN = "image"


def _first_image(value: Any, index: int, reward: str) -> Image.Image:
    """One row's source: the image itself, or the first of a row's several source images."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{reward}: row {index} of the '{SOURCE_IMAGE_COLUMN}' column is an empty list; each "
                             f"edited sample needs its source image")
        value = value[0]
    if value is None:
        raise ValueError(f"{reward}: row {index} has no source image (the '{SOURCE_IMAGE_COLUMN}' column is None "
                         f"there); every edited sample needs the image it was edited from")
    try:
        return as_rgb(value)
    except TypeError:
        raise TypeError(f"{reward}: row {index} of the '{SOURCE_IMAGE_COLUMN}' column is a {type(value).__name__}, "
                        f"not an image; the trainer loads the column's paths as PIL images, and a direct call "
                        f"must pass PIL images (or HxWxC uint8 arrays)") from None


def source_images(columns: Mapping[str, Sequence[Any]], n: int, reward: str) -> list[Image.Image]:
    """The ``n`` source images of a batch, RGB, from ``columns["image"]`` (the first image of rows holding several).

    Raises:
        ValueError: the column is missing, has another length, or a row has no image; the message says how to
            provide it (an editing dataset with an ``image`` column, or ``image=[...]`` in a direct call).
    """
    values = columns.get(SOURCE_IMAGE_COLUMN)
    if values is None:
        present = sorted(k for k in columns if k != SOURCE_IMAGE_COLUMN)
        raise ValueError(
            f"{reward} scores an edit against its source image, but the batch has no '{SOURCE_IMAGE_COLUMN}' column "
            f"(columns: {present or 'none'}). Train an editing family on a dataset whose rows have an "
            f"'{SOURCE_IMAGE_COLUMN}' (the image to edit), call the reward as reward(prompts, edited_images, "
            f"image=source_images), or, behind a reward server, use a client that sends image columns "
            f"(flowgrpo's remote reward does)."
        )
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{reward}: the '{SOURCE_IMAGE_COLUMN}' column has {len(values)} source images for {n} "
                         f"edited images")
    return [_first_image(value, i, reward) for i, value in enumerate(values)]
