"""Differentiable rewards: the tensor interface, and image preprocessing in torch that gradients pass through.

**The interface.** A reward is differentiable when its callable has ``differentiable = True`` (a function's attribute,
a class attribute or an instance's; also read through ``functools.partial``, see
`flowgrpo.rewards.composition.is_differentiable`). Every caller that scores PIL images (evaluation, the
policy-gradient trainers) calls it as before. A trainer that backpropagates the reward calls it with the decoded images
as one tensor instead::

    scores = fn(prompts, images, **columns)
    # images: float tensor (N, 3, H, W), RGB in [0, 1] (the decoder's output clamped, as the trainer clamps it before
    #         making PIL images), on any device, usually requiring grad
    # scores: float tensor (N,) on the images' device, differentiable with respect to ``images``; NaN where the
    #         reward cannot score an image (the PIL path's None), made without a gradient path (a constant)

The reward's weights stay frozen: the gradient reaches the images only. `flowgrpo.rewards.RewardSet.score_with_grad`
scores a batch with every differentiable reward of a set and weights them as the PIL path weights them.

**PIL path and tensor path.** ``fn(prompts, to_pil(images))`` (8-bit RGB, rounded) and ``fn(prompts, images)`` score
the same pixels. On 8-bit images (``images = uint8 / 255``) the two agree within each reward's stated tolerance
(docs/rewards.md, "Differentiable rewards"): the tensor path has no rounding to 8 bits inside its preprocessing.

**Preprocessing in torch** (differentiable almost everywhere; ``clamp`` has no gradient where it clips):

* `resize_bicubic`: ``torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)``. Its
  filter is PIL's bicubic (Keys, a = -0.5, support widened by the scale when shrinking): on float images the two agree
  to 2.1e-5 (measured on noise, 512 -> 224, 32 -> 224, 300x400 -> 224x298, 64x48 -> 298x224).
* `resize_bicubic_like_pil`: PIL's bicubic resize of 8-bit images as torch operations: PIL resizes the width first,
  rounds and clips to [0, 255], then resizes the height, rounds and clips. The same two passes with a clamp to [0, 1]
  after each give PIL's output up to its two roundings: at most 1.08 / 255 per pixel, 0.3 / 255 on average, where one
  pass without the intermediate clamp differs by up to 26 / 255 on noise (PIL clips the first pass's overshoot).
* `shortest_side_size`, `center_crop`, `normalize`: the sizes, offsets and arithmetic of the image processors.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["center_crop", "check_image_tensor", "check_score_tensor", "is_image_tensor", "normalize", "pil_to_tensor",
           "resize_bicubic", "resize_bicubic_like_pil", "shortest_side_size", "stack_pil"]


def is_image_tensor(images: Any) -> bool:
    """Whether ``images`` is a torch tensor (the differentiable call) rather than a sequence of PIL images."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported: no import here
    return torch is not None and isinstance(images, torch.Tensor)


def check_image_tensor(images: Any, n: int, name: str) -> Any:
    """``images`` checked as the differentiable call's input: a floating tensor ``(n, 3, H, W)``.

    Raises:
        ValueError: another shape, or a count other than ``n`` (the number of prompts).
        TypeError: an integer tensor (8-bit pixels are the PIL path's; divide by 255 first).
    """
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"reward {name!r} scores images as a float tensor (N, 3, H, W) in [0, 1]; got shape "
                         f"{tuple(images.shape)}" + (" (videos are scored through the PIL path, as lists of frames)"
                                                     if images.dim() == 5 else ""))
    if not images.is_floating_point():
        raise TypeError(f"reward {name!r} needs a floating tensor in [0, 1], got {images.dtype}; for 8-bit pixels use "
                        f"images.float() / 255")
    if images.shape[0] != n:
        raise ValueError(f"reward {name!r} got {n} prompts and {images.shape[0]} images; they must be aligned")
    return images


