"""`videoalign` on the tiny random-weight VideoReward checkpoint in the official layout (flowgrpo.testing).

The pinned ``OFFICIAL_*`` scores are the outputs of the official inference code, ``VideoVLMRewardInference.reward``
of KwaiVGI/VideoAlign at commit 219ab9d, run on this tiny checkpoint in a separate environment with the versions the
repository was released with where they install here: transformers 4.45.2, peft 0.10.0, trl 0.8.6, accelerate 0.34.0,
decord 0.6.0, numpy 1.26.4, pillow 10.2.0 (torch 2.13.0 CPU and torchvision 0.28.0 in place of torch 2.3.1 /
torchvision 0.18.1, whose builds for this Python need CUDA), float32 on the CPU, SDPA attention instead of
flash-attention 2 (CPU). The official code read the MP4 files in tests/rewards/data with decord; for the frames
without the round trip, decord's ``VideoReader`` was replaced by one serving the raw frames of `_video` at the given
frame rate, everything after it official. The environment cannot run beside this library (transformers 4.45), so
the scores are pinned here.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import RewardSet, get_reward, list_rewards
from flowgrpo.rewards.video_io import decode_mp4, encode_mp4
from flowgrpo.rewards.videoalign import (
    VIDEOALIGN_PROMPT,
    VideoAlignReward,
    convert_videoalign_state_dict,
    sample_frame_indices,
    smart_nframes,
    videoalign_prompt,
)
from flowgrpo.testing.tiny_videoreward import cached_tiny_videoreward_path

DATA = Path(__file__).parent / "data"
PROMPTS = ["a red ball bouncing on a wooden floor", "two cats playing in the snow, slow motion"]

#: Official scores (VQ, MQ, TA) of videos a and b (see the module docstring), normalised unless named raw.
OFFICIAL_MP4_8FPS = [[-1.8181541, -2.8050136, -1.6765078], [-1.3321376, -3.4729448, -1.7993896]]
OFFICIAL_MP4_8FPS_RAW = [[-0.4107831, -2.7094042, -1.4010552], [0.6815876, -3.6318841, -1.7097466]]
OFFICIAL_MP4_16FPS = [[-1.7608294, -3.0463035, -1.67821], [-1.8128217, -2.9450611, -1.5886302]]
OFFICIAL_FRAMES_8FPS = [[-1.8995405, -2.77287, -1.6694912], [-1.3117207, -3.3799379, -1.7823875]]
OFFICIAL_FRAMES_16FPS = [[-1.8995405, -2.77287, -1.6694919], [-1.9640943, -2.8413547, -1.6189421]]
#: sha256 of the official DETAILED_PROMPT_WITH_SPECIAL_TOKEN (prompt_template.py) and of build_prompt("a cat", ...).
OFFICIAL_TEMPLATE_SHA256 = "fdb6309bac618dd0c8b1b589d3a0970a974f7856eecbb355a190b2dce54af700"
OFFICIAL_PROMPT_SHA256 = "3c8e9026e357f4015e5f12406667aa8dffa7cb4222a800e74f87bd9655c3f1f0"


def _video(seed: int, frames: int, height: int, width: int) -> list[Image.Image]:
    """The fixed test video: colour ramps moving over time plus noise (the frames the MP4s were made from)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for t in range(frames):
        base = np.stack([(x * 4 + t * 9) % 256, (y * 5 + t * 6) % 256, ((x + y) * 3 + t * 2) % 256], -1)
        out.append(Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)))
    return out


VIDEOS = {"a": (1, 9, 48, 64), "b": (2, 33, 40, 56)}


@pytest.fixture(scope="module")
def tiny_videoreward():
    return cached_tiny_videoreward_path()


def _reward(tiny, **kwargs) -> VideoAlignReward:
    options = dict(model_name_or_path=str(tiny / "videoreward"), base_model_name_or_path=str(tiny / "base"),
                   device="cpu", dtype="float32")
    return get_reward("videoalign", **{**options, **kwargs})


def _triples(scores):
    return [[s["VQ"], s["MQ"], s["TA"]] for s in scores]


