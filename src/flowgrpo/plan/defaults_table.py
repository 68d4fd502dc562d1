"""The table of every packaged model's resolved generation defaults, made from the family adapters themselves.

``docs/model_families.md`` holds this table between ``<!-- defaults-table:start -->`` and ``<!-- defaults-table:end -->``;
``python scripts/model_defaults_table.py`` writes it there and the tests compare it with :func:`defaults_table`, so
the page cannot drift from the code. Each row is a Hub id of a packaged planner config (``flowgrpo/plan/model_configs``:
transformer, VAE and scheduler configs as released), resolved as the trainer resolves an unset setting
(:mod:`flowgrpo.models.defaults`); the text length is the pipeline's own (the packaged files hold no text encoder
config, so the limits read from a tokenizer or an encoder show only with the model's folder).
"""

from __future__ import annotations

from ..models.defaults import resolve_generation_settings
from .model_specs import packaged_specs, spec_from_packaged
from .recipe_settings import configs_from_spec

TABLE_START, TABLE_END = "<!-- defaults-table:start -->", "<!-- defaults-table:end -->"

_GUIDANCE = {"cfg": "CFG", "embedded": "embedded", "ignored": "ignored"}


def defaults_rows() -> list[dict[str, str]]:
    """One row per packaged Hub id: the resolved defaults and where the steps and guidance come from."""
    rows = []
    for _, raw in sorted(packaged_specs().items()):
        spec = spec_from_packaged(raw)
        for name in raw.get("names", [raw["name"]]):
            settings = resolve_generation_settings(configs_from_spec(spec, name), {})
            v, profile = settings.values, settings.profile
            rule = profile.size
            sizes = f"x{rule.multiple}" + (f", at most {rule.max_side}" if rule.max_side else "")
            text = str(v["max_sequence_length"]) + ("" if profile.text.used else " (not read)")
            rows.append({
                "model": f"`{name}`", "family": f"`{profile.family}`",
                "size": f"{v['height']} x {v['width']} ({sizes})",
                "frames": str(v["num_frames"]),
                "steps": str(v["num_inference_steps"]),
                "guidance": f"{v['guidance_scale']:g} ({_GUIDANCE[profile.guidance]}"
                            + (", distilled" if profile.published.distilled else "") + ")",
                "text tokens": text,
                "steps and guidance from": profile.published.source,
            })
    return rows


def defaults_table() -> str:
    """The markdown table of :func:`defaults_rows`."""
    rows = defaults_rows()
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def replace_table(page: str, table: str | None = None) -> str:
    """``page`` with the text between the table's markers replaced by ``table`` (default: :func:`defaults_table`)."""
    start, end = page.index(TABLE_START) + len(TABLE_START), page.index(TABLE_END)
    return page[:start] + "\n" + (table or defaults_table()) + "\n" + page[end:]


__all__ = ["TABLE_END", "TABLE_START", "defaults_rows", "defaults_table", "replace_table"]
