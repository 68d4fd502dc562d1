"""The toy world's differentiable reward ``toy_smooth_shape_color``: registered as differentiable, its PIL path equal
to its tensor path, smooth (``torch.autograd.gradcheck`` in float64), and right about renderings of every shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.rewards import get_reward, is_differentiable, list_rewards
from flowgrpo.rewards.differentiable import stack_pil
from flowgrpo.toy.rewards import smooth_shape_color_terms
from flowgrpo.toy.world import COLORS, SHAPES, Scene, render


def _scenes():
    rng = np.random.default_rng(7)
    return [Scene(str(rng.choice(list(COLORS))), shape, int(rng.integers(1, 4)), str(rng.choice(["left", "top"])))
            for shape in SHAPES for _ in range(2)]


def test_registered_differentiable_and_pil_path_equals_tensor_path():
    assert "toy_smooth_shape_color" in list_rewards()
    reward = get_reward("toy_smooth_shape_color", color_weight=1.0)
    assert is_differentiable(reward)
    scenes = _scenes()
    images = [render(s, rng=i) for i, s in enumerate(scenes)]
    prompts = [s.caption for s in scenes] + ["a photo of nothing"]
    images.append(images[0])
    pil = reward(prompts, images)
    tensor = reward(prompts, stack_pil(images))
    assert pil[-1] is None and torch.isnan(tensor[-1])
    np.testing.assert_allclose(tensor[:-1].numpy(), pil[:-1], rtol=0, atol=1e-6)
    assert min(pil[:-1]) > 0.99  # every rendering: its own shape and colour
    swapped = [s.caption.replace(s.shape, SHAPES[(SHAPES.index(s.shape) + 1) % 3]) for s in scenes]
    shape_only = reward(swapped, stack_pil(images[:-1]))
    assert shape_only.max() < 0.51  # the colour half only: the shape term is near 0 for the wrong shape
    blank = reward(["one red circle on the left"], stack_pil([render(scenes[0], rng=0).point(lambda _: 0)]))
    assert blank.item() < 1e-3  # no object, no reward
    with pytest.raises(ValueError, match="color_weight"):
        get_reward("toy_smooth_shape_color", color_weight=-1)(prompts[:1], images[:1])


def test_smooth_in_the_pixels():
    """gradcheck: the analytic gradient equals finite differences in float64 (a plain channel maximum, with its kink
    on the black canvas, fails this)."""
    image = stack_pil([render(Scene("cyan", "triangle", 1, "left"), rng=3)])[:, :, 6:22, 0:16]
    pixels = (image.double() * 0.9 + 0.05).requires_grad_()
    reward = get_reward("toy_smooth_shape_color")
    assert torch.autograd.gradcheck(lambda x: reward(["one cyan triangle on the left"], x), (pixels,), fast_mode=True)
    terms = smooth_shape_color_terms(pixels)
    assert terms["harmonics"].dtype == torch.float64


def test_nearest_prototype_is_the_rendered_shape():
    scenes = _scenes()
    terms = smooth_shape_color_terms(stack_pil([render(s, rng=10 + i) for i, s in enumerate(scenes)]))
    assert [SHAPES[i] for i in terms["shape_logits"].argmax(-1).tolist()] == [s.shape for s in scenes]
    assert [list(COLORS)[i] for i in terms["color_logits"].argmax(-1).tolist()] == [s.color for s in scenes]
