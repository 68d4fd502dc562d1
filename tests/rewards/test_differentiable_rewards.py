"""Differentiable rewards: the tensor path of pickscore, clipscore, aesthetic, hpsv2 and imagereward against their PIL
path (tiny random models in the official layouts, as their own tests build them), the torch preprocessing against
the image processors' PIL arithmetic, and `RewardSet.score_with_grad`.

Tolerances (measured, docs/rewards.md "Differentiable rewards"): preprocessed pixels within 1.1 / 255 of the PIL path
(PIL rounds to 8 bits after each of its two resize passes; measured at most 1.05 / 255); hpsv2 exactly (the same torch
operations); on these tiny models the scores within 5e-3 relative for the CLIP scorers (measured 3.4e-3: a 32-pixel
CLIP input feels each rounded pixel) and 2e-4 for imagereward (measured 7.3e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import RewardSet, get_reward, is_differentiable, resolve_reward_funcs
from flowgrpo.rewards.clip_scorers import build_aesthetic_mlp, clip_pixels_from_tensor
from flowgrpo.rewards.differentiable import resize_bicubic, resize_bicubic_like_pil, stack_pil
from flowgrpo.rewards.hpsv2 import hps_pixels, hps_pixels_from_tensor
from flowgrpo.rewards.imagereward import CLIP_STD, imagereward_pixels, imagereward_pixels_from_tensor
from flowgrpo.testing.tiny_geneval import save_tiny_clip
from flowgrpo.testing.tiny_rewards import save_tiny_hpsv2, save_tiny_imagereward

PROMPTS = ["a red cat", "two dogs sitting next to a tree"]


def _noise(height, width, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _smooth(height, width):
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    image = np.stack([np.sin(6 * x + 1) * 0.5 + 0.5, np.cos(9 * y * x) * 0.5 + 0.5, (x + y) / 2], -1)
    image[height // 3:height // 2, width // 4:width // 2] = [0.9, 0.1, 0.2]
    return Image.fromarray((image * 255).round().astype(np.uint8))


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("differentiable-rewards")
    clip = save_tiny_clip(folder / "clip")
    torch.manual_seed(0)
    torch.save(build_aesthetic_mlp(16).state_dict(), folder / "mlp.pth")
    hps = save_tiny_hpsv2(folder / "hps")
    ir = save_tiny_imagereward(folder / "ir")
    return {
        "clipscore": (get_reward("clipscore", model_id=clip, device="cpu"), 5e-3),
        "pickscore": (get_reward("pickscore", model_id=clip, processor_id=clip, device="cpu"), 5e-3),
        "aesthetic": (get_reward("aesthetic", mlp_path=str(folder / "mlp.pth"), model_id=clip, device="cpu"), 5e-3),
        "hpsv2": (get_reward("hpsv2", model_name_or_path=str(hps["checkpoint"]),
                             tokenizer_name_or_path=str(hps["tokenizer"]), device="cpu"), 1e-6),
        "imagereward": (get_reward("imagereward", model_name_or_path=str(ir["checkpoint"]),
                                   med_config=str(ir["med_config"]), tokenizer_name_or_path=str(ir["tokenizer"]),
                                   device="cpu"), 2e-4),
    }


@pytest.mark.parametrize("name", ["clipscore", "pickscore", "aesthetic", "hpsv2", "imagereward"])
def test_tensor_path_equals_pil_path_and_carries_the_gradient(rewards, name):
    reward, rtol = rewards[name]
    assert is_differentiable(reward)
    images = [_noise(64, 48, seed=1), _noise(64, 48, seed=2)]
    pil = reward(PROMPTS, images)  # first: the weights load in inference mode's scope and must still train after
    pixels = stack_pil(images).requires_grad_()
    scores = reward(PROMPTS, pixels)
    assert scores.shape == (2,) and scores.dtype == torch.float32 and scores.requires_grad
    np.testing.assert_allclose(scores.detach().numpy(), pil, rtol=rtol, atol=0)
    scores.sum().backward()
    assert torch.isfinite(pixels.grad).all() and pixels.grad.abs().sum() > 0
    loaded = reward.load()
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    assert not any(p.requires_grad for p in model.parameters())  # the gradient reaches the images only


def test_preprocessing_pixels_match_the_pil_arithmetic():
    """At the real models' 224 pixels: the CLIP processor (PIL bicubic on 8 bits, floor crop), ImageReward's transform
    (round crop) and HPS's letterbox, each against its tensor path, in pixel units."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    for image in (_noise(300, 200), _smooth(120, 90), _noise(32, 32, seed=3)):  # shrinking, and enlarging
        x = stack_pil([image])
        official = torch.from_numpy(np.asarray(processor(images=[image], return_tensors="np")["pixel_values"]))
        assert ((official - clip_pixels_from_tensor(x, processor)) * std).abs().max() * 255 <= 1.1
        assert ((imagereward_pixels(image) - imagereward_pixels_from_tensor(x)[0]) * std).abs().max() * 255 <= 1.1
        assert torch.equal(hps_pixels(image), hps_pixels_from_tensor(x)[0])


