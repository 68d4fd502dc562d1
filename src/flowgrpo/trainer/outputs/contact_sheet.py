"""Contact sheets: a grid of images (or videos: first, middle and last frame side by side), each with its caption
(prompt and score) underneath."""

from __future__ import annotations

import math
import textwrap

from PIL import Image, ImageDraw, ImageFont

from .media import is_video, key_frames


def make_contact_sheet(images: list[Image.Image | list[Image.Image]], captions: list[str] | None = None,
                       columns: int | None = None, cell: int = 192, caption_lines: int = 3) -> Image.Image:
    """A grid with one cell per sample; a video sample (a list of frames) shows its first, middle and last frame."""
    if not images:
        return Image.new("RGB", (cell, cell), "white")
    panels = [key_frames(im) if is_video(im) else [im] for im in images]
    cell_w = cell * max(len(p) for p in panels)
    captions = captions or [""] * len(images)
    columns = columns or min(len(images), max(1, math.ceil(math.sqrt(len(images)))))
    rows = math.ceil(len(images) / columns)
    font = ImageFont.load_default()
    line_h = 12
    text_h = caption_lines * line_h + 4
    sheet = Image.new("RGB", (columns * cell_w, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    chars = max(8, cell_w // 6)
    for k, (frames, cap) in enumerate(zip(panels, captions)):
        r, c = divmod(k, columns)
        x, y = c * cell_w, r * (cell + text_h)
        for j, frame in enumerate(frames):
            sheet.paste(frame.convert("RGB").resize((cell, cell), Image.NEAREST), (x + j * cell, y))
        for n, line in enumerate(textwrap.wrap(cap, chars)[:caption_lines]):
            draw.text((x + 2, y + cell + 2 + n * line_h), line, fill="black", font=font)
    return sheet


def side_by_side(left: Image.Image, right: Image.Image, titles: tuple[str, str] = ("before", "after"),
                 gap: int = 16) -> Image.Image:
    """Two sheets next to each other with a title above each (before/after comparisons)."""
    font = ImageFont.load_default()
    title_h = 20
    w = left.width + gap + right.width
    h = max(left.height, right.height) + title_h
    out = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(out)
    out.paste(left, (0, title_h))
    out.paste(right, (left.width + gap, title_h))
    draw.text((4, 4), titles[0], fill="black", font=font)
    draw.text((left.width + gap + 4, 4), titles[1], fill="black", font=font)
    return out
