#!/usr/bin/env python
"""Write the table of every packaged model's resolved generation defaults into docs/model_families.md.

    python scripts/model_defaults_table.py            # rewrite the table between its markers
    python scripts/model_defaults_table.py --print    # print it instead

The table is made from the family adapters (``flowgrpo.plan.defaults_table``); the tests fail when the page differs
from what this writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    from flowgrpo.plan.defaults_table import defaults_table, replace_table
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.plan.defaults_table import defaults_table, replace_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "model_families.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", dest="show", action="store_true", help="print the table instead of writing it")
    args = parser.parse_args(argv)
    if args.show:
        print(defaults_table())
        return 0
    PAGE.write_text(replace_table(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the generation defaults table into {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
