"""The toy text-to-image world: coloured shapes, their captions, programmatic rewards, and a pretrained pipeline.

::

    from flowgrpo.toy import Scene, caption, parse_caption, render
    image = render(parse_caption("two red circles on the left"), size=32, rng=0)

    from flowgrpo.toy.build import build_toy_world          # trains and saves a StableDiffusion3Pipeline
    build_toy_world("toy-world", seed=0)

Importing this package registers the rewards ``toy_color``, ``toy_shape``, ``toy_position``, ``toy_count``,
``toy_geneval`` and ``toy_shape_score`` (:mod:`flowgrpo.toy.rewards`).
"""

from . import rewards  # noqa: F401  (registers the toy rewards)
from .rewards import check_attributes, detect_objects, score_images
from .world import (
    COLORS,
    COUNTS,
    POSITIONS,
    SHAPES,
    Scene,
    all_scenes,
    caption,
    parse_attributes,
    parse_caption,
    render,
    render_many,
    split_scenes,
)

__all__ = [
    "COLORS",
    "COUNTS",
    "POSITIONS",
    "SHAPES",
    "Scene",
    "all_scenes",
    "caption",
    "parse_attributes",
    "parse_caption",
    "render",
    "render_many",
    "split_scenes",
    "check_attributes",
    "detect_objects",
    "score_images",
]
