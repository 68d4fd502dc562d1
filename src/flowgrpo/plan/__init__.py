"""``flowgrpo plan``: per-GPU memory and step time of a recipe, planned on fake tensors without a GPU.

    python -m flowgrpo.plan recipes/ocr.yaml --gpu h100-80gb --json plan.json

See docs/planning.md for what is counted and how far to trust it.
"""

from .cli import JSON_KEYS, main, plan_recipe

__all__ = ["JSON_KEYS", "main", "plan_recipe"]