def test_prompt_template_is_the_official_one_byte_for_byte():
    assert hashlib.sha256(VIDEOALIGN_PROMPT.encode()).hexdigest() == OFFICIAL_TEMPLATE_SHA256
    assert hashlib.sha256(videoalign_prompt("a cat").encode()).hexdigest() == OFFICIAL_PROMPT_SHA256
    assert "**Visual Quality:**  \n" in VIDEOALIGN_PROMPT and "possible. \n" in VIDEOALIGN_PROMPT  # trailing spaces


def test_frame_sampling_follows_the_container_frame_rate():
    assert smart_nframes(33, 8.0) == 8 and smart_nframes(33, 16.0) == 4  # why fps matters
    assert smart_nframes(81, 16.0) == 10 and smart_nframes(9, 8.0) == 4 and smart_nframes(3, 8.0) == 2
    assert smart_nframes(33, 8.0, num_frames=7) == 8  # num_frames rounds to even (half to even: 3.5 -> 4)
    assert sample_frame_indices(33, 8.0) == [0, 5, 9, 14, 18, 23, 27, 32]
    assert sample_frame_indices(9, 8.0) == [0, 3, 5, 8]
    with pytest.raises(ValueError, match="at least 2"):
        smart_nframes(1, 8.0)


def test_checkpoint_layout_merges_the_lora_and_maps_the_keys(tiny_videoreward):
    state = torch.load(tiny_videoreward / "videoreward" / "checkpoint-42" / "model.pth", weights_only=True)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert {f"{q}.base_layer.weight", f"{q}.base_layer.bias", f"{q}.lora_A.default.weight",
            f"{q}.lora_B.default.weight", "base_model.model.rm_head.weight", "base_model.model.lm_head.weight"} <= set(state)
    assert any(k.startswith("base_model.model.visual.") for k in state)
    plain = convert_videoalign_state_dict(state, lora_scale=16 / 8)
    merged = plain["model.language_model.layers.0.self_attn.q_proj.weight"]
    expected = state[f"{q}.base_layer.weight"] + 2.0 * state[f"{q}.lora_B.default.weight"] @ state[f"{q}.lora_A.default.weight"]
    assert torch.allclose(merged, expected, atol=1e-6) and not torch.allclose(merged, state[f"{q}.base_layer.weight"])
    assert "lm_head.weight" not in plain and plain["rm_head.weight"].shape == (1, 32)
    assert not any(".lora_" in k or "base_layer" in k for k in plain)
    with pytest.raises(ValueError, match="incomplete"):
        convert_videoalign_state_dict({k: v for k, v in state.items() if not k.endswith("lora_B.default.weight")}, 2.0)
    with pytest.raises(ValueError, match="unexpected keys"):
        convert_videoalign_state_dict({"text_model.weight": torch.zeros(1)}, 2.0)


def test_official_mp4_files_score_as_the_official_code_scores_them(tiny_videoreward):
    reward = _reward(tiny_videoreward)
    for fps, official in ((8, OFFICIAL_MP4_8FPS), (16, OFFICIAL_MP4_16FPS)):
        files = [DATA / f"videoalign_{name}_{fps}fps.mp4" for name in ("a", "b")]
        assert [decode_mp4(f.read_bytes())[1] for f in files] == [fps, fps]
        ours = _triples(reward.dimension_scores_of_mp4(PROMPTS, files))
        assert np.allclose(ours, official, rtol=1e-4, atol=0), (fps, ours, official)
    raw = _reward(tiny_videoreward, use_norm=False)
    files = [DATA / f"videoalign_{name}_8fps.mp4" for name in ("a", "b")]
    assert np.allclose(_triples(raw.dimension_scores_of_mp4(PROMPTS, files)), OFFICIAL_MP4_8FPS_RAW, rtol=1e-4, atol=0)


def test_frames_score_as_the_official_code_scores_them(tiny_videoreward):
    videos = [_video(*VIDEOS["a"]), _video(*VIDEOS["b"])]
    for fps, official in ((8, OFFICIAL_FRAMES_8FPS), (16, OFFICIAL_FRAMES_16FPS)):
        ours = _triples(_reward(tiny_videoreward, fps=fps, through_mp4=False).dimension_scores(PROMPTS, videos))
        assert np.allclose(ours, official, rtol=1e-4, atol=0), (fps, ours, official)


