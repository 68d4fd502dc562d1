#!/usr/bin/env python
"""Benchmark full FlowGRPOTrainer steps on a preset: step time, breakdown, FLOP floor, overhead ratio.

    python scripts/benchmark.py --preset small-cpu --steps 5 --json outputs/bench-small-cpu.json
    make bench PRESET=small-cpu STEPS=5

Presets: tiny (smoke test), small-cpu (~34M-parameter MMDiT on CPU), toy (the toy world with recipes/toy.yaml),
sd35m-random and flux-random (full-size architectures with random weights, bf16, CUDA only). Models are built from config with random weights; nothing is
downloaded. See docs/benchmarks.md for the figures and flowgrpo/benchmarking/ for the definitions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


def main(argv: list[str] | None = None) -> int:
    from flowgrpo.benchmarking.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="which preset to run")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured optimizer steps after the warm-up (default: the preset's, 5 or 2 for tiny)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="unmeasured steps first (default 1)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file")
    parser.add_argument("--threads", default=None,
                        help="the trainer's cpu_threads: 'auto' (the thread policy, the CPU presets' default), 'keep' "
                             "(no policy) or the main thread's torch threads")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's process-wide intra-op threads before anything is built; with --threads keep "
                             "this is a fixed setting like OMP_NUM_THREADS=N")
    parser.add_argument("--no-floor", action="store_true", help="skip the FLOP-floor measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ab", choices=["decode", "reward", "all", "timesteps_per_pass"], default=None,
                        help="switch the trainer's overlaps (background decode / reward-training overlap / both) on "
                             "and off on alternate steps and report the overhead ratio of each arm; "
                             "timesteps_per_pass: train_timesteps_per_pass all (on) against 1 (off), with each arm's "
                             "training phase (forward + backward per optimizer step)")
    parser.add_argument("--passes-rounds", type=int, default=0,
                        help="after the steps, time one more generation's training phase (forward + backward of its "
                             "micro-batches, nothing in the background) at train_timesteps_per_pass 1 and all, this "
                             "many rounds each, alternating")
    parser.add_argument("--thread-speedup", action="store_true",
                        help="CPU: after the steps, time the floor with the main thread at 1 thread and at its own "
                             "count (floor_thread_speedup) and report overhead_bound, the least overhead ratio the "
                             "background's work allows")
    args = parser.parse_args(argv)

    from flowgrpo.benchmarking import format_report, run_benchmark

    try:
        result = run_benchmark(args.preset, args.steps, warmup_steps=args.warmup_steps, threads=args.threads,
                               torch_threads=args.torch_threads, measure_floor=not args.no_floor, seed=args.seed, ab=args.ab,
                               thread_speedup=args.thread_speedup, passes_rounds=args.passes_rounds,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if "torch.cuda.is_available()" in str(e):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    print(format_report(result))
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
