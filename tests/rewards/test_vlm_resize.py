"""The Qwen-VL rewards resize images as their official code's image-processor backend does, whichever backend
transformers runs here: PIL for Qwen2-VL and Qwen2.5-VL (the values of this install, unchanged), torch's uint8 bicubic
kernel for Qwen3-VL (the torchvision backend, which every Qwen3-VL stack has)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards.vlm_models import (
    chat_text,
    load_vlm_processor,
    official_resize_backend,
    processor_pixel_bounds,
    qwen_vl_processor_size,
    resize_like_processor,
    vlm_batch,
)
from flowgrpo.testing.tiny_vlms import cached_tiny_vlm_path


def _image():
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind, backend", [("qwen2_5_vl", "pil"), ("qwen3_vl", "torchvision")])
def test_vlm_batch_resizes_with_the_official_backend(kind, backend):
    processor = load_vlm_processor(str(cached_tiny_vlm_path(kind)))
    assert official_resize_backend(processor) == backend
    text = chat_text(processor, "Is it red?")
    ours = vlm_batch(processor, [text], [_image()], "cpu")["pixel_values"]
    factor = processor.image_processor.patch_size * processor.image_processor.merge_size
    height, width = qwen_vl_processor_size(50, 70, factor, *processor_pixel_bounds(processor.image_processor))
    assert (height, width) != (50, 70)  # the processor resizes this image
    if backend == "pil":
        expected = _image().resize((width, height), Image.Resampling.BICUBIC)
    else:
        pixels = torch.from_numpy(np.asarray(_image()).copy()).permute(2, 0, 1)[None]
        expected = Image.fromarray(torch.nn.functional.interpolate(
            pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)[0].permute(1, 2, 0)
            .numpy())
    assert resize_like_processor(_image(), processor.image_processor, backend).size == (width, height)
    direct = processor(text=[text], images=[expected], padding=True, return_tensors="pt")["pixel_values"]
    assert torch.equal(ours, direct)
    if backend == "pil":  # the PIL backend of this install resizes the same way: values unchanged
        assert torch.equal(ours, processor(text=[text], images=[_image()], padding=True,
                                           return_tensors="pt")["pixel_values"])
