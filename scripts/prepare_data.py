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

``geneval2`` is GenEval 2's benchmark file ``geneval2_data.jsonl`` (800 prompts, each with its ``atom_count``, its
``vqa_list`` of [question, answer] pairs and their ``skills``) from facebookresearch/GenEval2 at a pinned commit
(``--geneval2_base_url`` for a mirror), or copied from a local copy with ``--geneval2_file PATH``; it is saved
unchanged as ``data/geneval2/geneval2_data.jsonl``, which ``flowgrpo evaluate --benchmark geneval2`` reads and the
``geneval2`` reward takes its ``vqa_list`` column from (``dataset_name: ./data/geneval2/geneval2_data.jsonl``).
GenEval 2's data is licensed CC BY-NC 4.0.
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

#: GenEval 2's repository and the commit its benchmark file is read at (flowgrpo.rewards.geneval2 follows it).
GENEVAL2_BASE_URL = "https://raw.githubusercontent.com/facebookresearch/GenEval2"
GENEVAL2_COMMIT = "a6e82d2289e8d418f27f0adee77908b07060eea3"
GENEVAL2_FILE = "geneval2_data.jsonl"
GENEVAL2_PROMPTS = 800

#: dataset name -> files in the Flow-GRPO repository's dataset/<name>/ folder
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "ocr": ("train.txt", "test.txt"),
    "pickscore": ("train.txt", "test.txt"),
    "geneval": ("train_metadata.jsonl", "test_metadata.jsonl"),
}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="+", choices=[*PROMPT_SETS, "geneval2", "all"],
                        help="prompt sets to download ('all': the Flow-GRPO sets ocr, geneval and pickscore)")
    parser.add_argument("--output_dir", default="data", help="parent folder; each set goes to <output_dir>/<name>/")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL, help="raw-file root of the Flow-GRPO repository")
    parser.add_argument("--revision", default=DEFAULT_REVISION, help="branch, tag or commit to download from")
    parser.add_argument("--geneval_base_url", default=GENEVAL_BASE_URL,
                        help="raw-file root of the GenEval repository (the benchmark's evaluation_metadata.jsonl)")
    parser.add_argument("--geneval2_base_url", default=GENEVAL2_BASE_URL,
                        help="raw-file root of the GenEval2 repository (its geneval2_data.jsonl)")
    parser.add_argument("--geneval2_file", default=None, metavar="PATH",
                        help="a local copy of GenEval2's geneval2_data.jsonl to check and copy instead of downloading")
    parser.add_argument("--force", action="store_true", help="download again even when the file exists")
    parser.add_argument("--dry_run", action="store_true", help="print the downloads without doing them")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per file")
    return parser


def plan_downloads(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """``[(url, destination)]`` for the requested sets, in a stable order."""
    names = list(dict.fromkeys([*(PROMPT_SETS if "all" in args.datasets else ()), *args.datasets]))
    names.remove("all") if "all" in names else None
    plan = []
    for name in names:
        if name == "geneval2":
            source = args.geneval2_file or f"{args.geneval2_base_url.rstrip('/')}/{GENEVAL2_COMMIT}/{GENEVAL2_FILE}"
            plan.append((source, Path(args.output_dir) / name / GENEVAL2_FILE))
            continue
        for filename in PROMPT_SETS[name]:
            url = f"{args.base_url.rstrip('/')}/{args.revision}/dataset/{name}/{filename}"
            plan.append((url, Path(args.output_dir) / name / filename))
        for source, filename, _ in GENEVAL_FILES.get(name, ()):
            url = f"{args.geneval_base_url.rstrip('/')}/{GENEVAL_COMMIT}/{source}"
            plan.append((url, Path(args.output_dir) / name / filename))
    return plan


_EXPECTED_LINES = {filename: n for files in GENEVAL_FILES.values() for _, filename, n in files}
_EXPECTED_LINES[GENEVAL2_FILE] = GENEVAL2_PROMPTS


def _check(path: Path, exact_count: bool = True) -> int:
    """Number of prompts in a downloaded file; raises when it is not a prompt file (or, with ``exact_count``, a
    benchmark file of another length than the published one)."""
    text = path.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        for n, line in enumerate(lines, start=1):
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path} line {n} has no 'prompt' field")
            if path.name == GENEVAL2_FILE:
                from flowgrpo.evaluate.benchmarks import check_geneval2_row

                check_geneval2_row(row, f"{path} line {n}")
    if not lines:
        raise ValueError(f"{path} is empty")
    expected = _EXPECTED_LINES.get(path.name)
    if expected is not None and len(lines) != expected:
        if not exact_count:
            print(f"note: {path} has {len(lines)} prompts; the published {path.name} has {expected}")
        else:
            raise ValueError(f"{path} has {len(lines)} prompts; the published {path.name} has {expected}. Delete it "
                             f"and download it again")
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
            print(f"{dest}: present ({_check(dest, exact_count=not Path(url).is_file())} prompts); --force downloads "
                  f"it again")
            continue
        try:
            if Path(url).is_file():  # --geneval2_file: a local copy
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(Path(url).read_bytes())
            else:
                download(url, dest, args.timeout)
        except OSError as err:
            print(f"error: could not download {url}: {err}. Check the network, or pass --base_url for a mirror.",
                  file=sys.stderr)
            return 1
        try:
            print(f"{dest}: {_check(dest, exact_count=not Path(url).is_file())} prompts")
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
