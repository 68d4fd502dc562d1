"""Source images of editing datasets: the ``image`` column as paths, PIL images or ``datasets.Image`` values.

Editing families (FLUX.1 Kontext, Qwen-Image-Edit) condition every sample on a source image; Qwen-Image-Edit-Plus
and FLUX.2 take several (a list per row). A dataset row holds them in the column :data:`IMAGE_COLUMN`, each as

* a path (``str`` or ``os.PathLike``, read relative to the working directory),
* a ``PIL.Image.Image`` (what a ``datasets.Image`` feature decodes to),
* a ``{"bytes": ..., "path": ...}`` dict (a ``datasets.Image(decode=False)`` value), or
* an ``H x W x 3`` uint8 array.

:func:`load_condition_image` turns any of them into an RGB ``PIL.Image`` (:func:`load_condition_images`: a row's value,
one image or a list); :func:`image_key` identifies an image (or a list of them) by its content, so that a prompt is encoded once per distinct (prompt, image) pair however the rows hold the image.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

from PIL import Image

__all__ = ["IMAGE_COLUMN", "image_key", "load_condition_image", "load_condition_images"]

#: The dataset column holding each sample's source image.
IMAGE_COLUMN = "image"


def load_condition_image(value: Any) -> Image.Image:
    """The source image ``value`` (see the module docstring) as an RGB ``PIL.Image``; a clear error otherwise."""
    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    if isinstance(value, (str, os.PathLike)):
        return _open(value, str(value))
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return _open(io.BytesIO(value["bytes"]), f"the bytes of {value.get('path') or 'an image'}")
        if value.get("path"):
            return _open(value["path"], str(value["path"]))
    if hasattr(value, "shape") and hasattr(value, "dtype") and len(getattr(value, "shape", ())) == 3:
        import numpy as np

        array = np.asarray(value)
        if array.dtype == np.uint8 and array.shape[-1] in (3, 4):
            return Image.fromarray(array).convert("RGB")
    raise TypeError(f"The '{IMAGE_COLUMN}' column holds a {type(value).__name__} ({str(value)[:80]!r}); give a path, a "
                    "PIL image, a datasets.Image feature or an H x W x 3 uint8 array.")


def load_condition_images(value: Any) -> Image.Image | list[Image.Image]:
    """A row's ``image`` value: one source image (see :func:`load_condition_image`), or a list of them (several
    source images of one prompt, kept in order) as a list of RGB ``PIL.Image``."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"A row of the '{IMAGE_COLUMN}' column holds an empty list; give at least one image.")
        return [load_condition_image(v) for v in value]
    return load_condition_image(value)


def _open(source: Any, label: str) -> Image.Image:
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"Source image {label!r} of the '{IMAGE_COLUMN}' column does not exist (relative paths are "
                         f"read from {os.getcwd()}); fix the path or use absolute paths.") from None
    except OSError as err:
        raise ValueError(f"Source image {label!r} of the '{IMAGE_COLUMN}' column cannot be read as an image ({err}).") \
            from None


def image_key(image: Image.Image | list[Image.Image]) -> str:
    """A digest of the image's content (mode, size and pixels); of a list, of every image in order."""
    if isinstance(image, (list, tuple)):
        return hashlib.sha1(("list:" + ",".join(image_key(im) for im in image)).encode()).hexdigest()
    digest = hashlib.sha1(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
