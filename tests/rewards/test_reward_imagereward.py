"""``imagereward`` on a tiny random ImageReward saved in the official checkpoint layout (no hub access here).

The official package cannot be a dependency (it pins timm 0.6.13 and fairscale and imports OpenAI's ``clip``), so:
the official key layout is round-tripped through the loader; the expected scores below were computed by the
official ``ImageReward.score`` (ImageReward/ImageReward.py with its BLIP ``vit.py`` / ``med.py``, run once in a
throwaway environment) on this same tiny checkpoint and these same images; the preprocessing is checked against the
official transform's arithmetic (short side 224, long side truncated, centre crop offsets rounded).
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.imagereward import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    ImageReward,
    imagereward_pixels,
    load_imagereward_model,
    load_imagereward_tokenizer,
    official_to_ours,
    ours_to_official,
)
from flowgrpo.testing.tiny_rewards import save_tiny_imagereward

# The official ImageReward.score on save_tiny_imagereward(seed=0) and _images() below.
OFFICIAL_SCORES = [52.19091, 51.184807, 50.213692]
PROMPTS = ["a red cat", "two dogs sitting next to a tree",
           "an astronaut riding a horse on the moon at night over the city with blue sky and yellow sun and green "
           "field and flowers"]


def _images():
    rng = np.random.default_rng(1234)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(64, 64), (240, 320),
                                                                                          (300, 200)]]


@pytest.fixture(scope="module")
def tiny_ir(tmp_path_factory):
    return save_tiny_imagereward(tmp_path_factory.mktemp("tiny-imagereward"), seed=0)


@pytest.fixture(scope="module")
def reward(tiny_ir):
    return get_reward("imagereward", model_name_or_path=str(tiny_ir["checkpoint"]),
                      med_config=str(tiny_ir["med_config"]), tokenizer_name_or_path=str(tiny_ir["tokenizer"]),
                      device="cpu", batch_size=2)


def test_scores_equal_the_official_code(reward):
    scores = reward(PROMPTS, _images())
    assert all(type(s) is float for s in scores)
    assert scores == pytest.approx(OFFICIAL_SCORES, abs=3e-4)


def test_batching_and_normalisation(reward):
    images = _images()
    one_by_one = [reward([p], [im])[0] for p, im in zip(PROMPTS, images)]
    assert reward(PROMPTS, images) == pytest.approx(one_by_one, abs=1e-5)
    # The score is the normalised MLP output of the [CLS] feature.
    model, tok = reward.load(), reward.tokenizer
    text = tok(PROMPTS[:1], padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        raw = model(imagereward_pixels(images[0])[None], text["input_ids"], text["attention_mask"])
    assert one_by_one[0] == pytest.approx((float(raw) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD, abs=1e-5)


def test_tokenizer_has_blip_special_tokens(tiny_ir):
    tok = load_imagereward_tokenizer(tiny_ir["tokenizer"])
    assert tok.bos_token == "[DEC]" and "[ENC]" in tok.all_special_tokens
    ids = tok(["a cat", PROMPTS[2] * 3], padding="max_length", truncation=True, max_length=35)["input_ids"]
    assert all(len(x) == 35 and x[0] == tok.cls_token_id for x in ids)


def test_preprocessing_matches_the_official_arithmetic():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (300, 517, 3), dtype=np.uint8)  # h=300, w=517
    image = Image.fromarray(array)
    # short side 224, long side int(224 * 517 / 300) = 386; crop left int(round(162 / 2)) = 81, top 0
    resized = image.resize((386, 224), Image.BICUBIC)
    crop = np.asarray(resized, dtype=np.float32)[0:224, 81:305] / 255.0
    expected = (torch.from_numpy(crop).permute(2, 0, 1) - torch.tensor(CLIP_MEAN)[:, None, None]) \
        / torch.tensor(CLIP_STD)[:, None, None]
    assert torch.allclose(imagereward_pixels(image), expected, atol=1e-6)
    # RGBA is resized and cropped before the RGB conversion, as the official transform does.
    rgba = Image.fromarray(rng.integers(0, 256, (250, 333, 4), dtype=np.uint8), "RGBA")
    ref = rgba.resize((int(224 * 333 / 250), 224), Image.BICUBIC)
    left = int(round((ref.size[0] - 224) / 2.0))
    ref = np.asarray(ref.crop((left, 0, left + 224, 224)).convert("RGB"), dtype=np.float32) / 255.0
    got = imagereward_pixels(rgba) * torch.tensor(CLIP_STD)[:, None, None] + torch.tensor(CLIP_MEAN)[:, None, None]
    assert torch.allclose(got, torch.from_numpy(ref).permute(2, 0, 1), atol=1e-5)


def test_official_layout_round_trip_and_strict_loading(tiny_ir, tmp_path):
    official = torch.load(tiny_ir["checkpoint"], weights_only=True)
    assert "blip.visual_encoder.blocks.1.attn.qkv.weight" in official
    assert "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight" in official
    ours = official_to_ours(official)
    dropped = {"blip.text_encoder.embeddings.position_ids", "blip.vision_proj.weight", "blip.vision_proj.bias",
               "blip.text_proj.weight", "blip.text_proj.bias"}
    assert set(ours_to_official(ours)) == set(official) - dropped
    model = load_imagereward_model(tiny_ir["checkpoint"], tiny_ir["med_config"])
    assert set(model.state_dict()) == set(ours)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ours.items())

    broken = dict(official)
    del broken["blip.text_encoder.encoder.layer.0.crossattention.self.query.weight"]
    torch.save(broken, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="crossattention.self.query.weight"):
        load_imagereward_model(tmp_path / "missing.pt", tiny_ir["med_config"])
    extra = dict(official)
    extra["blip.itm_head.weight"] = torch.zeros(2, 2)
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match="itm_head"):
        load_imagereward_model(tmp_path / "extra.pt", tiny_ir["med_config"])


def test_folder_loading_finds_med_config_and_errors(tiny_ir, tmp_path):
    folder_reward = ImageReward(model_name_or_path=str(tiny_ir["folder"]),
                                tokenizer_name_or_path=str(tiny_ir["tokenizer"]), device="cpu")
    images = _images()[:1]
    assert folder_reward(PROMPTS[:1], images) == pytest.approx(OFFICIAL_SCORES[:1], abs=3e-4)
    with pytest.raises(FileNotFoundError, match="ImageReward.pt"):
        ImageReward(model_name_or_path=str(tmp_path), device="cpu").load()
    with pytest.raises(ValueError, match="dtype"):
        ImageReward(dtype="float31")
    # A med_config that does not fit the weights is refused with the shapes named.
    med = json.loads(tiny_ir["med_config"].read_text())
    med["vocab_size"] = 10
    with pytest.raises(ValueError, match="word_embeddings"):
        ImageReward(model_name_or_path=str(tiny_ir["checkpoint"]), med_config=med,
                    tokenizer_name_or_path=str(tiny_ir["tokenizer"]), device="cpu").load()
