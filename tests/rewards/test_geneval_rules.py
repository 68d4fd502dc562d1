"""GenEval's rules (`flowgrpo.rewards.geneval.judge`) on crafted detections, with expected values worked out by hand
from the official ``evaluate_images.py`` (``correct``, ``reason``) and Flow-GRPO's ``evaluate_reward``
(``strict_correct``, ``score``): every tag, each quirk, next to every threshold, confidence ties, more than 16
detections, missing classes, colour None. No model is involved.
"""

import json

import pytest

from flowgrpo.rewards.geneval import (
    COCO_OBJECT_NAMES,
    GENEVAL_OBJECT_NAMES,
    Detection,
    filter_detections,
    format_geneval_summary,
    geneval_label,
    judge,
    normalize_metadata,
    relative_position,
    summarize_geneval,
)

SINK = (100.0, 100.0, 200.0, 200.0)


def det(label, score=0.95, box=(0.0, 0.0, 10.0, 10.0), color=None):
    return Detection(label=label, box=box, score=score, color=color)


def single(cls="dog"):
    return {"tag": "single_object", "include": [{"class": cls, "count": 1}], "prompt": f"a photo of a {cls}"}


def counting(n, cls="dog"):
    return {"tag": "counting", "include": [{"class": cls, "count": n}], "exclude": [{"class": cls, "count": n + 1}],
            "prompt": f"a photo of {n} {cls}s"}


def colors(color, cls="dog", count=1):
    return {"tag": "colors", "include": [{"class": cls, "count": count, "color": color}], "prompt": "p"}


def position(rel, obj="tie", target="sink"):
    return {"tag": "position", "include": [{"class": target, "count": 1},
                                           {"class": obj, "count": 1, "position": [rel, 0]}], "prompt": "p"}


def test_types_and_single_object_threshold_is_strict():
    res = judge(single(), [det("dog", 0.31)])
    assert type(res.correct) is bool and type(res.strict_correct) is bool and type(res.score) is float
    assert type(res.reason) is str
    assert (res.correct, res.strict_correct, res.score, res.reason) == (True, True, 1.0, "")
    at = judge(single(), [det("dog", 0.3)])  # strictly above 0.3
    assert (at.correct, at.strict_correct, at.score, at.reason) == (False, False, 0.0, "expected dog>=1, found 0")
    assert at.strict_reason == "expected dog==1, found 0"
    assert judge(single(), [det("dog", 0.3000001)]).correct
    assert judge(single(), [det("dog", 0.2999999)]).reason == "expected dog>=1, found 0"


def test_missing_class_and_other_classes_ignored():
    res = judge(single("cat"), [det("dog"), det("person")])
    assert (res.correct, res.score, res.reason) == (False, 0.0, "expected cat>=1, found 0")
    assert res.details == {"person": [[0.0, 0.0, 10.0, 10.0, 0.95]], "dog": [[0.0, 0.0, 10.0, 10.0, 0.95]]}


def test_two_object_top_count_versus_exact_count():
    meta = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}],
            "prompt": "a photo of a dog and a cat"}
    res = judge(meta, [det("dog"), det("dog", 0.5), det("cat")])
    # official: top-1 dog suffices; Flow-GRPO: two dogs != one -> credit 1 - |1 - 2| / 1 = 0 for dog, 1 for cat
    assert res.correct and not res.strict_correct
    assert res.score == 0.5
    assert res.strict_reason == "expected dog==1, found 2"
    assert res.reason == ""


def test_counting_uses_0_9_threshold_and_exclude():
    dogs = [det("dog", 0.95) for _ in range(3)]
    ok = judge(counting(3), dogs + [det("dog", 0.9)])  # 0.9 is not > 0.9
    assert (ok.correct, ok.strict_correct, ok.score) == (True, True, 1.0)
    four = judge(counting(3), dogs + [det("dog", 0.9000001)])
    assert not four.correct and four.reason == "expected dog<4, found 4"
    assert not four.strict_correct and four.score == pytest.approx(1 - 1 / 3)
    assert four.strict_reason == "expected dog==3, found 4"
    few = judge(counting(3), [det("dog", 0.95), det("dog", 0.89), det("dog", 0.5)])
    assert few.reason == "expected dog>=3, found 1"
    assert few.score == pytest.approx(1 - 2 / 3)
    # the 0.9 threshold is for the counting tag only
    assert judge(single(), [det("dog", 0.5)]).correct


def test_at_most_16_per_class_and_negative_count_credit():
    many = [det("dog", 0.5 + i / 100) for i in range(20)]
    res = judge(single(), many)
    assert len(res.details["dog"]) == 16
    assert [row[4] for row in res.details["dog"]] == [0.5 + i / 100 for i in range(19, 3, -1)]
    assert res.correct and not res.strict_correct
    assert res.score == 1 - 15  # 1 - |1 - 16| / 1: not clipped (the reference quirk)
    assert judge(single(), many, partial_credit="corrected").score == 0.0
    # exclude counts the kept (at most 16) detections
    meta = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 17}],
            "prompt": "p"}
    assert judge(meta, [det("dog", 0.95) for _ in range(20)]).correct


