"""`vqascore` and `deqa` on a tiny random Qwen2.5-VL, each checked against an independent one-pair computation.

The real checkpoints (Qwen2.5-VL-7B-Instruct, 16 GB) cannot be downloaded here; the tiny model has the same
architecture and processor, so batching, left padding, the chat template and the token arithmetic are exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.deqa import DeQAScore, expand_to_square, level_token_ids
from flowgrpo.rewards.vlm_models import load_vlm_processor
from flowgrpo.rewards.vqascore import VQAScore
from flowgrpo.testing.tiny_vlms import cached_tiny_vlm_path

TEMPLATE_HEAD = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEMPLATE_TAIL = "<|im_end|>\n<|im_start|>assistant\n"

PROMPTS = ["a red apple next to a green pear", "a cat", "two dogs playing in the snow; one is brown"]


@pytest.fixture(scope="module")
def tiny_vlm():
    from transformers import AutoModelForImageTextToText

    path = cached_tiny_vlm_path("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return path, model, load_vlm_processor(str(path))


def _noise(width, height):
    """A fixed noise image (the same pixels on every call)."""
    rng = np.random.default_rng(width * 1000 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _images():
    return [Image.new("RGB", (32, 32), "red"), _noise(48, 32),
            Image.new("RGB", (40, 64), (20, 90, 200))]


def _last_logits(model, processor, text, image):
    batch = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits[0, -1].float()


def test_vqascore_is_the_softmax_probability_of_yes(tiny_vlm):
    path, model, processor = tiny_vlm
    reward = get_reward("vqascore", model_name_or_path=str(path), device="cpu", dtype="float32", batch_size=2)
    assert isinstance(reward, VQAScore)
    scores = reward(PROMPTS, _images())

    yes = processor.tokenizer.encode("Yes", add_special_tokens=False)[0]
    expected = []
    for prompt, image in zip(PROMPTS, _images()):
        question = f'Does this figure show "{prompt}"? Please answer yes or no.'
        logits = _last_logits(model, processor, TEMPLATE_HEAD + IMAGE + question + TEMPLATE_TAIL, image)
        expected.append(torch.softmax(logits, -1)[yes].item())
    assert scores == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert all(isinstance(s, float) and 0.0 < s < 1.0 for s in scores)

    # t2v_metrics' way for its Qwen2-VL models: the first step's scores of a greedy one-token generate
    question = f'Does this figure show "{PROMPTS[0]}"? Please answer yes or no.'
    batch = processor(text=[TEMPLATE_HEAD + IMAGE + question + TEMPLATE_TAIL], images=[_images()[0]],
                      return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=1, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    assert scores[0] == pytest.approx(torch.softmax(out.scores[0], -1)[0, yes].item(), rel=1e-4)
    assert len(set(scores)) == 3
    assert reward([], []) == []


def test_deqa_is_the_expected_level_over_five(tiny_vlm):
    path, model, processor = tiny_vlm
    reward = get_reward("deqa", model_name_or_path=str(path), device="cpu", dtype="float32", batch_size=2)
    assert isinstance(reward, DeQAScore)
    scores = reward(PROMPTS, _images())

    words = ["excellent", "good", "fair", "poor", "bad"]
    ids = [processor.tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in words]
    assert level_token_ids(processor.tokenizer, words) == ids and len(set(ids)) == 5
    expected = []
    for image in _images():
        text = (TEMPLATE_HEAD + IMAGE + "How would you rate the quality of this image?" + TEMPLATE_TAIL
                + "The quality of the image is")
        probs = torch.softmax(_last_logits(model, processor, text, image)[ids], -1)
        expected.append(float(probs @ torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])) / 5.0)
    assert scores == pytest.approx(expected, rel=1e-5)
    assert all(0.2 <= s <= 1.0 for s in scores)
    on_five = get_reward("deqa", model_name_or_path=str(path), device="cpu", divide_by=1.0)(PROMPTS[:1], _images()[:1])
    assert on_five[0] == pytest.approx(5 * scores[0], rel=1e-5)


def test_deqa_square_padding_and_bad_settings():
    square = expand_to_square(Image.new("RGB", (40, 20), (255, 0, 0)), (1, 2, 3))
    assert square.size == (40, 40)
    assert square.getpixel((0, 0)) == (1, 2, 3) and square.getpixel((0, 10)) == (255, 0, 0)
    assert square.getpixel((0, 9)) == (1, 2, 3) and square.getpixel((0, 30)) == (1, 2, 3)
    with pytest.raises(ValueError, match="levels"):
        DeQAScore(levels=[("good", 1.0)])
    with pytest.raises(ValueError, match="question_template"):
        VQAScore(question_template="Is this good?")
    with pytest.raises(ValueError, match="2 prompts and 1 images"):
        VQAScore()(["a", "b"], [Image.new("RGB", (8, 8))])


def test_placement_methods_for_reward_offload(tiny_vlm):
    path, _, _ = tiny_vlm
    reward = VQAScore(model_name_or_path=str(path), reward_device="cpu", dtype="float32")
    reward.offload()  # nothing loaded yet: nothing to move, nothing loads
    assert not reward.loaded
    assert reward.to() is reward and reward.loaded and reward.current_device.type == "cpu"
    reward.offload()
    assert next(reward.load()[0].parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="disagree"):
        DeQAScore(device="cpu", reward_device="cuda:1")
