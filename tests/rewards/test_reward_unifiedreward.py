"""`unifiedreward`: the reference's prompt, 512x512 resize, ``Final Score`` parse and policies, against a fake
OpenAI-compatible server on the loopback address, and in process on tiny random Qwen2.5-VL and Qwen3-VL models."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_reward_vlm_judge import ChatServer

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.unifiedreward import (
    UNIFIEDREWARD_PROMPT,
    UnifiedReward,
    UnifiedRewardUnparsableError,
    parse_final_score,
)
from flowgrpo.rewards.vlm_models import load_vlm_processor
from flowgrpo.testing.tiny_vlms import cached_tiny_vlm_path

MODEL = "UnifiedReward-7b-v1.5"
ANSWERS = {
    "a red square": "The image matches the caption well.\nFinal Score: 4",
    "a blue circle": "Alignment: good. Final Score: 3.5. (Overall Final Score: 5)",
    "a cat": "I cannot judge this image.",
    "a dog": "Final Score: 10",  # the reference's pattern reads the first digit only: 1
}


@pytest.fixture
def server():
    srv = ChatServer(lambda text: next(a for p, a in ANSWERS.items() if f"Text Caption: [{p}]" in text),
                     models=(MODEL,))
    yield srv
    srv.close()


def _image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_server_backend_sends_the_reference_request_and_reads_final_score(server):
    reward = get_reward("unifiedreward", base_url=server.base_url, api_key_env=None, timeout=10)
    assert isinstance(reward, UnifiedReward)
    prompts = list(ANSWERS)
    images = [_image(64, 48, i) for i in range(len(prompts))]
    assert reward(prompts, images) == pytest.approx([0.8, 0.7, 0.0, 0.2])

    assert len(server.requests) == 4
    for body in server.requests:
        assert body["model"] == MODEL and body["temperature"] == 0.0 and "max_tokens" not in body
        (user,) = body["messages"]
        image_part, text_part = user["content"]
        caption = text_part["text"].split("Text Caption: [")[1][:-1]
        assert text_part["text"] == UNIFIEDREWARD_PROMPT.format(prompt=caption)
        data = base64.b64decode(image_part["image_url"]["url"].split("base64,", 1)[1])
        sent = Image.open(io.BytesIO(data))
        original = images[prompts.index(caption)]
        assert sent.size == (512, 512)
        assert np.array_equal(np.asarray(sent.convert("RGB")),
                              np.asarray(original.resize((512, 512), Image.Resampling.BICUBIC)))


def test_unparsable_policies(server):
    kwargs = dict(base_url=server.base_url, api_key_env=None, timeout=10, max_concurrency=2)
    assert get_reward("unifiedreward", on_unparsable="none", **kwargs)(["a cat"], [_image(8, 8, 0)]) == [None]
    assert get_reward("unifiedreward", on_unparsable=0.5, **kwargs)(["a cat"], [_image(8, 8, 0)]) == [0.5]
    with pytest.raises(UnifiedRewardUnparsableError, match="Final Score"):
        get_reward("unifiedreward", on_unparsable="raise", **kwargs)(["a cat"], [_image(8, 8, 0)])
    with pytest.raises(ValueError, match="on_unparsable"):
        UnifiedReward(on_unparsable="skip", health_check=False)
    with pytest.raises(ValueError, match="backend"):
        UnifiedReward(backend="sglang")
    remote = UnifiedReward(health_check=False)
    assert remote.to() is remote and not remote.loaded  # a served judge has no local weights to move
    remote.offload()


def test_final_score_parse_matches_the_reference_pattern():
    assert parse_final_score("Final Score: 4.25") == 4.25
    assert parse_final_score("Final Score:3") == 3.0
    assert parse_final_score("final score: 3") is None  # case-sensitive, as the reference
    assert parse_final_score("Final Score: 0") is None and parse_final_score("Final Score: 6") is None
    assert parse_final_score(None) is None


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_transformers_backend_generates_greedily_on_tiny_qwen_vlms(kind):
    from transformers import AutoModelForImageTextToText

    path = cached_tiny_vlm_path(kind)
    reward = get_reward("unifiedreward", backend="transformers", model=str(path), device="cpu", dtype="float32",
                        max_new_tokens=3, batch_size=2)
    prompts = ["a red apple", "a cat sitting on a wooden table", "a dog"]
    images = [_image(40, 24, 1), _image(32, 32, 2), _image(24, 56, 3)]
    answers = reward.generate_answers(prompts, images)

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_vlm_processor(str(path))
    for prompt, image, answer in zip(prompts, images, answers):
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>" + UNIFIEDREWARD_PROMPT.format(prompt=prompt)
                + "<|im_end|>\n<|im_start|>assistant\n")
        batch = processor(text=[text], images=[image.resize((512, 512), Image.Resampling.BICUBIC)],
                          return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=3, do_sample=False)
        assert answer == processor.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)[0]
    # a random model never writes "Final Score": the reference's policy scores those answers 0
    assert reward(prompts, images) == [0.0, 0.0, 0.0]