def test_colour_official_and_strict():
    # top-1 dog (highest score) is blue: official fails, and lists the colours found
    res = judge(colors("red"), [det("dog", 0.99, color="blue"), det("dog", 0.5, color="red")])
    assert not res.correct
    assert res.reason == "expected red dog>=1, found 0 red; and 1 blue"
    assert res.strict_reason == "expected dog==1, found 2"
    assert res.score == 0.0  # [1 - |1 - 2|, 0.0 for the colour clause] = [0, 0]
    good = judge(colors("red"), [det("dog", 0.99, color="red"), det("cat", 0.99, color="blue")])
    assert (good.correct, good.strict_correct, good.score) == (True, True, 1.0)
    # partial colour credit: 2 dogs, 1 red -> [1, 1 - |2 - 1| / 2]
    two = judge(colors("red", count=2), [det("dog", color="white"), det("dog", 0.9, color="red")])
    assert not two.strict_correct and two.score == 0.75
    assert two.reason == "expected red dog>=2, found 1 red; and 1 red, 1 white"


def test_colour_none_never_matches():
    res = judge(colors("red"), [det("dog", color=None)])
    assert not res.correct and not res.strict_correct
    assert res.reason == "expected red dog>=1, found 0 red; and "
    assert res.score == 0.5  # [1 (count), 1 - |1 - 0| / 1 (colour)]


def test_color_attr_two_clauses():
    meta = {"tag": "color_attr", "include": [{"class": "boat", "count": 1, "color": "white"},
                                             {"class": "hot dog", "count": 1, "color": "orange"}], "prompt": "p"}
    res = judge(meta, [det("boat", color="white"), det("hot dog", color="brown")])
    assert not res.correct and res.reason == "expected orange hot dog>=1, found 0 orange; and 1 brown"
    assert res.score == 0.75  # [1, 1, 1, 0]
    missing = judge(meta, [det("boat", color="white")])
    assert missing.reason == "expected hot dog>=1, found 0"
    assert missing.score == 0.5  # [1, 1, 0 (count), 0.0 (extra term of a colour clause)]


def test_confidence_ties_follow_numpy_argsort():
    # numpy's argsort of [0.95, 0.95] is [0, 1]; reversed, the later detection comes first
    red_then_blue = [det("dog", 0.95, color="red"), det("dog", 0.95, color="blue")]
    assert not judge(colors("red"), red_then_blue).correct
    assert judge(colors("red"), red_then_blue[::-1]).correct
    kept = filter_detections([det("dog", 0.7, box=(i, 0, i + 1, 1)) for i in range(5)], "single_object")
    assert [d.box[0] for d in kept["dog"]] == [4, 3, 2, 1, 0]


def test_position_pass_fail_and_reference_quirk():
    above = (100.0, 0.0, 200.0, 50.0)  # centre offset (0, -125), shrunk to (0, -110): dy = -0.88
    res = judge(position("above"), [det("sink", box=SINK), det("tie", box=above)])
    assert (res.correct, res.strict_correct, res.score, res.reason) == (True, True, 1.0, "")
    below = (100.0, 250.0, 200.0, 300.0)
    bad = judge(position("above"), [det("sink", box=SINK), det("tie", box=below)])
    assert not bad.correct and bad.reason == "expected tie above target, found below target"
    assert bad.score == 0.75  # [1, 1, 0.0, 1.0]: the failed check adds 0 and then 1 anyway
    assert judge(position("above"), [det("sink", box=SINK), det("tie", box=below)],
                 partial_credit="corrected").score == pytest.approx(2 / 3)
    assert judge(position("above"), [det("sink", box=SINK), det("tie", box=above)],
                 partial_credit="corrected").score == 1.0


def test_position_without_target_and_without_relation():
    res = judge(position("above"), [det("tie", box=(0, 0, 10, 10))])
    assert res.reason == "expected sink>=1, found 0\nno target for tie to be above"
    assert res.strict_reason == "expected sink==1, found 0\nno target for tie to be above"
    assert res.score == pytest.approx(1 / 3)  # [0, 1, 0.0]
    same = judge(position("left of"), [det("sink", box=SINK), det("tie", box=SINK)])
    assert same.reason == "expected tie left of target, found  target"