def test_through_mp4_encodes_as_the_official_inputs_were_made_and_scores_them(tiny_videoreward):
    """The round trip is deterministic and gives the bytes the official code was fed, so in training the reward is
    the official score of the video written at ``fps``."""
    frames = _video(*VIDEOS["b"])
    data = encode_mp4(frames, 8.0)
    assert data == encode_mp4(frames, 8.0)
    # the container names the muxer's version ("Lavf62.12.102"), which changes with every PyAV wheel; the frames'
    # bytes (x264's settings and output) must not
    assert _muxer_named_alike(data) == _muxer_named_alike((DATA / "videoalign_b_8fps.mp4").read_bytes()), \
        "this PyAV's x264 encodes differently"
    reward = _reward(tiny_videoreward, fps=8)
    result = RewardSet([reward], ["videoalign"])(PROMPTS, [_video(*VIDEOS["a"]), frames])
    vq_mq_ta = np.array([result.metrics[f"videoalign/{d}"] for d in ("VQ", "MQ", "TA")]).T
    assert np.allclose(vq_mq_ta, OFFICIAL_MP4_8FPS, rtol=1e-4, atol=0)
    assert result.per_reward["videoalign"] == pytest.approx(vq_mq_ta.sum(1), rel=1e-6)  # Overall
    single = _reward(tiny_videoreward, fps=8, dimensions=["VQ", "TA"])(PROMPTS[1:], [frames])
    assert single[0] == pytest.approx(OFFICIAL_MP4_8FPS[1][0] + OFFICIAL_MP4_8FPS[1][2], rel=1e-4)


def _muxer_named_alike(data: bytes) -> bytes:
    """``data`` with the libavformat version in its encoder tag written as zeros of the same length."""
    return re.sub(rb"Lavf[0-9.]+", lambda m: b"Lavf" + b"0" * (len(m.group()) - 4), data)


def test_bad_options_are_named_before_loading(monkeypatch):
    with pytest.raises(ValueError, match="dimensions"):
        VideoAlignReward(dimensions=["VQ", "Motion"])
    with pytest.raises(ValueError, match="Overall"):
        VideoAlignReward(dimensions=["Overall", "VQ"])
    with pytest.raises(ValueError, match="fps"):
        VideoAlignReward(fps=0)
    with pytest.raises(ValueError, match="even frame sides"):
        encode_mp4([Image.new("RGB", (33, 32))] * 2, 8.0)
    import builtins

    real_import = builtins.__import__

    def no_av(name, *args, **kwargs):
        if name == "av":
            raise ImportError("No module named 'av'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_av)
    with pytest.raises(ImportError, match=r"flowgrpo\[video\]"):
        VideoAlignReward()
    VideoAlignReward(through_mp4=False)  # frames without the round trip need no PyAV


def test_checkpoint_errors_are_named(tiny_videoreward, tmp_path):
    with pytest.raises(FileNotFoundError, match="model_config.json"):
        _reward(tiny_videoreward, model_name_or_path=str(tmp_path), through_mp4=False).load()
    with pytest.raises(FileNotFoundError, match="checkpoint-7"):
        _reward(tiny_videoreward, checkpoint_step=7).load()


def test_served_behind_the_reward_server(tiny_videoreward):
    from flowgrpo.rewards.server import serve

    frames = [_video(*VIDEOS["a"]), _video(*VIDEOS["b"])]
    server = serve({"videoalign": _reward(tiny_videoreward, fps=8)}, port=0, token="")
    try:
        remote = get_reward("remote", url=server.url, reward_name="videoalign", accepts_video=True)
        result = RewardSet([remote], ["videoalign"])(PROMPTS, frames)
    finally:
        server.shutdown()
    assert result.per_reward["videoalign"] == pytest.approx([sum(v) for v in OFFICIAL_MP4_8FPS], rel=1e-4)
    assert result.metrics["videoalign/VQ"] == pytest.approx([v[0] for v in OFFICIAL_MP4_8FPS], rel=1e-4)


def test_registered():
    assert "videoalign" in list_rewards()
