"""`geneval2` (Soft-TIFA) on the tiny random-weight Qwen3-VL judge in the official layout (flowgrpo.testing).

``OFFICIAL_SCORE_LISTS`` and the two ``OFFICIAL_*_TOTAL`` numbers are the outputs of GenEval2's own
``evaluation.py`` (facebookresearch/GenEval2 at commit a6e82d2, run unmodified with ``--method soft_tifa_am`` and
``soft_tifa_gm``: the ``--output_file`` score lists and the printed ``Score``) on the prompts of
data/geneval2_sample.jsonl (written here in the official format) and the images of `_image`, with the tiny judge in
place of ``Qwen/Qwen3-VL-8B-Instruct`` (an offline hub cache under that id), in a separate environment with
transformers 4.57.0 (the version GenEval2's README installs), torch 2.13.0 CPU, torchvision 0.28.0, scipy 1.17.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import RewardSet, get_reward, list_rewards
from flowgrpo.rewards.geneval2 import GenEval2Reward, answer_forms, soft_tifa_mean
from flowgrpo.testing.tiny_geneval2 import cached_tiny_geneval2_path

SAMPLE = Path(__file__).parent / "data" / "geneval2_sample.jsonl"
SIZES = [(64, 64), (64, 96), (96, 64)]  # (height, width): multiples of the judge's 32-pixel patch windows

OFFICIAL_SCORE_LISTS = [
    [8.872022497286025e-05, 0.00030922040377845406, 0.0005088805905870686, 0.00047936937289705384,
     0.000578815169774316],
    [0.0012252333232254387, 0.00031094424252842146, 0.00019888744191121077],
    [0.0009747721804842513, 0.0003541541318554664, 0.0003345316076774907],
]
OFFICIAL_AM_TOTAL = 0.05086140427653479  # "Score:" printed for soft_tifa_am (100 x mean over prompts)
OFFICIAL_GM_TOTAL = 0.04131540098437467  # ... and for soft_tifa_gm

# The same run on images the processor resizes (sizes not multiples of the 32-pixel windows): with torchvision the
# official processor resizes them with torch's uint8 bicubic kernel. PIL's bicubic (the processor's backend when
# transformers lacks torchvision) scored these up to 2.9e-3 away; the reward resizes with torch's kernel first.
RESIZED_SIZES = [(50, 70), (45, 100), (90, 60)]  # -> 64x64, 32x96, 96x64
OFFICIAL_RESIZED_SCORE_LISTS = [
    [9.369057821118076e-05, 0.00030262984114415303, 0.0004890073753358593, 0.0005128810271344264,
     0.0006058085039057914],
    [0.001061759873664414, 0.0004549352192952938, 0.00026594352812026045],
    [0.000980829447087217, 0.0004370529600237205, 0.00044074006541450217],
]
OFFICIAL_RESIZED_AM_TOTAL = 0.053818572100491714
OFFICIAL_RESIZED_GM_TOTAL = 0.047159405887552415


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 3 + seed * 40) % 256, (y * 4) % 256, ((x + y) * 2 + seed * 17) % 256], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def judge():
    return str(cached_tiny_geneval2_path())


@pytest.fixture(scope="module")
def rows():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def _images():
    return [_image(i + 1, *size) for i, size in enumerate(SIZES)]


def _reward(judge, **kwargs) -> GenEval2Reward:
    return get_reward("geneval2", **{"model_name_or_path": judge, "device": "cpu", "dtype": "float32", **kwargs})


def test_answer_forms_are_the_official_ones():
    assert answer_forms("How many apples are in the image?", "three") == [
        "three", "Three", " three", " Three", "3", " 3"]
    assert answer_forms("How many birds are in the image?", "eleven")[-2:] == ["other", " other"]
    assert answer_forms("Are the apples red?", "Yes") == ["Yes", "yes", " yes", " Yes"]
    assert answer_forms("Is it red?", "No") == ["Yes", "yes", " yes", " Yes"]  # the official code ignores the answer
    assert answer_forms("how many dogs?", "two") == ["Yes", "yes", " yes", " Yes"]  # "How many" is case-sensitive


def test_first_token_of_a_spaced_digit_is_the_space(judge):
    """The official ``tokenizer.encode(form)[0]``: with Qwen's pre-tokenizer " 3" is [space, "3"], so the bare space's
    probability is what the form adds."""
    tokenizer = _reward(judge).load()[1].tokenizer
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" 3"))[0] == "Ġ"


def test_question_scores_are_the_official_ones(judge, rows):
    for batch_size in (1, 5):
        scores = _reward(judge, batch_size=batch_size).question_scores(_images(), [r["vqa_list"] for r in rows])
        assert [len(s) for s in scores] == [len(s) for s in OFFICIAL_SCORE_LISTS]
        flat, official = np.concatenate(scores), np.concatenate(OFFICIAL_SCORE_LISTS)
        assert np.allclose(flat, official, rtol=1e-4, atol=0), (batch_size, flat, official)
    am = [soft_tifa_mean(s, "arithmetic") for s in OFFICIAL_SCORE_LISTS]
    gm = [soft_tifa_mean(s, "geometric") for s in OFFICIAL_SCORE_LISTS]
    assert 100 * sum(am) / len(am) == pytest.approx(OFFICIAL_AM_TOTAL, rel=1e-12)
    assert 100 * sum(gm) / len(gm) == pytest.approx(OFFICIAL_GM_TOTAL, rel=1e-12)


def test_resized_images_score_as_the_official_torchvision_processor(judge, rows):
    images = [_image(i + 1, *size) for i, size in enumerate(RESIZED_SIZES)]
    scores = _reward(judge, batch_size=5).question_scores(images, [r["vqa_list"] for r in rows])
    flat, official = np.concatenate(scores), np.concatenate(OFFICIAL_RESIZED_SCORE_LISTS)
    assert np.allclose(flat, official, rtol=1e-5, atol=0), (flat, official)  # measured: 1.7e-6
    for aggregation, total in (("arithmetic", OFFICIAL_RESIZED_AM_TOTAL), ("geometric", OFFICIAL_RESIZED_GM_TOTAL)):
        ours = 100 * np.mean([soft_tifa_mean(s, aggregation) for s in scores])
        assert ours == pytest.approx(total, rel=1e-5)


def test_resize_is_torchs_uint8_kernel_and_the_processor_keeps_it(judge):
    import torch

    from flowgrpo.rewards.vlm_models import resize_like_torchvision_processor

    processor = _reward(judge).load()[1]
    image = _image(1, 50, 70)
    resized = resize_like_torchvision_processor(image, processor.image_processor)
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)[None]
    expected = torch.nn.functional.interpolate(pixels, size=(64, 64), mode="bicubic", align_corners=False,
                                               antialias=True)[0].permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(resized), expected)
    again = resize_like_torchvision_processor(resized, processor.image_processor)
    assert np.array_equal(np.asarray(again), np.asarray(resized))  # a size the processor picks is kept
    grid = processor.image_processor(images=[resized], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 64 / 16 patches a side: the processor kept the size


def test_geometric_mean_is_scipys():
    scipy_stats = pytest.importorskip("scipy.stats")
    for scores in ([0.2, 0.5, 0.9], [1e-4, 0.3], [0.0, 0.5], [0.7]):
        with np.errstate(divide="ignore"):
            assert soft_tifa_mean(scores, "geometric") == pytest.approx(float(scipy_stats.gmean(scores)), rel=1e-12)
    assert soft_tifa_mean([0.2, 0.5, 0.9]) == pytest.approx(1.6 / 3)


def test_reward_reads_vqa_list_and_aggregates(judge, rows):
    prompts, vqa = [r["prompt"] for r in rows], [r["vqa_list"] for r in rows]
    result = RewardSet([_reward(judge)], ["geneval2"])(prompts, _images(), vqa_list=vqa)
    am = [soft_tifa_mean(s) for s in OFFICIAL_SCORE_LISTS]
    gm = [soft_tifa_mean(s, "geometric") for s in OFFICIAL_SCORE_LISTS]
    assert result.per_reward["geneval2"] == pytest.approx(am, rel=1e-4)
    assert result.metrics["geneval2/soft_tifa_gm"] == pytest.approx(gm, rel=1e-4)
    geometric = _reward(judge, aggregation="geometric")(prompts[:1], _images()[:1], vqa_list=[json.dumps(vqa[0])])
    assert geometric == pytest.approx(gm[:1], rel=1e-4)  # a JSON string column works too


def test_bad_input_is_named(judge):
    with pytest.raises(ValueError, match="aggregation"):
        GenEval2Reward(aggregation="harmonic")
    with pytest.raises(ValueError, match="vqa_list"):
        _reward(judge)(["a cat"], [_image(1, 64, 64)])
    with pytest.raises(ValueError, match=r"\[question, answer\] pairs"):
        _reward(judge)(["a cat"], [_image(1, 64, 64)], vqa_list=[[["only a question"]]])
    with pytest.raises(ValueError, match="empty vqa_list"):
        _reward(judge)(["a cat"], [_image(1, 64, 64)], vqa_list=[[]])


def test_served_behind_the_reward_server(judge, rows):
    from flowgrpo.rewards.server import serve

    server = serve({"geneval2": _reward(judge)}, port=0, token="")
    try:
        remote = get_reward("remote", url=server.url, reward_name="geneval2")
        scores = remote([r["prompt"] for r in rows[:2]], _images()[:2], vqa_list=[r["vqa_list"] for r in rows[:2]])
    finally:
        server.shutdown()
    assert scores == pytest.approx([soft_tifa_mean(s) for s in OFFICIAL_SCORE_LISTS[:2]], rel=1e-4)
    assert scores.metrics["soft_tifa_gm"] == pytest.approx(
        [soft_tifa_mean(s, "geometric") for s in OFFICIAL_SCORE_LISTS[:2]], rel=1e-4)


def test_registered():
    assert "geneval2" in list_rewards()
