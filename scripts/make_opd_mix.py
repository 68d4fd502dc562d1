#!/usr/bin/env python
"""Merge prompt sets into one multi-domain set for on-policy distillation from several teachers.

    python scripts/make_opd_mix.py ocr=data/ocr geneval=data/geneval pickscore=data/pickscore --output data/opd_mix

Each ``name=source`` is a local prompt folder (its ``train`` and ``test`` files, as ``dataset_name`` reads them) or a
single prompt file (used for both splits). The output folder gets ``train.jsonl`` and ``test.jsonl``: every prompt
with its set's name in a ``dataset_name`` column, the column that ``teachers: [{lora, dataset_name}, ...]`` matches
(``recipes/opd_sd35m_multi_teacher.yaml``). Other columns are left out: each domain's rewards read their own sets.
``--max_per_domain`` keeps the first N prompts of each set per split (the sets differ much in size).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    from flowgrpo.cli.data import PROMPT_FILE_SUFFIXES, read_prompt_file
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, str(REPO / "src"))
    from flowgrpo.cli.data import PROMPT_FILE_SUFFIXES, read_prompt_file


def split_file(folder: Path, split: str) -> Path | None:
    """The folder's file of ``split``, named as ``dataset_name`` finds it (``train.txt``, ``train_metadata.jsonl``)."""
    for stem in (split, f"{split}_metadata"):
        for suffix in PROMPT_FILE_SUFFIXES:
            if (folder / f"{stem}{suffix}").is_file():
                return folder / f"{stem}{suffix}"
    return None


def read_split(source: Path, split: str) -> list[str]:
    path = source if source.is_file() else split_file(source, split)
    if path is None:
        raise SystemExit(f"error: {source} has no {split} prompt file ({split}.txt, {split}_metadata.jsonl, ...)")
    return list(read_prompt_file(path)["prompt"])


def make_mix(sources: dict[str, Path], output: Path, max_per_domain: int | None = None) -> dict[str, dict[str, int]]:
    """Write ``output/{train,test}.jsonl``; returns the prompts written per split and domain."""
    output.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for split in ("train", "test"):
        rows = []
        for name, source in sources.items():
            prompts = read_split(source, split)[:max_per_domain]
            rows += [{"prompt": p, "dataset_name": name} for p in prompts]
            counts.setdefault(split, {})[name] = len(prompts)
        (output / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="+", metavar="NAME=SOURCE", help="a domain name and its prompt folder or file")
    parser.add_argument("--output", type=Path, required=True, help="the folder to write train.jsonl and test.jsonl to")
    parser.add_argument("--max_per_domain", type=int, default=None, help="keep at most this many prompts per set")
    args = parser.parse_args(argv)
    sources = {}
    for item in args.sets:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            parser.error(f"{item!r} is not NAME=SOURCE (e.g. ocr=data/ocr)")
        if name in sources:
            parser.error(f"the domain {name!r} is given twice")
        if not Path(source).exists():
            parser.error(f"{source} does not exist (python scripts/prepare_data.py all downloads the public sets)")
        sources[name] = Path(source)
    for split, per in make_mix(sources, args.output, args.max_per_domain).items():
        print(f"{args.output / (split + '.jsonl')}: " + ", ".join(f"{n} {c}" for n, c in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
