#!/usr/bin/env python
"""Write a small synthetic OCR prompt set (deterministic, offline): ``train.txt`` and ``test.txt``.

    python scripts/make_ocr_prompts.py --output_dir data/ocr_synthetic            # what the repository ships
    python scripts/make_ocr_prompts.py --output_dir /tmp/ocr --num_train 500 --format jsonl

    python scripts/make_ocr_prompts.py --edit --output_dir data/ocr_edit               # editing set (Kontext, Qwen-Edit)

Prompts look like ``a wooden sign that says "OPEN"``; ``--format jsonl`` adds an ``ocr_text`` column with the target
text. ``--edit`` writes source images (a sign with one word) and ``train.jsonl`` / ``test.jsonl`` rows asking for
another word (``Change the text on the sign to "HELLO"``, with ``image`` and ``ocr_text`` columns). The same
arguments always give the same files (see ``flowgrpo.cli.ocr_prompts``).
"""

from __future__ import annotations

import argparse
import sys


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="data/ocr_synthetic", help="folder for train.<ext> and test.<ext>")
    parser.add_argument("--num_train", type=int, default=64, help="training prompts")
    parser.add_argument("--num_test", type=int, default=8, help="evaluation prompts (disjoint from training)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--format", choices=("txt", "jsonl"), default="txt", dest="file_format",
                        help="txt: one prompt per line; jsonl: also the ocr_text target column")
    parser.add_argument("--edit", action="store_true", help="write an editing set: source images + jsonl")
    parser.add_argument("--size", type=int, default=512, help="side of the source images of --edit (pixels)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from flowgrpo.cli.ocr_prompts import write_ocr_edit_files, write_ocr_prompt_files

    args = build_arg_parser().parse_args(argv)
    if args.num_train < 1:
        print(f"error: --num_train={args.num_train} must be >= 1", file=sys.stderr)
        return 2
    if args.edit:
        if args.size < 16:
            print(f"error: --size={args.size} must be >= 16", file=sys.stderr)
            return 2
        written = write_ocr_edit_files(args.output_dir, args.num_train, args.num_test, args.seed, args.size)
    else:
        written = write_ocr_prompt_files(args.output_dir, args.num_train, args.num_test, args.seed, args.file_format)
    for split, path in written.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