def test_two_passes_with_clamping_are_what_pil_does():
    """One antialiased pass has PIL's filter (float images agree to 2.1e-5) but not its clipping between passes."""
    image = _noise(64, 48, seed=4)
    x = stack_pil([image])
    pil = stack_pil([image.resize((150, 130), Image.BICUBIC)])
    assert (resize_bicubic_like_pil(x, 130, 150) - pil).abs().max() * 255 <= 1.1
    assert (resize_bicubic(x, 130, 150).clamp(0, 1) - pil).abs().max() * 255 > 5  # no clipping between the passes
    pil_float = Image.fromarray(np.asarray(image)[..., 0].astype(np.float32) / 255, mode="F").resize((150, 130),
                                                                                                   Image.BICUBIC)
    assert np.abs(resize_bicubic(x[:, :1], 130, 150)[0, 0].numpy() - np.asarray(pil_float)).max() < 3e-5


def _brightness(prompts, images, **columns):
    """A user's differentiable reward: the mean pixel value."""
    if isinstance(images, torch.Tensor):
        return images.mean(dim=(1, 2, 3))
    return [float(np.asarray(im, dtype=np.float32).mean() / 255) for im in images]


_brightness.differentiable = True


def test_score_with_grad_weights_as_the_pil_path(tmp_path, monkeypatch):
    """A user's 'module:function' reward and the toy world's, weighted 0.5 : 1, as the PIL path weights them; a prompt
    naming no attribute is NaN (the PIL path's None) and masking it leaves a finite gradient."""
    (tmp_path / "my_diff_rewards.py").write_text(
        "import numpy as np, torch\n\n"
        "def brightness(prompts, images, **columns):\n"
        "    if isinstance(images, torch.Tensor):\n"
        "        return images.mean(dim=(1, 2, 3))\n"
        "    return [float(np.asarray(im, dtype=np.float32).mean() / 255) for im in images]\n\n"
        "brightness.differentiable = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from flowgrpo.toy.world import Scene, render

    reward_set = resolve_reward_funcs(["my_diff_rewards:brightness", "toy_smooth_shape_color", "toy_shape"],
                                      reward_weights=[0.5, 1.0, 0.0])
    assert reward_set.differentiable_rewards == ["brightness", "toy_smooth_shape_color"]
    assert reward_set.non_differentiable_rewards == []  # toy_shape has weight 0: logged by the PIL path only
    prompts = ["one red circle on the left", "two blue squares at the top", "a photo"]
    images = [render(Scene("red", "circle", 1, "left"), rng=1), render(Scene("blue", "square", 2, "top"), rng=2),
              render(Scene("green", "triangle", 1, "right"), rng=3)]
    pixels = stack_pil(images).requires_grad_()
    result = reward_set.score_with_grad(prompts, pixels)
    pil = reward_set(prompts, images)
    assert "toy_shape" not in result.per_reward
    assert result.valid.tolist() == [True, True, False]
    np.testing.assert_allclose(result.total[:2].detach().numpy(), pil.total[:2], rtol=1e-6)
    assert pil.total[2] is None and torch.isnan(result.total[2])
    assert result.statistics()["reward"] == pytest.approx(np.mean(pil.total[:2]), rel=1e-6)
    result.total[result.valid].sum().backward()
    assert torch.isfinite(pixels.grad).all() and pixels.grad[:2].abs().sum() > 0
    assert pixels.grad[2].abs().sum() == 0


def test_non_differentiable_rewards_are_refused_by_name():
    reward_set = RewardSet([_brightness, get_reward("toy_shape"), get_reward("jpeg_compressibility")],
                           ["brightness", "toy_shape", "jpeg"], [1.0, 1.0, 0.0])
    assert reward_set.non_differentiable_rewards == ["toy_shape"]
    pixels = torch.rand(1, 3, 8, 8)
    with pytest.raises(ValueError, match=r"\['toy_shape'\] are not differentiable.*\['brightness'\]"):
        reward_set.score_with_grad(["a red circle"], pixels)
    with pytest.raises(ValueError, match="nothing to backpropagate"):
        RewardSet([_brightness], ["brightness"], [0.0]).score_with_grad(["x"], pixels)
    ok = RewardSet([_brightness], ["brightness"])
    with pytest.raises(TypeError, match="score PIL images by calling"):
        ok.score_with_grad(["x"], [Image.new("RGB", (8, 8))])
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\).*\(1, 8, 8\)"):
        ok.score_with_grad(["x"], torch.rand(1, 8, 8))
    with pytest.raises(ValueError, match="2 prompts and 1 images"):
        ok.score_with_grad(["x", "y"], pixels)
    with pytest.raises(TypeError, match="images.float\\(\\) / 255"):
        ok.score_with_grad(["x"], torch.zeros(1, 3, 8, 8, dtype=torch.uint8))

    def listing(prompts, images, **columns):
        return [0.0] * len(prompts)

    listing.differentiable = True
    with pytest.raises(TypeError, match="'listing' returned a list"):
        RewardSet([listing], ["listing"]).score_with_grad(["x"], pixels)


