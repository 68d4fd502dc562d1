"""``hpsv2`` on a tiny random open_clip CLIP saved as an HPS checkpoint (no hub access here).

The ``hpsv2`` package cannot be a dependency (it pins protobuf < 4, downloads a 3.9 GB base model) and
``open_clip_torch`` needs torchvision, which does not import beside CPU torch here. So: the open_clip key layout is
round-tripped through the converter; the expected scores and token ids below were computed by HPS's own open_clip
copy (``hpsv2/src/open_clip``: ``CLIP``, ``image_transform(224, is_train=False, resize_longest_max=True)``,
``tokenize``; run once in a throwaway environment) on this same tiny checkpoint, vocabulary and images; the
letterbox is checked against an independent computation.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.hpsv2 import (
    OPENAI_MEAN,
    OPENAI_STD,
    HPSv2,
    OpenCLIPTokenizer,
    hps_pixels,
    load_hps_clip,
    open_clip_to_ours,
    ours_to_open_clip,
)
from flowgrpo.testing.tiny_rewards import save_tiny_hpsv2

# HPS's open_clip on save_tiny_hpsv2(seed=0), _images() and PROMPTS.
OFFICIAL_SCORES = [-0.4994045, -0.3495537, -0.0505476]
OFFICIAL_TOKENS = [[951, 320, 570, 846, 952, 0, 0, 0, 0, 0, 0, 0],
                   [951, 684, 715, 70, 338, 261, 320, 83, 693, 952, 0, 0],
                   [951, 543, 64, 542, 754, 830, 339, 735, 722, 320, 606, 81]]
PROMPTS = ["a red cat", "Two  dogs &amp; a tree", "an astronaut riding a horse on the moon " * 6]


def _images():
    rng = np.random.default_rng(4321)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(64, 64), (240, 320),
                                                                                          (300, 200)]]


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    return save_tiny_hpsv2(tmp_path_factory.mktemp("tiny-hps"), seed=0)


@pytest.fixture(scope="module")
def reward(tiny_hps):
    return get_reward("hpsv2", model_name_or_path=str(tiny_hps["checkpoint"]),
                      tokenizer_name_or_path=str(tiny_hps["tokenizer"]), device="cpu", batch_size=2)


def test_scores_equal_the_official_code(reward):
    scores = reward(PROMPTS, _images())
    assert all(type(s) is float for s in scores)
    assert scores == pytest.approx(OFFICIAL_SCORES, abs=2e-6)
    one_by_one = [reward([p], [im])[0] for p, im in zip(PROMPTS, _images())]
    assert one_by_one == pytest.approx(scores, abs=1e-6)


def test_tokenizer_matches_open_clip(tiny_hps):
    tok = OpenCLIPTokenizer.from_pretrained(tiny_hps["tokenizer"])
    ids = tok(PROMPTS)
    assert ids.shape == (3, 77)
    assert ids[:, :12].tolist() == OFFICIAL_TOKENS
    end = tok.encoder["<|endoftext|>"]
    assert int(ids[2, -1]) == end  # truncated to 77 with the end token kept last
    assert tok.clean("  Caf\u00c3\u00a9 &amp;lt;b&amp;gt;\tX  ") == "café <b> x"  # ftfy, double unescape, spaces, lower


def test_letterbox_preprocessing():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (300, 517, 3), dtype=np.uint8)  # h=300, w=517: scale 224/517
    x = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    new_h = round(300 * (224 / 517.0))  # 130
    resized = F.interpolate(x[None], size=(new_h, 224), mode="bicubic", align_corners=False, antialias=True)[0]
    canvas = torch.zeros(3, 224, 224)
    top = (224 - new_h) // 2
    canvas[:, top:top + new_h, :] = resized
    expected = (canvas - torch.tensor(OPENAI_MEAN)[:, None, None]) / torch.tensor(OPENAI_STD)[:, None, None]
    assert torch.allclose(hps_pixels(Image.fromarray(array)), expected, atol=1e-6)
    # a 224 x 224 image is only normalised; the padding is black (0 before normalisation)
    square = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    got = hps_pixels(Image.fromarray(square)) * torch.tensor(OPENAI_STD)[:, None, None] \
        + torch.tensor(OPENAI_MEAN)[:, None, None]
    assert torch.allclose(got, torch.from_numpy(square).permute(2, 0, 1).float() / 255, atol=1e-6)
    tall = hps_pixels(Image.fromarray(rng.integers(0, 256, (448, 100, 3), dtype=np.uint8)))
    black = (torch.zeros(3) - torch.tensor(OPENAI_MEAN)) / torch.tensor(OPENAI_STD)
    assert torch.allclose(tall[:, :, 0], black[:, None].expand(3, 224), atol=1e-6)


def test_open_clip_layout_round_trip_and_strict_loading(tiny_hps, tmp_path):
    raw = torch.load(tiny_hps["checkpoint"], weights_only=True)
    state = raw["state_dict"]
    assert all(v.dtype == torch.float16 for v in state.values())
    assert "visual.transformer.resblocks.1.attn.in_proj_weight" in state and "text_projection" in state
    back = ours_to_open_clip(open_clip_to_ours(state))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    model = load_hps_clip(tiny_hps["checkpoint"])
    assert torch.equal(model.text_projection.weight.half(), state["text_projection"].t())

    broken = dict(state)
    del broken["transformer.resblocks.0.mlp.c_fc.bias"]
    torch.save({"state_dict": broken}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="transformer.resblocks.0.mlp.c_fc.bias"):
        load_hps_clip(tmp_path / "missing.pt")
    extra = dict(state)
    extra["visual.head.weight"] = torch.zeros(2)
    torch.save({"state_dict": extra}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match="visual.head.weight"):
        load_hps_clip(tmp_path / "extra.pt")


def test_versions_folders_and_errors(tiny_hps, tmp_path):
    # version picks the file in a folder: v2.0 is HPS_v2_compressed.pt
    with pytest.raises(FileNotFoundError, match="HPS_v2_compressed.pt"):
        HPSv2(model_name_or_path=str(tiny_hps["folder"]), tokenizer_name_or_path=str(tiny_hps["tokenizer"]),
              version="v2.0", device="cpu").load()
    folder = HPSv2(model_name_or_path=str(tiny_hps["folder"]), tokenizer_name_or_path=str(tiny_hps["tokenizer"]),
                   device="cpu", dtype="bfloat16")
    assert folder(PROMPTS[:1], _images()[:1]) == pytest.approx(OFFICIAL_SCORES[:1], abs=0.05)
    with pytest.raises(ValueError, match="version"):
        HPSv2(version="v3")
    small_vocab = tmp_path / "tok"
    small_vocab.mkdir()
    (small_vocab / "vocab.json").write_text(json.dumps({"a</w>": 0, "<|startoftext|>": 5000,
                                                        "<|endoftext|>": 5001}))
    (small_vocab / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="vocabulary"):
        HPSv2(model_name_or_path=str(tiny_hps["checkpoint"]), tokenizer_name_or_path=str(small_vocab),
              device="cpu").load()


def test_head_counts_from_arguments_or_open_clip_config(tiny_hps, tmp_path):
    state = torch.load(tiny_hps["checkpoint"], weights_only=True)
    torch.save(state, tmp_path / "HPS_v2.1_compressed.pt")
    default = load_hps_clip(tmp_path / "HPS_v2.1_compressed.pt")
    assert (default.config.vision_config.num_attention_heads, default.config.text_config.num_attention_heads) == (2, 2)
    given = load_hps_clip(tmp_path / "HPS_v2.1_compressed.pt", heads=(4, None))
    assert (given.config.vision_config.num_attention_heads, given.config.text_config.num_attention_heads) == (4, 2)
    (tmp_path / "open_clip_config.json").write_text(json.dumps(
        {"model_cfg": {"vision_cfg": {"width": 160, "head_width": 40}, "text_cfg": {"heads": 8}}}))
    found = load_hps_clip(tmp_path / "HPS_v2.1_compressed.pt")
    assert (found.config.vision_config.num_attention_heads, found.config.text_config.num_attention_heads) == (4, 8)
    reward = HPSv2(model_name_or_path=str(tmp_path), tokenizer_name_or_path=str(tiny_hps["tokenizer"]),
                   device="cpu", vision_heads=2, text_heads=2)  # the arguments win over the file
    assert reward(PROMPTS, _images()) == pytest.approx(OFFICIAL_SCORES, abs=2e-6)
