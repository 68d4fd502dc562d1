"""VAE decoding in slices of a few images: the decoder's activation peak scales with the images decoded at once.

At 512 px the SD3 VAE decoder holds several 512 x 512 x 128-channel maps per image (67 MB each in bf16), and the
trainer decodes in a background thread while the next micro-batch is sampled, so the two peaks add up. Slices of
``vae_decode_batch_size`` images bound the decoder's share. The decoder treats every image on its own, so slices of
any size give the images of one decode of the whole batch, up to float rounding (convolution libraries pick their
algorithm by batch size: a few 1e-6 on the [0, 1] pixel scale in float32). diffusers' ``vae.enable_slicing()`` is
the size-1 case.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["decode_in_slices"]


def decode_in_slices(decode: Callable[[torch.Tensor, int, int], torch.Tensor], latents: torch.Tensor, height: int,
                     width: int, batch_size: int | None) -> torch.Tensor:
    """``decode(latents, height, width)`` run on ``batch_size`` rows at a time and concatenated along the batch;
    one call when ``batch_size`` is ``None`` or covers the batch."""
    if batch_size is None or latents.shape[0] <= batch_size:
        return decode(latents, height, width)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1 images per decode (or None).")
    return torch.cat([decode(latents[start:start + batch_size], height, width)
                      for start in range(0, latents.shape[0], batch_size)])
