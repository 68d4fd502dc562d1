#!/usr/bin/env python
"""Build a tiny random-weight pipeline of any supported family offline and save it with ``save_pretrained``.

    python scripts/make_tiny_pipeline.py --family sd3 --output /tmp/tiny-sd3 [--seed 0]
    python scripts/make_tiny_pipeline.py --family wan --variant two_experts --output /tmp/tiny-wan22

Families: sd3, flux, qwenimage, wan, flux_kontext, qwenimage_edit, flux2_klein, zimage, flux2, qwenimage_edit_plus,
qwenimage21, wan_i2v (``flowgrpo.testing.TINY_FAMILIES``); variants: ``flowgrpo.testing.TINY_VARIANTS`` (``wan``:
``two_experts``, Wan 2.2 A14B's layout; ``flux2_klein``: ``distilled``; ``wan_i2v``: ``two_experts``, Wan 2.2
I2V-A14B, and ``ti2v``, Wan 2.2 TI2V-5B's image conditioning). The folder loads with stock
``DiffusionPipeline.from_pretrained(DIR)`` (``qwenimage_edit``, ``qwenimage_edit_plus`` and ``qwenimage21``: after
``import flowgrpo.testing``, which defines their image-only processors); see ``flowgrpo.testing.tiny_pipelines`` for
the architectures.
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
    from flowgrpo.testing import TINY_FAMILIES, TINY_VARIANTS, save_tiny_pipeline
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.testing import TINY_FAMILIES, TINY_VARIANTS, save_tiny_pipeline


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=TINY_FAMILIES, required=True, help="pipeline family to build")
    parser.add_argument("--output", type=Path, required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    variants = sorted({v for vs in TINY_VARIANTS.values() for v in vs})
    parser.add_argument("--variant", default=None, help=f"another layout of the family ({', '.join(variants)})")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.variant is not None and args.variant not in TINY_VARIANTS.get(args.family, ()):
        known = TINY_VARIANTS.get(args.family, ())
        parser.error(f"--variant {args.variant!r}: the {args.family} pipeline has "
                     + (f"the variants {', '.join(known)}" if known else "no variants"))
    if args.output.exists() and any(args.output.iterdir()):
        parser.error(f"--output {args.output} exists and is not empty; choose a new or empty folder")

    start = time.perf_counter()
    path = save_tiny_pipeline(args.family, args.output, seed=args.seed, variant=args.variant)
    elapsed = time.perf_counter() - start
    size_mb = _folder_size(path) / 2**20
    what = args.family if args.variant is None else f"{args.family} ({args.variant})"
    print(f"Saved tiny {what} pipeline (seed {args.seed}) to {path.resolve()} "
          f"({size_mb:.2f} MB, built in {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