def test_a_ranked_reward_is_not_differentiable(rewards):
    clip = rewards["pickscore"][0].model_id
    rank = get_reward("pickscore_rank", model_id=clip, processor_id=clip, device="cpu")
    assert not is_differentiable(rank)
    assert RewardSet([rank], ["pickscore_rank"]).non_differentiable_rewards == ["pickscore_rank"]
    with pytest.raises(TypeError, match="'PickScoreRank' is not differentiable"):
        rank(PROMPTS, torch.rand(2, 3, 32, 32))


class _Placed:
    """A differentiable reward with the offloading methods, recording where its weights were asked to be."""

    differentiable = True

    def __init__(self):
        self.weight = torch.tensor([0.5, -1.0, 2.0])
        self.placements = []

    def to(self, device=None):
        self.placements.append("device")
        return self

    def offload(self):
        self.placements.append("cpu")

    def __call__(self, prompts, images, **columns):
        return (images.mean(dim=(2, 3)) * self.weight).sum(-1)


def test_offloaded_weights_stay_for_the_backward_pass():
    reward = _Placed()
    reward_set = RewardSet([reward], ["placed"], offload=True)
    pixels = torch.rand(2, 3, 4, 4, requires_grad=True)
    result = reward_set.score_with_grad(["a", "b"], pixels)
    assert reward.placements == ["device"]  # not offloaded before the backward pass
    result.total.sum().backward()
    reward_set.offload_rewards()
    assert reward.placements == ["device", "cpu"]
    assert torch.allclose(pixels.grad[0, :, 0, 0], reward.weight / 16)
