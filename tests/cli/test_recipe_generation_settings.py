"""Every shipped recipe resolves to the generation settings it had before those settings could default to the model's
own: the table ``data/recipe_generation_settings.json`` was recorded from the code before that change
(``python tests/cli/test_recipe_generation_settings.py --record`` writes it again from the current code).

What is compared, per recipe: the sampling settings of training and evaluation (height and width, steps, guidance, the
evaluation guidance scales, text length, frames, negative prompt; ``resolution`` itself only through the size it gives) and what the algorithms derive from the step count (Flow-GRPO's
SDE window range, DiffusionNFT's trained timesteps, AWM's trained levels)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TABLE = Path(__file__).with_name("data") / "recipe_generation_settings.json"
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))

#: settings every trainer's configuration has
SHARED = ("height", "width", "image_size", "num_inference_steps", "eval_num_inference_steps",
          "guidance_scale", "eval_guidance_scale", "evaluation_guidance_scales", "max_sequence_length", "num_frames",
          "negative_prompt")
#: settings of one algorithm that depend on the step count
DERIVED = ("sde_window_range", "sde_window_size", "num_trained_timesteps", "train_timesteps", "timestep_fraction")


def resolved_settings(recipe: str) -> dict:
    """The generation settings ``recipe`` trains and evaluates with, as the trainer would use them (the recipe's
    explicit values; where the code can resolve the model's own, resolved from the model's configs as the trainer does
    before loading)."""
    from flowgrpo.cli.parser import parse_recipe

    script_args, model_args, args = parse_recipe(str(REPO / "recipes" / recipe))
    try:  # after the change: the values the trainer resolves (nothing is left to the model in a shipped recipe)
        from flowgrpo.plan.recipe_settings import resolve_recipe_settings
    except ImportError:  # before it: the configuration's values are the resolved ones
        resolve_recipe_settings = None
    if resolve_recipe_settings is not None:
        resolve_recipe_settings(script_args, model_args, args)
    out = {"trainer": script_args.trainer}
    for name in SHARED + DERIVED:
        if hasattr(args, name):
            value = getattr(args, name)
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _record() -> None:
    env = dict(os.environ)
    table = {}
    for recipe in RECIPES:
        table[recipe] = resolved_settings(recipe)
        os.environ.clear()
        os.environ.update(env)  # a recipe's env block must not leak into the next one
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table)} recipes to {TABLE}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_resolves_to_the_recorded_settings(recipe, monkeypatch):
    table = json.loads(TABLE.read_text())
    assert recipe in table, f"{recipe} is not in {TABLE.name}: record it (see the module docstring)"
    for key in list(os.environ):  # parse_recipe applies the recipe's env block; keep it inside this test
        monkeypatch.setenv(key, os.environ[key])
    assert resolved_settings(recipe) == table[recipe]


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        _record()
    else:
        print(__doc__)