def test_position_shrink_and_half_thresholds():
    a = (0.0, 0.0, 10.0, 10.0)

    def shifted(dx, dy=0.0):
        return (a[0] + dx, a[1] + dy, a[2] + dx, a[3] + dy)

    # sizes 10 + 10 -> shrink 0.1 * 20 = 2 per axis; dx = (|o| - 2) / |o| crosses 0.5 at |o| = 4
    assert relative_position(shifted(-4.0), a) == set()
    assert relative_position(shifted(-4.01), a) == {"left of"}
    assert relative_position(shifted(4.01), a) == {"right of"}
    assert relative_position(shifted(0, -4.01), a) == {"above"}
    assert relative_position(shifted(0, 4.01), a) == {"below"}
    assert relative_position(shifted(2.0), a) == set()  # shrunk to exactly 0
    # diagonal: both axes count against the norm of the original offset
    assert relative_position(shifted(20, 20), a) == {"right of", "below"}
    assert relative_position(shifted(20, 5), a) == {"right of"}
    # dead zone: shrunk parts under 1e-3 give no relation even when the direction is clear
    point = (0.0, 0.0, 0.0, 0.0)
    assert relative_position((0.0009, 0.0, 0.0009, 0.0), point) == set()
    assert relative_position((0.002, 0.0, 0.002, 0.0), point) == {"right of"}


def test_no_includes_and_input_checks():
    res = judge({"tag": "single_object", "include": [], "prompt": "p"}, [det("dog")])
    assert (res.correct, res.strict_correct, res.score) == (True, True, 0.0)
    with pytest.raises(ValueError, match="'doggo'"):
        judge(single(), [det("doggo")])
    with pytest.raises(ValueError, match="GenEval calls it 'computer mouse'"):
        judge(single(), [det("mouse")])
    with pytest.raises(ValueError, match="'crimson'"):
        judge(single(), [det("dog", color="crimson")])
    with pytest.raises(ValueError, match="partial_credit"):
        judge(single(), [], partial_credit="fair")
    with pytest.raises(ValueError, match="tag"):
        judge({"include": []}, [])
    with pytest.raises(ValueError, match="count"):
        judge({"tag": "x", "include": [{"class": "dog", "count": 0}]}, [])


def test_metadata_from_tables_is_normalised():
    line = {"tag": "position", "include": [{"class": "sink", "count": 1},
                                           {"class": "tie", "count": 1, "position": ["above", 0]}], "prompt": "p"}
    padded = {"tag": "position", "include": [{"class": "sink", "count": 1, "color": None, "position": None},
                                             {"class": "tie", "count": 1, "color": None, "position": ["above", 0]}],
              "exclude": None, "prompt": "p"}
    as_json = dict(line, include=json.dumps(line["include"]))
    assert normalize_metadata(padded) == normalize_metadata(as_json) == line
    assert json.dumps(normalize_metadata(line)) == json.dumps(line)


def test_label_mapping_covers_all_80_names():
    assert len(set(GENEVAL_OBJECT_NAMES)) == 80
    assert [geneval_label(n) for n in GENEVAL_OBJECT_NAMES] == list(GENEVAL_OBJECT_NAMES)
    assert [geneval_label(n) for n in COCO_OBJECT_NAMES] == list(GENEVAL_OBJECT_NAMES)
    voc = {"aeroplane": "airplane", "motorbike": "motorcycle", "sofa": "couch", "tvmonitor": "tv",
           "diningtable": "dining table", "pottedplant": "potted plant"}
    others = {"hair dryer": "hair drier", "Cell_Phone": "cell phone", "remote": "tv remote",
              "keyboard": "computer keyboard", "mouse": "computer mouse", "doughnut": "donut", "TV": "tv"}
    for name, expected in {**voc, **others}.items():
        assert geneval_label(name) == expected, name
    assert geneval_label("N/A") is None and geneval_label("wall-brick") is None


def test_summary_matches_summary_scores():
    def rec(tag, ok, meta):
        return {"tag": tag, "correct": ok, "metadata": json.dumps({"tag": tag, "m": meta})}

    records = [rec("single_object", True, 1), rec("single_object", False, 1), rec("counting", False, 2),
               rec("counting", False, 2), rec("counting", True, 3), rec("colors", True, 4)]
    s = summarize_geneval(records)
    assert s["total_images"] == 6 and s["total_prompts"] == 4
    assert s["correct_images"] == 0.5 and s["correct_prompts"] == 0.75
    assert list(s["tasks"]) == ["single_object", "counting", "colors"]
    assert s["tasks"]["counting"] == {"accuracy": 1 / 3, "correct": 1, "total": 3}
    assert s["overall"] == pytest.approx((0.5 + 1 / 3 + 1.0) / 3)
    text = format_geneval_summary(s)
    assert "counting         = 33.33% (1 / 3)" in text
    assert text.endswith(f"Overall score (avg. over tasks): {s['overall']:.5f}")


def test_prepare_data_fetches_the_pinned_geneval_metadata():
    import importlib.util
    from pathlib import Path

    from flowgrpo.rewards.geneval import GENEVAL_COMMIT

    script = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"
    spec = importlib.util.spec_from_file_location("prepare_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plan = module.plan_downloads(module.build_arg_parser().parse_args(["geneval", "--output_dir", "d"]))
    url = f"https://raw.githubusercontent.com/djghosh13/geneval/{GENEVAL_COMMIT}/prompts/evaluation_metadata.jsonl"
    assert (url, Path("d/geneval/evaluation_metadata.jsonl")) in plan
    assert module.GENEVAL_COMMIT == GENEVAL_COMMIT
