#!/usr/bin/env python
"""Write offline preference pairs on the toy world for Diffusion-DPO (recipes/toy_dpo.yaml).

    python scripts/make_toy_dpo_pairs.py --world .cache/toy-world --output .cache/toy-world/dpo_pairs \
        [--images_per_prompt 8] [--seed 0] [--max_prompts N]

For each training prompt the world's pipeline draws images, the recipes' toy rewards score them (toy_shape_score +
0.5 toy_color), and the best and worst become the pair (flowgrpo.toy.dpo_pairs). Writes train.jsonl (prompt, chosen,
rejected), images/ and pairs.json. The world is built first when missing (scripts/make_toy_world.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    from flowgrpo.toy.dpo_pairs import make_toy_dpo_pairs
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.toy.dpo_pairs import make_toy_dpo_pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=Path, default=Path(".cache/toy-world"), help="toy world folder")
    parser.add_argument("--output", type=Path, default=None, help="pairs folder (default: WORLD/dpo_pairs)")
    parser.add_argument("--images_per_prompt", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_prompts", type=int, default=None)
    args = parser.parse_args(argv)
    if not (args.world / "toy_world.json").is_file():
        from flowgrpo.toy.build import cached_toy_world

        print(f"[flowgrpo] preparing the toy world in {args.world}", flush=True)
        shutil.copytree(cached_toy_world("full", seed=0), args.world, dirs_exist_ok=True)
    path = make_toy_dpo_pairs(args.world, args.output or args.world / "dpo_pairs",
                              images_per_prompt=args.images_per_prompt, seed=args.seed, max_prompts=args.max_prompts)
    print(f"[flowgrpo] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
