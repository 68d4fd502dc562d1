"""JPEG compressibility rewards: sign, scale (kB at quality 95) and ordering of simple vs detailed images."""

import io

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb


def _flat():
    return Image.new("RGB", (128, 128), (120, 80, 200))


def _noise(seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (128, 128, 3), dtype=np.uint8))


def test_size_matches_an_independent_encoding():
    image = _noise()
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    assert jpeg_size_kb(image) == pytest.approx(len(buffer.getvalue()) / 1000)
    assert jpeg_size_kb(np.asarray(image)) == jpeg_size_kb(image)


def test_sign_and_ordering():
    prompts, images = ["a", "b"], [_flat(), _noise()]
    comp = get_reward("jpeg_compressibility")(prompts, images)
    incomp = get_reward("jpeg_incompressibility")(prompts, images)
    assert comp == [-v for v in incomp]
    assert all(v < 0 for v in comp) and all(v > 0 for v in incomp)
    assert comp[0] > comp[1]  # the flat image is more compressible
    assert incomp[1] > 10 * incomp[0]
    # 128x128 random noise at quality 95: ~20 kB.
    assert 10 < incomp[1] < 60


def test_quality_kwarg_and_errors():
    images = [_noise(1)]
    low = get_reward("jpeg_incompressibility", quality=10)(["x"], images)
    assert low[0] < jpeg_incompressibility(["x"], images)[0]
    assert jpeg_compressibility(["x"], images, quality=10) == [-low[0]]
    with pytest.raises(ValueError, match="quality"):
        jpeg_size_kb(images[0], quality=0)
    with pytest.raises(TypeError, match="PIL images"):
        jpeg_size_kb("image.png")
    # RGBA and grayscale images are converted to RGB.
    assert jpeg_size_kb(Image.new("RGBA", (16, 16))) > 0 and jpeg_size_kb(Image.new("L", (16, 16))) > 0
