#!/usr/bin/env python
"""Build a tiny random-weight SD3 or FLUX pipeline offline and save it with ``save_pretrained``.

    python scripts/make_tiny_pipeline.py --family sd3 --output /tmp/tiny-sd3 [--seed 0]

The folder loads with stock ``DiffusionPipeline.from_pretrained(DIR)``; see ``flowgrpo.testing.tiny_pipelines``
for the architectures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    from flowgrpo.testing import TINY_FAMILIES, save_tiny_pipeline
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.testing import TINY_FAMILIES, save_tiny_pipeline


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=TINY_FAMILIES, required=True, help="pipeline family to build")
    parser.add_argument("--output", type=Path, required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.output.exists() and any(args.output.iterdir()):
        parser.error(f"--output {args.output} exists and is not empty; choose a new or empty folder")

    start = time.perf_counter()
    path = save_tiny_pipeline(args.family, args.output, seed=args.seed)
    elapsed = time.perf_counter() - start
    size_mb = _folder_size(path) / 2**20
    print(f"Saved tiny {args.family} pipeline (seed {args.seed}) to {path.resolve()} "
          f"({size_mb:.2f} MB, built in {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
