"""Settings given as JSON on the command line (a mapping or a list in a recipe, a string on the CLI)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["decode_json_setting"]


def decode_json_setting(value: Any, name: str, fix: str) -> Any:
    """``value`` decoded when it is a string (the command line's form), else as it is; a string that is not JSON
    raises a ValueError naming the setting, the value, the parser's complaint and ``fix`` (what to write instead)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}={value!r} is not valid JSON ({err}); {fix}") from None
