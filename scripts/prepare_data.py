#!/usr/bin/env python
"""Download the public Flow-GRPO prompt sets (OCR, GenEval, PickScore) into ``data/<name>/``.

    python scripts/prepare_data.py all                       # data/ocr, data/geneval, data/pickscore
    python scripts/prepare_data.py ocr --output_dir data
    python scripts/prepare_data.py geneval --dry_run         # print what would be downloaded

The files come from the Flow-GRPO repository (``dataset/<name>/``): ``train.txt`` / ``test.txt`` for OCR and
PickScore (one prompt per line), ``train_metadata.jsonl`` / ``test_metadata.jsonl`` for GenEval (a ``prompt`` plus
the object tags the GenEval scorer needs). They are saved under the same names, which ``src/train.py`` reads with
``dataset_name: ./data/<name>``. ``--base_url`` points at a mirror; ``--revision`` pins a commit. This needs network
access at your site; nothing in the test suite runs it.

``geneval`` also fetches the benchmark itself: GenEval's ``prompts/evaluation_metadata.jsonl`` (553 prompts) from
djghosh13/geneval at a pinned commit (``--geneval_base_url`` for a mirror), saved as
``data/geneval/evaluation_metadata.jsonl`` for ``flowgrpo evaluate --benchmark geneval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

DEFAULT_BASE_URL = "https://raw.githubusercontent.com/yifan123/flow_grpo"
DEFAULT_REVISION = "main"
#: GenEval's repository and the commit its evaluation metadata is read at (the rules in flowgrpo.rewards.geneval follow
#: the same commit).
GENEVAL_BASE_URL = "https://raw.githubusercontent.com/djghosh13/geneval"
GENEVAL_COMMIT = "af4902f24d3ca90ebbb446dd9891a59e0f82725f"
#: dataset name -> (path in GenEval's repository, saved name, expected number of lines)
GENEVAL_FILES: dict[str, tuple[tuple[str, str, int], ...]] = {
    "geneval": (("prompts/evaluation_metadata.jsonl", "evaluation_metadata.jsonl", 553),),
}

#: dataset name -> files in the Flow-GRPO repository's dataset/<name>/ folder
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "ocr": ("train.txt", "test.txt"),
    "pickscore": ("train.txt", "test.txt"),
    "geneval": ("train_metadata.jsonl", "test_metadata.jsonl"),
}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="+", choices=[*PROMPT_SETS, "all"], help="prompt sets to download")
    parser.add_argument("--output_dir", default="data", help="parent folder; each set goes to <output_dir>/<name>/")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL, help="raw-file root of the Flow-GRPO repository")
    parser.add_argument("--revision", default=DEFAULT_REVISION, help="branch, tag or commit to download from")
    parser.add_argument("--geneval_base_url", default=GENEVAL_BASE_URL,
                        help="raw-file root of the GenEval repository (the benchmark's evaluation_metadata.jsonl)")
    parser.add_argument("--force", action="store_true", help="download again even when the file exists")
    parser.add_argument("--dry_run", action="store_true", help="print the downloads without doing them")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per file")
    return parser


def plan_downloads(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """``[(url, destination)]`` for the requested sets, in a stable order."""
    names = list(PROMPT_SETS) if "all" in args.datasets else list(dict.fromkeys(args.datasets))
    plan = []
    for name in names:
        for filename in PROMPT_SETS[name]:
            url = f"{args.base_url.rstrip('/')}/{args.revision}/dataset/{name}/{filename}"
            plan.append((url, Path(args.output_dir) / name / filename))
        for source, filename, _ in GENEVAL_FILES.get(name, ()):
            url = f"{args.geneval_base_url.rstrip('/')}/{GENEVAL_COMMIT}/{source}"
            plan.append((url, Path(args.output_dir) / name / filename))
    return plan


_EXPECTED_LINES = {filename: n for files in GENEVAL_FILES.values() for _, filename, n in files}


def _check(path: Path) -> int:
    """Number of prompts in a downloaded file; raises when it is not a prompt file."""
    text = path.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        for n, line in enumerate(lines, start=1):
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path} line {n} has no 'prompt' field")
    if not lines:
        raise ValueError(f"{path} is empty")
    expected = _EXPECTED_LINES.get(path.name)
    if expected is not None and len(lines) != expected:
        raise ValueError(f"{path} has {len(lines)} prompts; GenEval's {path.name} has {expected}. Delete it and "
                         f"download it again")
    return len(lines)


def download(url: str, dest: Path, timeout: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".part")
    with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as f:
        while chunk := response.read(1 << 16):
            f.write(chunk)
    partial.replace(dest)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    for url, dest in plan_downloads(args):
        if args.dry_run:
            print(f"{url} -> {dest}")
            continue
        if dest.exists() and not args.force:
            print(f"{dest}: present ({_check(dest)} prompts); --force downloads it again")
            continue
        try:
            download(url, dest, args.timeout)
        except OSError as err:
            print(f"error: could not download {url}: {err}. Check the network, or pass --base_url for a mirror.",
                  file=sys.stderr)
            return 1
        print(f"{dest}: {_check(dest)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
