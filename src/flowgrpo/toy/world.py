"""The toy world: coloured shapes on a black canvas, their captions, and a deterministic renderer.

A scene is one colour, one shape, a count of 1-3 and a position (a half of the canvas)::

    Scene(color="red", shape="circle", count=2, position="left")  <->  "two red circles on the left"

* colours   red, green, blue, yellow, purple, cyan: saturated and far apart in chromaticity (see :data:`COLORS`)
* shapes    circle, square, triangle (pointing up): bounding-box fill ratios pi/4, 1 and 1/2
* counts    1, 2, 3 ("one", "two", "three")
* positions left, right ("on the left/right"), top, bottom ("at the top/bottom"): every object lies inside that
  half

The renderer draws at 4x supersampling and averages down (anti-aliased edges), so 32 px images have clean
shapes of 6-12 px. With ``rng=None`` the layout is canonical (one centred object per slot of the half); with a
seed or a ``numpy.random.Generator`` sizes vary and the objects lie anywhere in their half, never touching
(see :func:`layout`), so that the programmatic checks of :mod:`flowgrpo.toy.rewards` score every rendering
exactly. Free placement is what makes counting hard for the model, as it is for real text-to-image models.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "COLORS",
    "SHAPES",
    "COUNTS",
    "POSITIONS",
    "BACKGROUND",
    "Scene",
    "caption",
    "parse_caption",
    "parse_attributes",
    "layout",
    "render",
    "render_many",
    "all_scenes",
    "split_scenes",
]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "purple": (170, 60, 220),
    "cyan": (40, 210, 220),
}
"""Colour names and their RGB values (every value has a channel >= 220, so brightness marks the foreground)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNTS: tuple[int, ...] = (1, 2, 3)
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom")
BACKGROUND: tuple[int, int, int] = (0, 0, 0)

_COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
_POSITION_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}

# Words the parser understands (beyond the caption grammar: articles, digits and a few synonyms).
_COUNT_TOKENS = {"one": 1, "two": 2, "three": 3, "1": 1, "2": 2, "3": 3, "single": 1, "pair": 2}
_ARTICLES = {"a", "an"}
_POSITION_TOKENS = {
    "left": "left", "right": "right", "top": "top", "bottom": "bottom",
    "upper": "top", "above": "top", "lower": "bottom", "below": "bottom",
}
_SHAPE_TOKENS = {**{s: s for s in SHAPES}, **{s + "s": s for s in SHAPES}}
_PLURAL_SHAPE_TOKENS = {s + "s" for s in SHAPES}

_SUPERSAMPLE = 4
MIN_GAP = 2.0
"""Least gap in pixels between the boxes of two objects of a jittered layout."""