def check_score_tensor(scores: Any, n: int, name: str) -> Any:
    """A differentiable reward's output checked: a floating tensor of ``n`` scores, returned as float32 ``(n,)``."""
    import torch

    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"differentiable reward {name!r} returned a {type(scores).__name__} for a tensor of images; it "
                        f"must return a float tensor (N,) that carries the gradient")
    if scores.dim() != 1 or scores.shape[0] != n or not scores.is_floating_point():
        raise ValueError(f"differentiable reward {name!r} returned a {scores.dtype} tensor of shape "
                         f"{tuple(scores.shape)} for {n} images; it must return a float tensor ({n},)")
    return scores.float()


def pil_to_tensor(image: Any) -> Any:
    """One PIL image (or HxWx3 uint8 array) as a float32 tensor ``(3, H, W)`` in [0, 1]: RGB, ``uint8 / 255``."""
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image (or an HxWxC uint8 array), got {type(image).__name__}")
    array = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    return torch.from_numpy(array).permute(2, 0, 1).float().div(255.0)


def stack_pil(images: Sequence[Any]) -> Any:
    """PIL images of one size as a float32 tensor ``(N, 3, H, W)`` in [0, 1] (`pil_to_tensor` of each).

    Raises:
        ValueError: the images differ in size.
    """
    import torch

    tensors = [pil_to_tensor(image) for image in images]
    sizes = sorted({tuple(t.shape[1:]) for t in tensors})
    if len(sizes) > 1:
        raise ValueError(f"images of several sizes {sizes} cannot form one tensor; score each size separately")
    return torch.stack(tensors)


def shortest_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """``(new_height, new_width)`` with the short side ``size`` and the long side ``int(size * long / short)`` (the
    rule of torchvision's ``Resize(size)`` and of the image processors' ``shortest_edge``)."""
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


def resize_bicubic(images: Any, height: int, width: int) -> Any:
    """Antialiased bicubic resize of a float tensor ``(..., C, H, W)`` to ``(height, width)`` in one pass (no clamp);
    the tensor itself when the size does not change."""
    import torch.nn.functional as F

    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True)


def resize_bicubic_like_pil(images: Any, height: int, width: int) -> Any:
    """PIL's bicubic resize of 8-bit images (``Image.resize(size, BICUBIC)``) as differentiable torch operations on a
    float tensor ``(N, C, H, W)`` in [0, 1]: the width first, clamped to [0, 1], then the height, clamped (module
    docstring). A side that keeps its size is not resampled, as in PIL."""
    out = images
    if out.shape[-1] != width:
        out = resize_bicubic(out, out.shape[-2], width).clamp(0.0, 1.0)
    if out.shape[-2] != height:
        out = resize_bicubic(out, height, width).clamp(0.0, 1.0)
    return out


def center_crop(images: Any, height: int, width: int, offsets: str = "floor") -> Any:
    """The centred ``height x width`` window of ``(..., H, W)``.

    ``offsets="floor"``: top ``(H - height) // 2`` (transformers' image processors); ``"round"``: ``int(round((H -
    height) / 2))`` (torchvision's ``CenterCrop``, the official ImageReward transform). An image smaller than the window
    is zero-padded first, centred with ``ceil`` offsets, as transformers pads it.
    """
    import torch.nn.functional as F

    if offsets not in ("floor", "round"):
        raise ValueError(f"offsets must be 'floor' or 'round', got {offsets!r}")
    h, w = images.shape[-2:]
    if h < height or w < width:
        pad_h, pad_w = max(0, height - h), max(0, width - w)
        top_pad, left_pad = math.ceil(pad_h / 2), math.ceil(pad_w / 2)
        images = F.pad(images, (left_pad, pad_w - left_pad, top_pad, pad_h - top_pad), value=0.0)
        h, w = images.shape[-2:]
    if offsets == "floor":
        top, left = (h - height) // 2, (w - width) // 2
    else:
        top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return images[..., top:top + height, left:left + width]


def normalize(images: Any, mean: Sequence[float], std: Sequence[float]) -> Any:
    """``(images - mean) / std`` per channel of ``(..., 3, H, W)``, float32."""
    import torch

    mean_t = torch.tensor([float(m) for m in mean], dtype=torch.float32, device=images.device).view(-1, 1, 1)
    std_t = torch.tensor([float(s) for s in std], dtype=torch.float32, device=images.device).view(-1, 1, 1)
    return (images.float() - mean_t) / std_t
