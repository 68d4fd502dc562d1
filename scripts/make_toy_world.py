#!/usr/bin/env python
"""Build the toy text-to-image world: render shapes, train a tiny VAE and SD3 transformer, save the pipeline.

    python scripts/make_toy_world.py --output .cache/toy-world [--seed 0] [--preset full|light] [--threads N]
    python scripts/make_toy_world.py --ship      # remake the world shipped in the package (full, seed 0, 1 thread)

Writes a stock ``StableDiffusion3Pipeline`` folder (``DiffusionPipeline.from_pretrained(DIR)`` loads it) plus
``prompts_train.txt``, ``prompts_eval.txt`` (disjoint scenes) and ``toy_world.json`` (settings, accuracies,
timing). The ``full`` preset is the world of ``recipes/toy.yaml`` (a few CPU minutes); ``light`` is a seconds-long
build of the same shape for tests. Deterministic for a seed, preset and thread count. See docs/toy_world.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    from flowgrpo.toy.build import (
        METADATA_FILE,
        PRESETS,
        SHIPPED_PRESET,
        SHIPPED_SEED,
        SHIPPED_WORLD_DIR,
        build_toy_world,
    )
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.toy.build import (
        METADATA_FILE,
        PRESETS,
        SHIPPED_PRESET,
        SHIPPED_SEED,
        SHIPPED_WORLD_DIR,
        build_toy_world,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output", type=Path, help="folder to write (must not exist or be empty)")
    target.add_argument("--ship", action="store_true",
                        help=f"replace the world shipped in the package ({SHIPPED_WORLD_DIR}) with a fresh build of "
                             f"preset {SHIPPED_PRESET!r}, seed {SHIPPED_SEED}, one thread (after the builder changed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, data, initialisation (default 0)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full",
                        help="'full' (the recipes' world) or 'light' (seconds, for tests); default full")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the build (default 1: the same world on every machine; the build is "
                             "deterministic for a seed and thread count)")
    parser.add_argument("--no-eval", action="store_true", help="skip measuring the accuracies on the eval prompts")
    args = parser.parse_args(argv)
    if args.ship:
        if (args.seed, args.preset, args.threads) != (SHIPPED_SEED, SHIPPED_PRESET, 1):
            parser.error(f"--ship makes the shipped world: preset {SHIPPED_PRESET}, seed {SHIPPED_SEED}, one thread; "
                         "drop --seed, --preset and --threads")
        args.output = SHIPPED_WORLD_DIR
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if not args.ship and args.output.exists() and (args.output.is_file() or any(args.output.iterdir())):
        parser.error(f"--output {args.output} exists and is not empty; choose a new or empty folder")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    start = time.perf_counter()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.output.name}-", dir=args.output.parent))
    try:  # build beside the target and rename into place: an interrupted build leaves no half-written world
        build_toy_world(staging / "world", seed=args.seed, config=args.preset, evaluate=not args.no_eval,
                        threads=args.threads)
        if args.output.is_dir():  # empty, or the shipped world being replaced
            shutil.rmtree(args.output)
        os.replace(staging / "world", args.output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    metadata = json.loads((args.output / METADATA_FILE).read_text(encoding="utf-8"))
    accuracy = metadata.get("eval_accuracy")
    summary = "" if not accuracy else " eval accuracy: " + ", ".join(
        f"{k} {accuracy[k]:.1%}" for k in ("color", "shape", "count", "position", "all"))
    print(f"Saved the toy world (seed {args.seed}, preset {args.preset}) to {args.output.resolve()} in "
          f"{time.perf_counter() - start:.0f} s.{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