@dataclass(frozen=True, order=True)
class Scene:
    """One toy scene: ``count`` objects of one ``shape`` and ``color``, all in the ``position`` half."""

    color: str
    shape: str
    count: int
    position: str

    def __post_init__(self) -> None:
        if self.color not in COLORS:
            raise ValueError(f"unknown colour {self.color!r}; choose one of {', '.join(COLORS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; choose one of {', '.join(SHAPES)}")
        if self.count not in COUNTS:
            raise ValueError(f"count must be one of {COUNTS}, got {self.count!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"unknown position {self.position!r}; choose one of {', '.join(POSITIONS)}")

    @property
    def caption(self) -> str:
        return caption(self)


def caption(scene: Scene) -> str:
    """The caption of ``scene``, e.g. ``"two red circles on the left"`` or ``"one blue square at the top"``."""
    noun = scene.shape + ("s" if scene.count > 1 else "")
    return f"{_COUNT_WORDS[scene.count]} {scene.color} {noun} {_POSITION_PHRASES[scene.position]}"


def parse_attributes(text: str) -> dict[str, str | int]:
    """The scene attributes that ``text`` mentions: any of ``color``, ``shape``, ``count``, ``position``.

    Lenient: reads captions of the grammar and close variants ("a red circle at the upper half",
    "3 cyan triangles on the right side"). The count comes from a number word; without one, an article with a
    singular shape noun means 1. Attributes that the text does not mention (or names ambiguously, e.g. two
    colours) are left out.
    """
    tokens = re.findall(r"[a-z0-9]+", text.lower())
    found: dict[str, str | int] = {}

    def unique(values: Iterable) -> object | None:
        distinct = list(dict.fromkeys(values))
        return distinct[0] if len(distinct) == 1 else None

    color = unique(t for t in tokens if t in COLORS)
    shape = unique(_SHAPE_TOKENS[t] for t in tokens if t in _SHAPE_TOKENS)
    count = unique(_COUNT_TOKENS[t] for t in tokens if t in _COUNT_TOKENS)
    position = unique(_POSITION_TOKENS[t] for t in tokens if t in _POSITION_TOKENS)
    if count is None and shape is not None and not any(t in _COUNT_TOKENS for t in tokens):
        singular = [t for t in tokens if t in _SHAPE_TOKENS and t not in _PLURAL_SHAPE_TOKENS]
        if singular and any(t in _ARTICLES for t in tokens):
            count = 1
    for key, value in (("color", color), ("shape", shape), ("count", count), ("position", position)):
        if value is not None:
            found[key] = value
    return found


def parse_caption(text: str) -> Scene:
    """The :class:`Scene` described by ``text`` (inverse of :func:`caption`).

    Raises:
        ValueError: ``text`` does not name exactly one colour, shape, count and position.
    """
    found = parse_attributes(text)
    missing = [key for key in ("color", "shape", "count", "position") if key not in found]
    if missing:
        raise ValueError(f"cannot parse {', '.join(missing)} from caption {text!r}; expected e.g. "
                         f"'two red circles on the left'")
    return Scene(color=found["color"], shape=found["shape"], count=found["count"], position=found["position"])


def all_scenes() -> list[Scene]:
    """Every scene of the world, in a fixed order (6 colours x 3 shapes x 3 counts x 4 positions = 216)."""
    return [Scene(c, s, n, p) for c, s, n, p in itertools.product(COLORS, SHAPES, COUNTS, POSITIONS)]


def split_scenes(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[Scene], list[Scene]]:
    """Disjoint train and eval scenes: a seeded shuffle of :func:`all_scenes`, ``eval_fraction`` held out.

    The held-out scenes are unseen *combinations*: the split is redrawn (deterministically) until every pair of
    attribute values (colour-shape, shape-count, ...) still occurs in the training scenes. Both lists are sorted.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    scenes = all_scenes()
    n_eval = max(1, round(len(scenes) * eval_fraction))
    fields = ("color", "shape", "count", "position")
    needed = {(a, b, getattr(s, a), getattr(s, b)) for s in scenes for a, b in itertools.combinations(fields, 2)}
    for attempt in range(1000):
        order = np.random.default_rng([seed, attempt]).permutation(len(scenes))
        eval_scenes = [scenes[i] for i in order[:n_eval]]
        train_scenes = [scenes[i] for i in order[n_eval:]]
        covered = {(a, b, getattr(s, a), getattr(s, b)) for s in train_scenes
                   for a, b in itertools.combinations(fields, 2)}
        if covered == needed:
            return sorted(train_scenes), sorted(eval_scenes)
    raise ValueError(f"no split with eval_fraction={eval_fraction} keeps every attribute pair in training")


# ---------------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------------


def _as_generator(rng: int | np.random.Generator | None) -> np.random.Generator | None:
    if rng is None or isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(int(rng))


def layout(scene: Scene, size: int = 32, rng: int | np.random.Generator | None = None
           ) -> list[tuple[float, float, float]]:
    """Object boxes ``(centre_x, centre_y, side)`` in pixels for ``scene`` on a ``size`` canvas.

    Objects have side ``0.72 * min(half width, size / count)``. With ``rng=None`` the layout is canonical: the
    half is cut into ``count`` equal slots along its long side, one centred object per slot. With a seed or a
    generator the layout is free: sides are scaled by U(0.8, 1) and the objects are placed uniformly at random
    inside the half (1 px margin), redrawn until every pair of boxes is at least :data:`MIN_GAP` pixels apart,
    so that objects never touch and can always be counted.
    """
    gen = _as_generator(rng)
    n = scene.count
    half = size / 2.0
    base = 0.72 * min(half, size / n)
    margin = 1.0
    # the half as a box (x0, y0, x1, y1)
    region = {"left": (0.0, 0.0, half, size), "right": (half, 0.0, size, size),
              "top": (0.0, 0.0, size, half), "bottom": (0.0, half, size, size)}[scene.position]
    if gen is None:
        boxes = []
        for i in range(n):
            along = size / n * (i + 0.5)
            across = half / 2.0
            if scene.position in ("left", "right"):
                cx, cy = (across if scene.position == "left" else size - across), along
            else:
                cx, cy = along, (across if scene.position == "top" else size - across)
            boxes.append((cx, cy, base))
        return boxes
    x0, y0, x1, y1 = region
    for _ in range(1000):
        sides = [base * gen.uniform(0.8, 1.0) for _ in range(n)]
        boxes = [(gen.uniform(x0 + margin + s / 2, x1 - margin - s / 2),
                  gen.uniform(y0 + margin + s / 2, y1 - margin - s / 2), s) for s in sides]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) - (a[2] + b[2]) / 2 >= MIN_GAP
               for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            return boxes
    raise RuntimeError(f"could not place {n} objects apart in the {scene.position} half of a {size} px canvas")


def render(scene: Scene, size: int = 32, rng: int | np.random.Generator | None = None) -> Image.Image:
    """Render ``scene`` as an RGB ``size`` x ``size`` PIL image (deterministic for a given ``rng`` seed).

    ``rng=None`` gives the canonical layout; an int seed or a ``numpy.random.Generator`` jitters sizes and
    positions (see :func:`layout`).
    """
    if size < 16:
        raise ValueError(f"size must be at least 16 px, got {size}")
    big = size * _SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    fill = COLORS[scene.color]
    for cx, cy, side in layout(scene, size, rng):
        x0, y0 = (cx - side / 2) * _SUPERSAMPLE, (cy - side / 2) * _SUPERSAMPLE
        x1, y1 = (cx + side / 2) * _SUPERSAMPLE, (cy + side / 2) * _SUPERSAMPLE
        # PIL boxes include their last pixel: shrink by one so a side of s covers s supersampled pixels.
        if scene.shape == "circle":
            draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif scene.shape == "square":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            draw.polygon([(x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1 - 1) / 2, y0)], fill=fill)
    return canvas.reduce(_SUPERSAMPLE)


def render_many(scenes: Sequence[Scene], size: int = 32, seed: int | None = 0) -> list[Image.Image]:
    """Render each scene with its own jitter stream ``(seed, index)``; ``seed=None`` renders canonical layouts."""
    return [render(s, size, None if seed is None else np.random.default_rng([seed, i])) for i, s in enumerate(scenes)]
