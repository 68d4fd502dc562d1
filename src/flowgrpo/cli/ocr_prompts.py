"""A small synthetic OCR prompt set, generated locally and deterministically (no download).

Prompts follow the shape of the Flow-GRPO OCR set: a scene with a surface that carries a short quoted text, e.g.
``a wooden sign that says "OPEN"``. The ``ocr`` reward reads the quoted text as the target. Used by the tiny
recipe, the demo and the tests; the public OCR set is fetched by ``scripts/prepare_data.py``.

The editing variant (:func:`write_ocr_edit_files`, for FLUX.1 Kontext and Qwen-Image-Edit) renders a source image per
row, a sign with one word on it, and asks for another: ``Change the text on the sign to "HELLO"``. Only the new text
is quoted, so the ``ocr`` reward scores exactly the edit asked for.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

TEMPLATES = (
    'a wooden sign that says "{t}"',
    'a neon sign reading "{t}"',
    'a coffee mug with the word "{t}" printed on it',
    'a chalkboard with "{t}" written on it',
    'a street sign that reads "{t}"',
    'a t-shirt with the text "{t}"',
    'a book cover titled "{t}"',
    'a birthday cake with "{t}" written in icing',
    'a storefront with the name "{t}" above the door',
    'a poster with the headline "{t}"',
    'a license plate that says "{t}"',
    'a sticky note with "{t}" written on it',
    'a banner that says "{t}" at a parade',
    'a road painted with the word "{t}"',
    'a label on a jar that reads "{t}"',
    'a billboard in a city that says "{t}"',
)

WORDS = (
    "OPEN", "CLOSED", "SALE", "EXIT", "STOP", "HELLO", "WELCOME", "COFFEE", "BAKERY", "PIZZA", "HOTEL", "TAXI",
    "LOVE", "HOPE", "DREAM", "PEACE", "MUSIC", "BOOKS", "GARDEN", "RIVER", "OCEAN", "STARS", "MOON", "SUN",
    "CAFE", "BAR", "SHOP", "MARKET", "PARK", "ZOO", "BUS", "TRAIN", "NORTH", "SOUTH", "EAST", "WEST",
    "Fresh Bread", "Good Luck", "Thank You", "Free WiFi", "No Parking", "Happy Day", "Best Mom", "Keep Calm",
    "Hot Tea", "Ice Cream", "Big Sale", "Go Team", "Lab 42", "Room 7", "Route 66", "Gate B", "Level 3", "Aisle 9",
)


def make_ocr_prompts(num_prompts: int, seed: int = 0) -> list[dict[str, str]]:
    """``num_prompts`` rows ``{"prompt": ..., "ocr_text": ...}``; the same ``seed`` gives the same rows."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1.")
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num_prompts:
        template, word = rng.choice(TEMPLATES), rng.choice(WORDS)
        prompt = template.format(t=word)
        if prompt in seen and len(seen) < len(TEMPLATES) * len(WORDS):
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "ocr_text": word})
    return rows


def write_ocr_prompt_files(output_dir: str | os.PathLike, num_train: int = 64, num_test: int = 8, seed: int = 0,
                           file_format: str = "txt") -> dict[str, Path]:
    """Write ``train.<ext>`` and ``test.<ext>`` (disjoint prompts) to ``output_dir``; returns ``{split: path}``.

    ``file_format`` is ``"txt"`` (one prompt per line, the Flow-GRPO layout) or ``"jsonl"`` (also an ``ocr_text``
    column with the target text).
    """
    if file_format not in ("txt", "jsonl"):
        raise ValueError(f"file_format={file_format!r} must be 'txt' or 'jsonl'.")
    if num_test < 0:
        raise ValueError(f"num_test={num_test} must be >= 0.")
    rows = make_ocr_prompts(num_train + num_test, seed)
    splits = {"train": rows[:num_train], "test": rows[num_train:]}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, split_rows in splits.items():
        if not split_rows:
            continue
        path = output_dir / f"{split}.{file_format}"
        if file_format == "txt":
            text = "".join(r["prompt"] + "\n" for r in split_rows)
        else:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in split_rows)
        path.write_text(text, encoding="utf-8")
        written[split] = path
    return written


EDIT_TEMPLATES = (
    'Change the text on the sign to "{t}"',
    'Make the sign say "{t}"',
    'Rewrite the sign so that it reads "{t}"',
    'Replace the word on the sign with "{t}"',
)

_SIGN_COLOURS = ((246, 238, 220), (255, 255, 255), (250, 215, 120), (190, 225, 250), (210, 240, 200))
_BACKGROUNDS = ((60, 90, 70), (120, 110, 100), (40, 60, 110), (150, 80, 60), (90, 90, 90))


def render_sign(word: str, size: int = 512, seed: int = 0):
    """A source image: a plain sign with ``word`` in dark letters on a coloured background."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), rng.choice(_BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    margin = size // 8
    box = (margin, size // 3, size - margin, 2 * size // 3)
    draw.rectangle(box, fill=rng.choice(_SIGN_COLOURS), outline=(30, 30, 30), width=max(1, size // 128))
    font = ImageFont.load_default(size=max(8, size // (2 + len(word) // 2)))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = (box[0] + box[2] - (right - left)) // 2 - left
    y = (box[1] + box[3] - (bottom - top)) // 2 - top
    draw.text((x, y), word, fill=(20, 20, 20), font=font)
    return image


def write_ocr_edit_files(output_dir: str | os.PathLike, num_train: int = 64, num_test: int = 8, seed: int = 0,
                         size: int = 512) -> dict[str, Path]:
    """An editing set: ``images/<split>_<i>.png`` (a sign with one word) and ``<split>.jsonl`` rows ``{"prompt",
    "image", "ocr_text"}`` asking for another word; image paths are relative to ``output_dir`` (the prompt-file
    reader resolves them against the file's folder). Returns ``{split: path}``."""
    if num_train < 1 or num_test < 0:
        raise ValueError(f"num_train={num_train} must be >= 1 and num_test={num_test} >= 0.")
    rng = random.Random(seed)
    output_dir = Path(output_dir)
    (output_dir / "images").mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in (("train", num_train), ("test", num_test)):
        if not count:
            continue
        rows = []
        for i in range(count):
            old, new = rng.sample(WORDS, 2)
            name = f"images/{split}_{i:04d}.png"
            render_sign(old, size, seed=rng.randrange(1 << 30)).save(output_dir / name)
            rows.append({"prompt": rng.choice(EDIT_TEMPLATES).format(t=new), "image": name, "ocr_text": new})
        path = output_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        written[split] = path
    return written


__all__ = ["EDIT_TEMPLATES", "TEMPLATES", "WORDS", "make_ocr_prompts", "render_sign", "write_ocr_edit_files",
           "write_ocr_prompt_files"]
