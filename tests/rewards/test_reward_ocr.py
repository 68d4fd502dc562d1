"""The `ocr` reward: target extraction and scoring math, and the real bundled PP-OCR models (rapidocr)."""

import importlib.util
import logging
import threading
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from flowgrpo.rewards import get_reward, resolve_reward_funcs
from flowgrpo.rewards.ocr import OCRReward, extract_quoted_targets, normalize_ocr_text, ocr_target_score

pytest.importorskip("rapidocr")
pytest.importorskip("rapidfuzz")


# ---- pure functions (no OCR) -----------------------------------------------------------------------


def test_extract_quoted_targets():
    assert extract_quoted_targets('a sign that says "OPEN 24/7"') == ["OPEN 24/7"]
    assert extract_quoted_targets("a mug: \u201cDon't Panic\u201d") == ["Don't Panic"]
    assert extract_quoted_targets('"Bakery" above "No. 42" and \u201cCaf\u00e9\u201d') == ["Bakery", "No. 42", "Caf\u00e9"]
    assert extract_quoted_targets("it's a 'single quoted' span, no target") == []
    assert extract_quoted_targets('empty "" and blank "  " spans') == []
    assert extract_quoted_targets("no quotes at all") == []


def test_normalize_and_target_score():
    assert normalize_ocr_text(" Hello\tWorld \n") == "helloworld"
    assert ocr_target_score("Hello World", "a sign: HELLO WORLD!") == 1.0  # substring after normalisation
    assert ocr_target_score("Hello World", "hello") == pytest.approx(1 - 5 / 10)  # 5 insertions
    assert ocr_target_score("OPEN", "OPEM") == pytest.approx(0.75)
    assert ocr_target_score("OPEN", "") == 0.0
    assert ocr_target_score("OPEN", "something much longer") == 0.0  # distance clipped at len(target)
    with pytest.raises(ValueError, match="empty"):
        ocr_target_score("  ", "x")


def test_unknown_backend_and_missing_paddleocr():
    with pytest.raises(ValueError, match="unknown OCR backend 'tesseract'"):
        OCRReward(backend="tesseract")
    if importlib.util.find_spec("paddleocr") is None:
        reward = OCRReward(backend="paddleocr")
        with pytest.raises(ImportError, match=r"pip install flowgrpo\[paddle\]"):
            reward(['"hi"'], [Image.new("RGB", (64, 32), "white")])


def test_prompts_without_target_score_zero_with_one_warning(caplog):
    reward = OCRReward()
    images = [Image.new("RGB", (64, 32), "white")] * 3
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.ocr"):
        assert reward(["a cat", "a dog", "it's 'single'"], images) == [0.0, 0.0, 0.0]
        assert reward(["a bird"], images[:1]) == [0.0]
    assert sum("no quoted text" in r.getMessage() for r in caplog.records) == 1
    assert reward([], []) == []


# ---- real OCR --------------------------------------------------------------------------------------


def _font_path() -> str | None:
    candidates = [Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf")
    return next((str(p) for p in candidates if p.is_file()), None)


@pytest.fixture(scope="module")
def font():
    path = _font_path()
    return ImageFont.truetype(path, 24) if path else ImageFont.load_default(size=24)


def render(font, *lines: str, width: int = 256, line_height: int = 44) -> Image.Image:
    """Black text on a light background, one line per argument; as wide as needed, at least ``width``."""
    text_width = max(int(font.getlength(line)) for line in lines) if lines else 0
    image = Image.new("RGB", (max(width, text_width + 32), max(64, line_height * len(lines) + 20)), (245, 240, 230))
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((16, 12 + i * line_height), line, fill=(15, 15, 15), font=font)
    return image


MATCHING = [
    ('a neon sign that says "OPEN 24/7"', ["OPEN 24/7"]),
    ("a coffee mug that says \u201cDon't Panic\u201d", ["Don't Panic"]),
    ('a price tag reading "$19.99" on a shoe', ["$19.99"]),
    ('a cake with "Happy 30th, Anna!" written in icing', ["Happy 30th, Anna!"]),
    ('a shop sign "Bakery" above a door marked "No. 42"', ["Bakery", "No. 42"]),
    ("a poster: \u201cSALE: 50% OFF\u201d in bold type", ["SALE: 50% OFF"]),
    ("a street sign reading \"Let's Go\" at dusk", ["Let's Go"]),
    ('a road sign: "Speed limit 60 km/h"', ["Speed limit 60 km/h"]),
]


def test_rendered_text_scores_high(font):
    reward = get_reward("ocr")
    prompts = [p for p, _ in MATCHING]
    images = [render(font, *lines) for _, lines in MATCHING]
    scores = reward(prompts, images)
    assert len(scores) == len(prompts) and all(0.0 <= s <= 1.0 for s in scores)
    assert sum(scores) / len(scores) >= 0.9, list(zip(prompts, scores))


def test_other_text_scores_low_and_partial_text_in_between(font):
    reward = get_reward("ocr")
    prompts = ['a sign that says "OPEN 24/7"', 'a banner reading "Welcome Home"', 'a label "Fresh Bread"',
               'a sign "HELLO WORLD"']
    images = [render(font, "Closed on Sunday"), render(font, "Quarterly Tax Report"), Image.new("RGB", (256, 64), "white"),
              render(font, "HELLO")]
    scores = reward(prompts, images)
    assert max(scores[:3]) <= 0.35, scores
    assert scores[2] == 0.0  # nothing recognised on a blank image
    assert 0.3 <= scores[3] <= 0.7, scores  # half of the target: 1 - 5/10


def test_ocr_text_column_overrides_quotes_and_runs_through_a_reward_set(font):
    rs = resolve_reward_funcs(["ocr"])
    prompts = ['a sign that says "something else"', "a storefront sign", 'a sign "Bakery"']
    images = [render(font, "Bakery"), render(font, "Bakery"), render(font, "Bakery")]
    result = rs(prompts, images, ocr_text=["Bakery", ["Bakery", "Cafe"], None])
    ocr = result.per_reward["ocr"]
    assert ocr[0] >= 0.9  # the column wins over the quotes
    assert 0.3 <= ocr[1] <= 0.8  # mean of a hit and a miss
    assert ocr[2] >= 0.9  # None in the column: back to the quotes
    rs.close()


def test_failure_on_one_image_scores_zero_and_the_rest_are_scored(font, caplog):
    reward = OCRReward()
    prompts = ["no target here", 'a sign "OPEN"', 'a sign "OPEN"']
    blank = Image.new("RGB", (64, 32), "white")
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.ocr"):
        scores = reward(prompts, [blank, Image.new("RGB", (0, 0)), render(font, "OPEN")])
    assert scores[0] == 0.0 and scores[1] == 0.0 and scores[2] >= 0.9
    assert "failed on image 1 of the batch" in caplog.text


def test_thread_safe(font):
    reward = OCRReward()
    prompts = ['a sign "OPEN 24/7"', 'a sign "No. 42"']
    images = [render(font, "OPEN 24/7"), render(font, "No. 42")]
    expected = reward(prompts, images)
    results, errors = [None] * 3, []

    def work(k):
        try:
            results[k] = reward(prompts, images)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [expected] * 3
