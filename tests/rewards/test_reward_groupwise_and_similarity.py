"""``pickscore_rank`` (group-wise ranks), ``image_similarity`` (CLIP image-to-image cosine) on a tiny random CLIP,
the group-wise protocol of `RewardSet` (deferred raw scores combined over whole groups), and the trainer's use of it.
"""

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from test_reward_clip import _build_tiny_clip

from flowgrpo.rewards import get_reward, resolve_reward_funcs
from flowgrpo.rewards.clip_scorers import PickScoreRank, reference_clip_pixels


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    return _build_tiny_clip(tmp_path_factory.mktemp("tiny-clip-rank"), seed=1, logit_scale=2.0)


def _images(n, seed=0, size=(40, 56)):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(n)]


def test_combine_group_ranks_ties_and_none():
    assert PickScoreRank.combine_group([3.0, 1.0, 2.0, 0.5]) == [0.75, 0.25, 0.5, 0.0]
    assert PickScoreRank.combine_group([1.0, 1.0, 0.0]) == pytest.approx([1 / 3, 2 / 3, 0.0])  # stable ties
    assert PickScoreRank.combine_group([2.0, None, 1.0, 5.0]) == [0.25, None, 0.0, 0.5]


def test_pickscore_rank_within_groups(tiny_clip_dir):
    rank = get_reward("pickscore_rank", model_id=tiny_clip_dir, processor_id=None, device="cpu")
    raw = get_reward("pickscore", model_id=tiny_clip_dir, processor_id=None, device="cpu")
    prompts = ["a cat"] * 3 + ["a dog"] * 3
    images = _images(6)
    scores = raw(prompts, images)
    groups = [0, 0, 0, 1, 1, 1]
    expected = PickScoreRank.combine_group(scores[:3]) + PickScoreRank.combine_group(scores[3:])
    assert rank(prompts, images, group_ids=groups) == expected
    assert sorted(rank(prompts, images)) == [k / 6 for k in range(6)]  # no group ids: one group

    # Deferred: micro-batches give raw scores; finish_groupwise ranks the complete groups and redoes the totals.
    reward_set = resolve_reward_funcs(["pickscore_rank", "pickscore"], reward_weights=[2.0, 0.0],
                                      reward_kwargs={"pickscore_rank": dict(model_id=tiny_clip_dir,
                                                                            processor_id=None, device="cpu"),
                                                     "pickscore": dict(model_id=tiny_clip_dir, processor_id=None,
                                                                       device="cpu")})
    assert reward_set.has_groupwise
    order = [0, 3, 1, 4, 2, 5]  # groups interleaved across micro-batches
    parts = [reward_set([prompts[i] for i in order[s:s + 2]], [images[i] for i in order[s:s + 2]],
                        defer_groupwise=True) for s in (0, 2, 4)]
    deferred = [v for p in parts for v in p.per_reward["pickscore_rank"]]
    assert deferred == pytest.approx([scores[i] for i in order], abs=1e-5)
    per_reward, total = reward_set.finish_groupwise({n: [v for p in parts for v in p.per_reward[n]]
                                                     for n in reward_set.names}, [groups[i] for i in order])
    assert per_reward["pickscore_rank"] == [expected[i] for i in order]
    assert total == pytest.approx([2.0 * expected[i] for i in order])
    direct = reward_set(prompts, images, group_ids=groups)
    assert direct.per_reward["pickscore_rank"] == expected


def test_image_similarity(tiny_clip_dir):
    sim = get_reward("image_similarity", model_id=tiny_clip_dir, device="cpu", batch_size=2)
    generated = _images(3, seed=1)
    sources = _images(2, seed=2) + [None]
    scores = sim(["p"] * 3, generated, image=sources)
    assert scores[2] is None and all(isinstance(s, float) for s in scores[:2])
    assert sim(["p"] * 2, sources[:2], image=sources[:2]) == pytest.approx([1.0, 1.0], abs=1e-5)

    # Independent computation: projected CLIP image embeddings of the reference preprocessing, cosine.
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    ip = CLIPProcessor.from_pretrained(tiny_clip_dir).image_processor

    def embed(im):
        x = reference_clip_pixels(im, 32, 32, ip.image_mean, ip.image_std)  # the tiny processor's sizes
        with torch.no_grad():
            out = model.get_image_features(pixel_values=x[None])
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return out[0] / out[0].norm()

    expected = [float(embed(g) @ embed(s)) for g, s in zip(generated[:2], sources[:2])]
    assert scores[:2] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="'image' column"):
        sim(["p"], generated[:1])


def test_reference_preprocessing_arithmetic():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (50, 81, 3), dtype=np.uint8)  # short side 50 -> 32, long int(32 * 81 / 50) = 51
    x = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    resized = torch.nn.functional.interpolate(x[None], size=(32, 51), mode="bilinear", antialias=True)[0]
    expected = resized[:, :, 10:42]  # left int(round(19 / 2)) = 10 (round half to even)
    got = reference_clip_pixels(Image.fromarray(array), 32, 32, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert torch.allclose(got, expected, atol=1e-6)


class BrightnessRank:
    """A group-wise reward without weights: ranks of mean brightness; counts its offload calls."""

    groupwise = True

    def __init__(self):
        self.moves = []

    def score_samples(self, prompts, images, **columns):
        return [float(np.asarray(im, dtype=np.float32).mean()) for im in images]

    combine_group = staticmethod(PickScoreRank.combine_group)

    def __call__(self, prompts, images, **columns):
        return PickScoreRank.combine_group(self.score_samples(prompts, images))

    def to(self, device=None):
        self.moves.append("to")
        return self

    def offload(self):
        self.moves.append("offload")


def test_trainer_ranks_whole_groups_across_micro_batches(tiny_sd3_path, tmp_path):
    from support.trainer_cases import make_trainer

    reward = BrightnessRank()
    # 4 images per prompt scored in micro-batches of 2: ranks over micro-batches would average 1/4; over the whole
    # group of 4 they average (0 + 1 + 2 + 3) / 4 / 4 = 0.375.
    trainer = make_trainer(tiny_sd3_path, tmp_path, reward=reward, per_device_train_batch_size=2,
                           num_generations=4, gradient_accumulation_steps=2, reward_offload=True,
                           dataset=Dataset.from_dict({"prompt": ["a cat", "a dog"]}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/BrightnessRank/mean" in h]
    assert logs and logs[0]["rewards/BrightnessRank/mean"] == pytest.approx(0.375)
    assert reward.moves and reward.moves == ["to", "offload"] * (len(reward.moves) // 2)
