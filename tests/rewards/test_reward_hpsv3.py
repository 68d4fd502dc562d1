"""`hpsv3` on a tiny random Qwen2-VL written in HPSv3's checkpoint layout (transformers 4.45 keys).

The official package pins transformers 4.45.2 and imports torchvision, deepspeed and trl, so it cannot run beside
this library; instead the checkpoint layout is round-tripped through our loader and the score is checked against
an independent computation with stock transformers parts (sequential positions, as HPSv3's forward gets them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowgrpo.rewards import get_reward, list_rewards
from flowgrpo.rewards.hpsv3 import (
    HPSV3_INSTRUCTION,
    HPSV3_REWARD_SUFFIX,
    HPSV3_REWARD_TOKEN,
    HPSv3Reward,
    build_hpsv3_model,
    convert_hpsv3_state_dict,
    smart_resize,
)
from flowgrpo.rewards.vlm_models import load_vlm_processor
from flowgrpo.testing.seeding import seeded_component
from flowgrpo.testing.tiny_vlms import cached_tiny_vlm_path

PIXELS = 56 * 56  # 4 merged image tokens per image: keeps the tiny model's sequences short


def _noise(width, height):
    """A fixed noise image (the same pixels on every call)."""
    rng = np.random.default_rng(width * 1000 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _official_layout(state: dict) -> dict:
    """Our keys written back as HPSv3's released checkpoint has them (transformers 4.45 Qwen2-VL layout)."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            out["model." + key[len("model.language_model."):]] = value
        elif key.startswith("model.visual."):
            out["visual." + key[len("model.visual."):]] = value
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def hpsv3_checkpoint(tmp_path_factory):
    from transformers import AutoConfig

    base = cached_tiny_vlm_path("qwen2_vl")
    tokenizer = load_vlm_processor(str(base)).tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_REWARD_TOKEN]})
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = len(tokenizer)
    with seeded_component(0, 41):
        model = build_hpsv3_model(config, tokenizer.convert_tokens_to_ids(HPSV3_REWARD_TOKEN)).eval()
        for param in model.rm_head.parameters():  # a head large enough that different inputs score differently
            torch.nn.init.normal_(param, std=0.5)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    official = _official_layout(state)
    official["lm_head.weight"] = torch.randn(len(tokenizer), config.text_config.hidden_size)
    folder = tmp_path_factory.mktemp("hpsv3")
    save_file(official, str(folder / "HPSv3.safetensors"))
    return base, folder, model, state


def _reward(base, folder, **kwargs):
    return get_reward("hpsv3", model_name_or_path=str(folder), base_model_name_or_path=str(base), device="cpu",
                      dtype="float32", min_pixels=PIXELS, max_pixels=PIXELS, **kwargs)


def test_official_layout_round_trips_through_the_loader(hpsv3_checkpoint):
    base, folder, _, state = hpsv3_checkpoint
    official = _official_layout(state)
    assert any(k.startswith("visual.") for k in official) and any(k.startswith("model.layers.") for k in official)
    assert convert_hpsv3_state_dict(dict(official, **{"lm_head.weight": 0})) == state
    assert convert_hpsv3_state_dict(state) == state  # the current layout loads as is

    reward = _reward(base, folder)
    assert isinstance(reward, HPSv3Reward)
    model, processor = reward.load()
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert processor.tokenizer.convert_tokens_to_ids(HPSV3_REWARD_TOKEN) == model.reward_token_id


def test_score_is_mu_at_the_reward_token_with_sequential_positions(hpsv3_checkpoint):
    base, folder, model, _ = hpsv3_checkpoint
    reward = _reward(base, folder, batch_size=4)
    prompts = ["a red square", "a cat sitting on a wooden table, oil painting", "two dogs"]
    images = [Image.new("RGB", (64, 48), "red"), Image.new("RGB", (40, 40), (10, 200, 30)),
              _noise(50, 70)]
    scores = reward(prompts, images)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)

    processor = load_vlm_processor(str(base))
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_REWARD_TOKEN]})
    expected = []
    for prompt, image in zip(prompts, images):
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>" + HPSV3_INSTRUCTION.format(text_prompt=prompt)
                + HPSV3_REWARD_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n")
        resized = image.resize((56, 56), Image.Resampling.BICUBIC)  # smart_resize of these sizes at 56*56 pixels
        batch = processor(text=[text], images=[resized], return_tensors="pt")
        length = batch["input_ids"].shape[1]
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        with torch.no_grad():
            hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                                 position_ids=positions).last_hidden_state
            at = (batch["input_ids"][0] == model.reward_token_id).nonzero().item()
            expected.append(model.rm_head(hidden[0, at]).tolist())
            # Qwen2-VL's own 3-D image positions (what HPSv3's forward does not use) give another score
            hidden_3d = model.model(**batch).last_hidden_state
            assert abs(model.rm_head(hidden_3d[0, at])[0].item() - expected[-1][0]) > 1e-4
    assert scores == pytest.approx([e[0] for e in expected], rel=1e-5, abs=1e-5)
    assert max(scores) - min(scores) > 1e-4  # the inputs matter
    sigmas = _reward(base, folder, output="sigma")(prompts, images)
    assert sigmas == pytest.approx([e[1] for e in expected], rel=1e-5, abs=1e-5)


def test_smart_resize_matches_the_qwen_vl_utils_rule():
    assert smart_resize(1024, 1024) == (448, 448)
    assert smart_resize(512, 768) == (364, 532)  # scaled down: floor to multiples of 28
    assert smart_resize(32, 32) == (448, 448)  # scaled up: ceil
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)


def test_bad_checkpoints_are_named(hpsv3_checkpoint, tmp_path):
    base, folder, _, state = hpsv3_checkpoint
    partial = _official_layout(state)
    dropped = next(k for k in partial if k.startswith("rm_head."))
    del partial[dropped]
    save_file(partial, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        _reward(base, tmp_path).load()
    with pytest.raises(ValueError, match="unexpected keys"):
        convert_hpsv3_state_dict({"text_model.embeddings.weight": 0})
    with pytest.raises(FileNotFoundError, match="HPSv3.safetensors"):
        _reward(base, tmp_path / "nowhere").load()
    with pytest.raises(ValueError, match="output"):
        HPSv3Reward(output="median")


def test_the_vlm_rewards_are_registered():
    assert {"hpsv3", "unifiedreward", "vqascore", "deqa"} <= set(list_rewards())
