"""`editreward` on a tiny random EditReward checkpoint in the official layout (`flowgrpo.testing.tiny_editreward`).

The scores pinned in `test_scores_match_the_official_code` were computed by the official code
(``TIGER-AI-Lab/EditReward`` at commit edb027e, ``EditReward.inference_edit.EditRewardInferencer`` with
``rm_head_type="ranknet_multi_head"``, the Qwen2.5-VL-7B config with this tiny base, float32 on CPU) in a throwaway
environment pinned to its release: transformers 4.57.0, trl 0.8.6, peft 0.17.1, accelerate 1.10.1, torch 2.13.0
(CPU; the release names torch 2.5.1, whose CPU wheel is not available here), numpy 2.4.6, pillow 13.0.0. That
environment has no loadable torchvision (PyPI's wheels are CUDA builds), so its Qwen2.5-VL processor was built from
transformers 4.57's own image processor, tokenizer and chat template without the video processor; torchvision is
never called on EditReward's image path. Our scores agree with them within 7.3e-7 (relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import RewardOutput, get_reward, list_rewards
from flowgrpo.rewards.editreward import (
    EDITREWARD_FOLLOWING_INSTRUCTION,
    EDITREWARD_QUALITY_INSTRUCTION,
    EDITREWARD_REWARD_SUFFIX,
    EDITREWARD_REWARD_TOKEN,
    EditReward,
    convert_editreward_state_dict,
    editreward_text,
    sequential_positions,
)
from flowgrpo.testing.tiny_editreward import save_tiny_editreward

SMALL = 56 * 56  # 4 merged image tokens per image: keeps the other tests' sequences short

#: mu of the official EditRewardInferencer on `_official_inputs` (batch of 3, right-padded), see the module docstring
OFFICIAL_MU = [20.776329040527344, 21.131553649902344, 13.007491111755371]
OFFICIAL_PROMPTS = ["make the sky blue", "add a small red ball on the left side of the table", "remove the text"]


def _official_inputs():
    """The fixed (sources, edited) images the official code scored: noise, a gradient and flat colours."""
    rng = np.random.default_rng(20261127)

    def noise(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    grad = np.linspace(0, 255, 100, dtype=np.float64)[None, :, None] * np.ones((60, 1, 3))
    sources = [noise(80, 64), Image.fromarray(grad.astype(np.uint8)), Image.new("RGB", (50, 50), (200, 30, 40))]
    edited = [noise(72, 72), noise(64, 96), Image.new("RGB", (40, 60), (20, 30, 220))]
    return sources, edited


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_editreward(tmp_path_factory.mktemp("editreward"))


def _reward(checkpoint, **kwargs):
    return get_reward("editreward", model_name_or_path=str(checkpoint["checkpoint"]),
                      base_model_name_or_path=str(checkpoint["base"]), device="cpu", dtype="float32", **kwargs)


def test_scores_match_the_official_code(checkpoint):
    assert "editreward" in list_rewards()
    reward = _reward(checkpoint)
    sources, edited = _official_inputs()
    out = reward(OFFICIAL_PROMPTS, edited, image=sources)
    assert isinstance(out, RewardOutput)
    assert list(out) == pytest.approx(OFFICIAL_MU, rel=1e-4)
    # the score is the mean of the two heads' mu, each reported as a metric
    assert [(f + q) / 2 for f, q in zip(out.metrics["following"], out.metrics["quality"])] == pytest.approx(list(out))


def test_prompts_heads_and_positions_are_the_official_ones(checkpoint):
    text = editreward_text("add a hat", "following")
    assert text == EDITREWARD_FOLLOWING_INSTRUCTION.format(text_prompt="add a hat") + EDITREWARD_REWARD_SUFFIX
    assert text.endswith("Text instruction - add a hat\n\nPlease provide the overall ratings of this image: "
                         "<|Reward|>\n\nEND\n")
    assert "**Visual Quality & Realism**" in editreward_text("x", "quality")
    assert EDITREWARD_QUALITY_INSTRUCTION.count("{text_prompt}") == 1
    with pytest.raises(ValueError, match="dimension"):
        editreward_text("x", "overall")

    reward = _reward(checkpoint, min_pixels=SMALL, max_pixels=SMALL)
    model, processor = reward.load()
    sources = [Image.new("RGB", (64, 64), "red")]
    edited = [Image.new("RGB", (64, 64), "blue")]
    batch = reward.inputs(["make it blue"], sources, edited, "following")
    ids = batch["input_ids"][0].tolist()
    assert ids.count(processor.tokenizer.convert_tokens_to_ids(EDITREWARD_REWARD_TOKEN)) == 1
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_pad) == 2 * 4  # two images of 4 merged tokens, source first
    decoded = processor.tokenizer.decode(batch["input_ids"][0])
    assert decoded.index("<|vision_start|>") < decoded.index("You are tasked")

    # sequential positions (what the official forward gets) score differently from Qwen2.5-VL's own 3-D positions
    mask = batch["attention_mask"]
    assert torch.equal(sequential_positions(mask)[0, 0], torch.arange(mask.shape[1]))
    with torch.no_grad():
        ours = model.head_outputs(0, **batch)[0, 0]
        hidden_3d = model.model(**batch).last_hidden_state
        at = batch["input_ids"][0] == model.reward_token_id
        theirs_3d = model.rm_heads["head_0"](hidden_3d[0][at].float())[0, 0]
    assert abs(float(ours) - float(theirs_3d)) > 1e-4


def test_batching_padding_and_mu_not_log_sigma(checkpoint):
    reward = _reward(checkpoint, min_pixels=SMALL, max_pixels=SMALL, batch_size=2)
    sources, edited = _official_inputs()
    prompts = OFFICIAL_PROMPTS
    together = list(reward(prompts, edited, image=sources))
    alone = [reward([p], [e], image=[s])[0] for p, s, e in zip(prompts, sources, edited)]
    assert together == pytest.approx(alone, rel=1e-4, abs=1e-4)  # right padding does not change a score
    assert max(together) - min(together) > 1e-3  # the inputs matter
    # the second head output (log sigma) is not what is returned
    with torch.no_grad():
        heads = reward.head_scores(prompts, sources, edited)
    assert together == pytest.approx(heads[:, :, 0].mean(dim=1).tolist(), rel=1e-5)
    assert heads[:, :, 1].mean(dim=1).tolist() != pytest.approx(together, rel=1e-2)
    # a row with several source images is scored against the first
    assert reward(prompts[:1], edited[:1], image=[[sources[0], sources[1]]])[0] == pytest.approx(together[0], rel=1e-4)


def test_missing_source_images_and_bad_checkpoints_are_refused(checkpoint, tmp_path):
    reward = _reward(checkpoint, min_pixels=SMALL, max_pixels=SMALL)
    with pytest.raises(ValueError, match="no 'image' column"):
        reward(["add a hat"], [Image.new("RGB", (32, 32))])
    with pytest.raises(ValueError, match="1 source images for 2 edited"):
        reward(["a", "b"], [Image.new("RGB", (32, 32))] * 2, image=[Image.new("RGB", (32, 32))])
    with pytest.raises(ValueError, match="row 0 has no source image"):
        reward(["a"], [Image.new("RGB", (32, 32))], image=[None])
    assert not reward.loaded  # refused before anything loaded

    state = torch.load(checkpoint["checkpoint"] / "model.pth", weights_only=True)
    legacy = {("visual." + k[len("model.visual."):] if k.startswith("model.visual.") else
               "model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
              for k, v in state.items()}
    assert convert_editreward_state_dict(legacy).keys() == convert_editreward_state_dict(state).keys()
    with pytest.raises(ValueError, match="two-head"):
        convert_editreward_state_dict({"rm_head.0.weight": 0})
    partial = {k: v for k, v in state.items() if not k.startswith("rm_heads.head_1.")}
    torch.save(partial, tmp_path / "model.pth")
    broken = get_reward("editreward", model_name_or_path=str(tmp_path), base_model_name_or_path=str(checkpoint["base"]),
                        device="cpu")
    with pytest.raises(ValueError, match="missing"):
        broken.load()
    with pytest.raises(FileNotFoundError, match="model.pth"):
        EditReward(model_name_or_path=str(tmp_path / "nowhere"), device="cpu").load()
    with pytest.raises(ValueError, match="min_pixels"):
        EditReward(min_pixels=10, max_pixels=5)
