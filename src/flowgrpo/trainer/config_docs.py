"""Configuration docstrings generated from the fields, TRL-style: every parameter with its type, default and help,
grouped by concern.

A configuration class marks its concerns in its source with section comments (``# ---- groups and batches ----``);
`document_config` reads them (for the class and every flowgrpo class it inherits from), and appends to the class's
own docstring a ``Parameters`` section::

    > Groups and batches

    num_generations (`int`, defaults to `16`):
        Images per prompt (the group size G). ...

The fields of ``transformers.TrainingArguments`` that flowgrpo does not redefine keep their transformers meaning and
are named once at the end. ``tests/cli/test_architecture.py`` checks every configuration of the trainer registry
against its fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from typing import Any

__all__ = ["config_groups", "document_config", "parameters_section"]

_SECTION = re.compile(r"^\s*#\s*-{3,}\s*(?P<title>[^-].*?)\s*-{3,}\s*$")
_FIELD = re.compile(r"^\s{4}(?P<name>[a-z_][a-z0-9_]*)\s*:\s*[^=]+?=\s*field\(")
_WIDTH = 116


def config_groups(cls: type) -> list[tuple[str, list[str]]]:
    """``[(concern, [field names])]`` for the fields flowgrpo's classes of ``cls``'s MRO define, in the order a reader
    meets them: the class's own concerns first, then those of its flowgrpo bases. A field redefined by a subclass is
    listed once, under the subclass's concern."""
    seen: set[str] = set()
    groups: list[tuple[str, list[str]]] = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("flowgrpo.") or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # no source (a frozen build): nothing to group by
            continue
        title = "Other parameters"
        for line in source.splitlines():
            section = _SECTION.match(line)
            if section:
                title = section.group("title").strip().rstrip(":")
                continue
            found = _FIELD.match(line)
            if found and found.group("name") not in seen:
                name = found.group("name")
                seen.add(name)
                if groups and groups[-1][0] == title:
                    groups[-1][1].append(name)
                else:
                    groups.append((title, [name]))
    return groups


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if not isinstance(f.default, str) else f'"{f.default}"'
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def parameters_section(cls: type) -> str:
    """The generated ``Parameters`` section of ``cls``'s docstring."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    lines = ["Parameters:", ""]
    documented: set[str] = set()
    for title, names in config_groups(cls):
        lines += [f"    > {title[0].upper()}{title[1:]}", ""]
        for name in names:
            f = fields.get(name)
            if f is None:
                continue
            documented.add(name)
            lines.append(f"    {name} (`{_type_name(f.type)}`, defaults to `{_default(f)}`):")
            text = " ".join(str(f.metadata.get("help", "")).split()) or "(no description)"
            lines += textwrap.wrap(text, _WIDTH - 8, initial_indent=" " * 8, subsequent_indent=" " * 8)
        lines.append("")
    rest = sorted(name for name in fields if name not in documented and not name.startswith("_"))
    if rest:
        lines += ["    > The other fields of `transformers.TrainingArguments`", ""]
        lines += textwrap.wrap(", ".join(rest) + ": as transformers documents them.", _WIDTH - 8,
                               initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines).rstrip() + "\n"


def document_config(cls: type) -> type:
    """Class decorator (after ``@dataclass``): append the generated ``Parameters`` section to the docstring."""
    intro = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    intro = intro.split("\nParameters:\n")[0].rstrip()
    cls.__doc__ = f"{intro}\n\n{parameters_section(cls)}" if intro else parameters_section(cls)
    return cls
