"""``reward_offload``: model rewards keep their weights on the CPU between scorings (`RewardSet(offload=True)`).

On this CPU machine the reward device is the CPU, so the tests check the protocol (moved to the reward device
before each call, back to the CPU after it, scores unchanged, rewards without weights untouched); the CUDA test
checks the memory itself where a GPU is present.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import resolve_reward_funcs
from flowgrpo.rewards.clip_scorers import CLIPScore
from flowgrpo.rewards.hpsv2 import HPSv2
from flowgrpo.rewards.placement import OffloadableReward, supports_offload
from flowgrpo.testing.tiny_rewards import save_tiny_hpsv2


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    return save_tiny_hpsv2(tmp_path_factory.mktemp("tiny-hps-offload"), seed=1)


def _batch():
    rng = np.random.default_rng(0)
    return ["a red cat", "a dog"], [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
                                    for _ in range(2)]


def _brightness(prompts, images, **columns):
    return [float(np.asarray(im).mean()) for im in images]


def test_offload_moves_weights_around_each_call(tiny_hps):
    kwargs = dict(model_name_or_path=str(tiny_hps["checkpoint"]), tokenizer_name_or_path=str(tiny_hps["tokenizer"]),
                  reward_device="cpu")
    plain = resolve_reward_funcs(["hpsv2"], reward_kwargs={"hpsv2": kwargs})
    offloaded = resolve_reward_funcs(["hpsv2", _brightness], reward_kwargs={"hpsv2": kwargs}, offload=True)
    reward = offloaded.funcs[0]
    assert isinstance(reward, OffloadableReward) and supports_offload(reward)
    assert not supports_offload(_brightness) and not supports_offload(HPSv2)
    assert not reward.loaded  # nothing loads before the first scoring

    moves = []
    original_to, original_offload = reward.to, reward.offload
    reward.to = lambda device=None: (moves.append(("to", device)), original_to(device))[1]
    reward.offload = lambda: (moves.append(("offload", None)), original_offload())[1]
    prompts, images = _batch()
    first = offloaded(prompts, images)
    second = offloaded(prompts, images)
    assert moves == [("to", None), ("offload", None)] * 2
    assert first.per_reward["hpsv2"] == second.per_reward["hpsv2"] == pytest.approx(
        plain(prompts, images).per_reward["hpsv2"], abs=1e-6)
    assert all(p.device.type == "cpu" for p in reward.load().parameters())
    # A direct call after offload() scores where the weights are.
    reward.offload()
    assert reward(prompts, images) == pytest.approx(first.per_reward["hpsv2"], abs=1e-6)


def test_clip_scorers_offer_the_protocol():
    scorer = CLIPScore(model_id="unused", reward_device="cpu")
    assert supports_offload(scorer)
    scorer.offload()  # nothing loaded yet: nothing to do, nothing downloaded
    with pytest.raises(ValueError, match="disagree"):
        CLIPScore(model_id="unused", device="cpu", reward_device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_frees_accelerator_memory(tiny_hps):
    reward_set = resolve_reward_funcs(["hpsv2"], reward_kwargs={"hpsv2": dict(
        model_name_or_path=str(tiny_hps["checkpoint"]), tokenizer_name_or_path=str(tiny_hps["tokenizer"]),
        reward_device="cuda")}, offload=True)
    prompts, images = _batch()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    scores = reward_set(prompts, images).per_reward["hpsv2"]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    reward = reward_set.funcs[0]
    assert all(p.device.type == "cpu" for p in reward.load().parameters())
    reward.to()
    assert all(p.device.type == "cuda" for p in reward.load().parameters())
    assert reward(prompts, images) == pytest.approx(scores, abs=1e-4)


def test_rewards_are_registered():
    from flowgrpo.rewards import list_rewards

    assert {"imagereward", "hpsv2", "image_similarity", "pickscore_rank"} <= set(list_rewards())


def test_each_model_reward_keeps_its_default_dtype():
    """One placement code path (`ModelReward`) for every model reward; the default dtype stays per reward: the VLM
    rewards bfloat16 on CUDA and float32 on the CPU, the others float32 (nothing loads to tell)."""
    from flowgrpo.rewards.deqa import DeQAScore
    from flowgrpo.rewards.hpsv3 import HPSv3Reward
    from flowgrpo.rewards.imagereward import ImageReward
    from flowgrpo.rewards.placement import ModelReward
    from flowgrpo.rewards.unifiedreward import UnifiedReward
    from flowgrpo.rewards.vqascore import VQAScore

    vlm = [VQAScore, DeQAScore, HPSv3Reward, lambda **kw: UnifiedReward(backend="transformers", **kw)]
    for make in vlm:
        assert isinstance(make(device="cpu"), ModelReward)
        assert make(device="cpu").dtype == torch.float32 and make(reward_device="cuda:1").dtype == torch.bfloat16
        assert make(device="cuda", dtype="fp16").dtype == torch.float16
        with pytest.raises(ValueError, match="'float64x' is not a torch dtype"):
            make(dtype="float64x")  # refused when the reward is made, before any weights load
    for make in (ImageReward, HPSv2):
        assert make(device="cuda").dtype == torch.float32
    with pytest.raises(ValueError, match="disagree"):
        HPSv3Reward(device="cpu", reward_device="cuda")
