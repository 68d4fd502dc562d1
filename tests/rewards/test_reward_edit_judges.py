"""The editing judges `editscore`, `unifiedreward_edit` and `rationalrewards_edit`: their parsers on canned answers
(malformed ones included, with each ``on_unparsable`` policy), their requests to a fake OpenAI-compatible server on
the loopback address, the in-process backend on a tiny random Qwen2.5-VL, and editing rewards behind
``flowgrpo reward-server`` (the source images travel as an image column)."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
from PIL import Image
from test_reward_vlm_judge import ChatServer

from flowgrpo.rewards import RewardOutput, get_reward
from flowgrpo.rewards.edit_judges import (
    RATIONALREWARDS_EDIT_GUIDELINE,
    RATIONALREWARDS_EDIT_SYSTEM_PROMPT,
    UNIFIEDREWARD_EDIT_FOLLOWING_PREFIX,
    UNIFIEDREWARD_EDIT_QUALITY_PROMPT,
    EditJudgeUnparsableError,
    aggregate_rational_scores,
    editscore_prompts,
    parse_editscore_answer,
    parse_rational_scores,
    parse_unifiedreward_edit_scores,
)
from flowgrpo.rewards.server import serve
from flowgrpo.testing.tiny_vlms import cached_tiny_vlm_path


def _image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _decode(url):
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


RATIONAL_ANSWER = """# User Request Analysis
The user wants a red hat.
# Detailed Judgement
1. Text Faithfulness:
## Justification: The hat is red.
## Score: 3.5
2. Image Faithfulness:
## Justification: Background kept.
## Score: 4.0
3. Physical and Visual Quality:
## Justification: Slight seam.
## Score: 2.75 (minor flaws)
4. Text Rendering:
## Justification: No text requested.
## Score: N/A
# Summary: Good edit. ## Score: 1
"""


# ---- parsers on canned answers -----------------------------------------------------------------------------------


def test_editscore_reader_repairs_json_like_the_authors():
    assert parse_editscore_answer('{"reasoning": "fine", "score": [20, 17.5]}') == [20.0, 17.5]
    assert parse_editscore_answer("Sure!\n{\n\"reasoning\" : \"ok\",\n\"score\" : [9, 25]\n}\nDone") == [9.0, 25.0]
    assert parse_editscore_answer("{'reasoning': 'single quotes', 'score': [3, 4]}") == [3.0, 4.0]
    assert parse_editscore_answer('{reasoning: "bare keys", score: [5, 6]}') == [5.0, 6.0]
    assert parse_editscore_answer('{"reasoning": "he said "wow" twice", "score": [7, 8]}') == [7.0, 8.0]
    assert parse_editscore_answer('{"reasoning": "cut off", "score": [11, 12') == [11.0, 12.0]  # last resort
    assert parse_editscore_answer('{"score": 14}') == [14.0]
    assert parse_editscore_answer("no scores at all") == []
    assert parse_editscore_answer("") == [] and parse_editscore_answer(None) == []
    sc, pq = editscore_prompts("add a hat")
    assert "From scale 0 to 25:" in sc and "Editing instruction: add a hat" in sc and "<instruction>" not in sc
    assert "first being the original" in sc and "first being the original" not in pq
    assert "25 indicates the image has no artifacts" in pq


def test_unifiedreward_edit_reader_is_pref_grpo_s():
    assert parse_unifiedreward_edit_scores('{"reasoning": "x", "score": [20, 15]}') == [20.0, 15.0]
    assert parse_unifiedreward_edit_scores('Here: {"reasoning": "x", "score": [20, 15, 3]} end') == [20.0, 15.0]
    assert parse_unifiedreward_edit_scores('"{\\"score\\": [1, 2]}"') == [1.0, 2.0]  # JSON inside a JSON string
    assert parse_unifiedreward_edit_scores('{\n"reasoning" : "...",\n"score" : [3, 4],\n}') is None  # trailing comma
    assert parse_unifiedreward_edit_scores('{"score": [7]}') is None
    assert parse_unifiedreward_edit_scores('{"score": ["a", 2]}') is None
    assert parse_unifiedreward_edit_scores("nothing") is None


def test_rational_parsers_and_aggregations():
    authors = parse_rational_scores(RATIONAL_ANSWER, "authors")
    assert authors == {"text_faithfulness": 3.5, "image_faithfulness": 4.0, "physical_quality": 2.75,
                       "text_rendering": "N/A"}
    assert parse_rational_scores(RATIONAL_ANSWER, "flow_factory") == authors
    assert aggregate_rational_scores(authors, ("text_faithfulness", "physical_quality", "text_rendering"),
                                     clamp=False) == pytest.approx(((3.5 + 2.75) / 2 - 1) / 3)
    # the authors take the last readable "## Score:" of a block, Flow-Factory the first "Score:" line (any case)
    twice = RATIONAL_ANSWER.replace("## Score: 3.5", "## Score: 3.5\nscore: 2\n## Score: 1.5")
    assert parse_rational_scores(twice, "authors")["text_faithfulness"] == 1.5
    assert parse_rational_scores(twice, "flow_factory")["text_faithfulness"] == 3.5
    # Flow-Factory clamps each aspect to [1, 4] and the reward to [0, 1]; the authors do neither
    wild = {"text_faithfulness": 5.0, "image_faithfulness": 0.0, "physical_quality": 4.0, "text_rendering": None}
    assert aggregate_rational_scores(wild, ("text_faithfulness", "physical_quality"), clamp=False) == pytest.approx(
        ((5 + 4) / 2 - 1) / 3)
    assert aggregate_rational_scores(wild, ("text_faithfulness", "image_faithfulness", "physical_quality"),
                                     clamp=True) == pytest.approx(((4 + 1 + 4) / 3 - 1) / 3)
    assert aggregate_rational_scores(dict.fromkeys(authors), ("text_faithfulness",), clamp=False) is None
    # numbered sections without the headers: the authors' fallback split
    plain = "intro\n1. a\n## Score: 2\n2. b\n## Score: 3\n3. c\n## Score: 4\n4. d\n## Score: N/A"
    assert parse_rational_scores(plain, "authors") == {"text_faithfulness": 2.0, "image_faithfulness": 3.0,
                                                       "physical_quality": 4.0, "text_rendering": "N/A"}
    assert parse_rational_scores("garbage", "authors") == dict.fromkeys(authors)
    assert parse_rational_scores(None, "flow_factory") == dict.fromkeys(authors)


# ---- the server backend ------------------------------------------------------------------------------------------


def _route(answers):
    """A reply function choosing the canned answer by what the question text contains."""
    return lambda text: next(a for key, a in answers.items() if key in text)


def test_editscore_requests_and_reward(monkeypatch):
    answers = {
        "Editing instruction: add a hat": '{"reasoning": "ok", "score": [20, 15]}',
        "Editing instruction: paint it red": "I refuse.",
        "Editing instruction: make it huge": '{"reasoning": "?", "score": [30, 27]}',
        "image naturalness": '{"reasoning": "clean", "score": [22.5, 10]}',
    }
    server = ChatServer(_route(answers), models=("EditScore-7B",))
    try:
        reward = get_reward("editscore", base_url=server.base_url, api_key_env=None, timeout=10)
        prompts = ["add a hat", "paint it red", "make it huge"]
        sources = [_image(64, 48, 1), _image(40, 40, 2), _image(30, 50, 3)]
        edited = [_image(64, 48, 4), _image(40, 40, 5), _image(30, 50, 6)]
        out = reward(prompts, edited, image=sources)
        assert isinstance(out, RewardOutput)
        pq = 10 / 2.5
        # SC = min(20, 15) / 2.5 = 6; an answer without scores counts as 25 / 2 -> 5; off the scale -> 12.5 (as written)
        expected = [math.sqrt(6 * pq) / 10, math.sqrt(5 * pq) / 10, math.sqrt(12.5 * pq) / 10]
        assert list(out) == pytest.approx(expected)
        assert out.metrics["sc"] == pytest.approx([6.0, 5.0, 12.5]) and out.metrics["pq"] == pytest.approx([pq] * 3)
        assert len(server.requests) == 6
        body = server.requests[0]
        assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 20
        assert body["max_tokens"] == 512 and body["seed"] == 42
        for body in server.requests:
            (user,) = body["messages"]
            kinds = [p["type"] for p in user["content"]]
            texts = [p["text"] for p in user["content"] if p["type"] == "text"]
            # the authors' layout: "<img1>: <image><img2>: <image>{question}" (the RL server shows PQ both images)
            assert kinds == ["text", "image_url", "text", "image_url", "text"]
            assert texts[:2] == ["<img1>: ", "<img2>: "]
            images = [_decode(p["image_url"]["url"]) for p in user["content"] if p["type"] == "image_url"]
            assert all(im.width % 28 == 0 and im.height % 28 == 0 for im in images)  # qwen-vl-utils' resize
        # other policies: the whole edit's reward when an answer cannot be read
        strict = get_reward("editscore", base_url=server.base_url, api_key_env=None, on_unparsable="none",
                            health_check=False, pq_inputs="edited")
        before = len(server.requests)
        assert list(strict(prompts[:2], edited[:2], image=sources[:2])) == pytest.approx([expected[0], None])
        # its PQ requests (sent concurrently with the SC ones, so in any order) show the edited image only
        pq_requests = [r for r in server.requests[before:]
                       if any("naturalness" in p.get("text", "") for p in r["messages"][0]["content"])]
        assert len(pq_requests) == 2
        assert all([p["type"] for p in r["messages"][0]["content"]].count("image_url") == 1 for r in pq_requests)
        with pytest.raises(EditJudgeUnparsableError, match="refuse"):
            get_reward("editscore", base_url=server.base_url, api_key_env=None, on_unparsable="raise",
                       health_check=False)(prompts[1:2], edited[1:2], image=sources[1:2])
        assert list(get_reward("editscore", base_url=server.base_url, api_key_env=None, on_unparsable=-1,
                               health_check=False)(prompts[1:2], edited[1:2], image=sources[1:2])) == [-1.0]
    finally:
        server.close()


def test_unifiedreward_edit_requests_and_reward():
    answers = {
        "Editing instruction:add a hat\n": '{"reasoning": "good", "score": [20, 10]}',
        "Editing instruction:paint it red\n": '{"reasoning": "trailing comma", "score": [20, 10],}',
        "image naturalness": '{"reasoning": "clean", "score": [25, 15]}',
    }
    server = ChatServer(_route(answers), models=("UnifiedReward",))
    try:
        reward = get_reward("unifiedreward_edit", base_url=server.base_url, api_key_env=None, timeout=10)
        prompts = ["add a hat", "paint it red"]
        sources, edited = [_image(32, 32, 1), _image(32, 32, 2)], [_image(32, 32, 3), _image(32, 32, 4)]
        out = reward(prompts, edited, image=sources)
        assert list(out) == pytest.approx([(15 + 20) / 2 / 25, (0 + 20) / 2 / 25])  # unreadable -> [0, 0]
        assert out.metrics == {"following": [15.0, 0.0], "quality": [20.0, 20.0]}
        following = next(b for b in server.requests if len(b["messages"][0]["content"]) == 3)
        (user,) = following["messages"]
        assert [p["type"] for p in user["content"]] == ["image_url", "image_url", "text"]  # images first
        assert user["content"][2]["text"] in (UNIFIEDREWARD_EDIT_FOLLOWING_PREFIX + f"{p}\n" for p in prompts)
        assert user["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
        assert following["temperature"] == 0.0 and following["max_tokens"] == 4096
        quality = next(b for b in server.requests if len(b["messages"][0]["content"]) == 2)
        assert quality["messages"][0]["content"][1]["text"] == UNIFIEDREWARD_EDIT_QUALITY_PROMPT

        weighted = get_reward("unifiedreward_edit", base_url=server.base_url, api_key_env=None, health_check=False,
                              dimensions=["following"], following_weights=[0.6, 0.4])
        assert list(weighted(prompts[:1], edited[:1], image=sources[:1])) == pytest.approx([(0.6 * 20 + 0.4 * 10) / 25])
        none = get_reward("unifiedreward_edit", base_url=server.base_url, api_key_env=None, health_check=False,
                          on_unparsable="none")
        assert list(none(prompts, edited, image=sources))[1] is None
        with pytest.raises(ValueError, match="dimensions"):
            get_reward("unifiedreward_edit", dimensions=["overall"], health_check=False)
    finally:
        server.close()


def test_rationalrewards_edit_requests_variants_and_failures():
    answers = {"User Instruction: add a hat\n": RATIONAL_ANSWER, "User Instruction: paint it red\n": "no rubric here"}
    server = ChatServer(_route(answers), models=("RationalRewards-8B-Edit",))
    try:
        prompts = ["add a hat", "paint it red"]
        sources, edited = [_image(32, 32, 1), _image(32, 32, 2)], [_image(32, 32, 3), _image(32, 32, 4)]
        authors = get_reward("rationalrewards_edit", base_url=server.base_url, api_key_env=None, timeout=10)
        out = authors(prompts, edited, image=sources)
        assert list(out) == pytest.approx([((3.5 + 2.75) / 2 - 1) / 3, 0.0])
        assert out.metrics["image_faithfulness"] == [4.0, None]
        body = server.requests[0]
        system, user = body["messages"]
        assert system == {"role": "system", "content": RATIONALREWARDS_EDIT_SYSTEM_PROMPT}
        texts = [p["text"] for p in user["content"] if p["type"] == "text"]
        assert [p["type"] for p in user["content"]] == ["text", "image_url", "text", "image_url", "text"]
        assert texts[0].endswith("You are provided with two images:\n1. Source Image ")
        assert texts[1] == "\n2. Edited Image " and texts[2].endswith(RATIONALREWARDS_EDIT_GUIDELINE)
        assert body["temperature"] == 0.1 and body["max_tokens"] == 2048
        flow_factory = get_reward("rationalrewards_edit", base_url=server.base_url, api_key_env=None,
                                  aggregation="flow_factory", health_check=False)
        assert list(flow_factory(prompts[:1], edited[:1], image=sources[:1])) == pytest.approx(
            [((3.5 + 4.0 + 2.75) / 3 - 1) / 3])
        with pytest.raises(ValueError, match="aggregation"):
            get_reward("rationalrewards_edit", aggregation="mean", health_check=False)
        with pytest.raises(ValueError, match="aspects"):
            get_reward("rationalrewards_edit", aspects=["beauty"], health_check=False)
        with pytest.raises(ValueError, match="no 'image' column"):
            authors(prompts, edited)
    finally:
        server.close()
    # a judge whose server fails scores None and counts the sample as failed
    broken = ChatServer(lambda text: "x", status=503, models=("RationalRewards-8B-Edit",))
    try:
        from flowgrpo.rewards.failures import collect_failed_samples

        judge = get_reward("rationalrewards_edit", base_url=broken.base_url, api_key_env=None, max_retries=0,
                           health_check=False)
        with collect_failed_samples() as failed:
            assert list(judge(prompts, edited, image=sources)) == [None, None]
        assert sum(failed) == 2
    finally:
        broken.close()


# ---- in-process backend and the reward server --------------------------------------------------------------------


def test_in_process_backend_generates_with_both_images():
    base = cached_tiny_vlm_path("qwen2_5_vl")
    judge = get_reward("unifiedreward_edit", backend="transformers", model=str(base), device="cpu", max_tokens=6)
    sources, edited = [_image(56, 56, 1)], [_image(56, 56, 2)]
    turns = judge.turns("add a hat", sources[0], edited[0])
    answers = judge.generate_answers(turns)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    out = judge(["add a hat"], edited, image=sources)  # random weights: unreadable JSON -> [0, 0] as in Pref-GRPO
    assert list(out) == [0.0]
    editscore = get_reward("editscore", backend="transformers", model=str(base), lora_name_or_path=None,
                           device="cpu", max_tokens=4, on_unparsable="none")
    assert list(editscore(["add a hat"], edited, image=sources)) == [None]
    texts = []
    model, processor = editscore.load()
    from flowgrpo.rewards.vlm_models import chat_content_text

    sc_turn = editscore.turns("add a hat", sources[0], edited[0])[0]
    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in sc_turn.parts]
    texts.append(chat_content_text(processor, content))
    assert "<img1>: <|vision_start|><|image_pad|><|vision_end|><img2>: <|vision_start|>" in texts[0]


def test_editing_rewards_work_behind_the_reward_server():
    answers = {"User Instruction: add a hat\n": RATIONAL_ANSWER}
    judge_server = ChatServer(_route(answers), models=("RationalRewards-8B-Edit",))
    try:
        kwargs = {"rationalrewards_edit": {"base_url": judge_server.base_url, "api_key_env": None}}
        with serve(["rationalrewards_edit"], reward_kwargs=kwargs, port=0, token="") as server:
            client = get_reward("remote", url=server.url, reward_name="rationalrewards_edit", token_env=None)
            sources, edited = [_image(32, 32, 1)], [_image(32, 32, 3)]
            out = client(["add a hat"], edited, image=sources)
            assert list(out) == pytest.approx([((3.5 + 2.75) / 2 - 1) / 3])
            assert out.metrics["physical_quality"] == [2.75]
            # the source image crossed the wire losslessly and reached the judge as the first image
            (user,) = [m for m in judge_server.requests[-1]["messages"] if m["role"] == "user"]
            first = next(p for p in user["content"] if p["type"] == "image_url")
            assert np.array_equal(np.asarray(_decode(first["image_url"]["url"]).convert("RGB")),
                                  np.asarray(sources[0]))
            with pytest.raises(Exception, match="no 'image' column"):
                client(["add a hat"], edited)
    finally:
        judge_server.close()
