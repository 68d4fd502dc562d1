#!/usr/bin/env python
"""Compare the CPU thread policy with fixed thread counts on a benchmark preset, in alternating runs.

    python scripts/thread_benchmark.py --preset toy --rounds 3 --steps 6
    python scripts/thread_benchmark.py --preset small-cpu --settings auto,keep:1,keep:2 --json outputs/threads.json

Each setting is one ``scripts/benchmark.py`` process: ``auto`` is the trainer's thread policy (``cpu_threads:
auto``, flowgrpo.cpu_threads); ``keep:N`` applies no policy and fixes torch's process-wide intra-op threads at N
before anything is built (what ``OMP_NUM_THREADS=N`` or ``torch.set_num_threads(N)`` gives, background threads and
onnxruntime included); ``N`` is the policy with the main thread fixed at N; ``auto/SPLIT`` is the policy with
``FLOWGRPO_CPU_SPLIT=SPLIT`` (how a main thread with every core shares them with the background threads: ``yield``,
the default, ``nice``, ``both`` or ``none``). The settings run in turn, ``--rounds``
times, so that a machine whose load drifts affects them alike; the table gives each setting's median step time
over all its measured steps and its ratio to the best setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def benchmark_command(preset: str, setting: str, steps: int, warmup: int, json_out: str,
                      floor: bool = False) -> list[str]:
    """The ``scripts/benchmark.py`` command line of one setting (with ``floor``, the FLOP floor is timed after every
    step too, for the overhead ratio; otherwise only step times count)."""
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--preset", preset, "--steps", str(steps),
           "--warmup-steps", str(warmup), "--json", json_out] + ([] if floor else ["--no-floor"])
    if setting.startswith("keep:"):
        cmd += ["--threads", "keep", "--torch-threads", setting.split(":", 1)[1]]
    elif setting.startswith("auto/"):
        cmd += ["--threads", "auto"]
    else:
        cmd += ["--threads", setting]
    return cmd


#: How a main thread with every core shares them with the background (``auto/SPLIT``: $FLOWGRPO_CPU_SPLIT).
SPLITS = ("yield", "yield-forward", "nice", "both", "none")


def split_env(setting: str) -> dict[str, str]:
    """The environment a setting adds: ``auto/SPLIT`` sets ``FLOWGRPO_CPU_SPLIT``."""
    return {"FLOWGRPO_CPU_SPLIT": setting.split("/", 1)[1]} if setting.startswith("auto/") else {}


def parse_settings(text: str) -> list[str]:
    settings = [s.strip() for s in text.split(",") if s.strip()]
    for s in settings:
        value = s.split(":", 1)[1] if s.startswith("keep:") else s
        if value.startswith("auto/") and value.split("/", 1)[1] in SPLITS:
            continue
        if value != "auto" and not (value.isdigit() and int(value) >= 1):
            raise ValueError(f"setting {s!r} is not valid; use auto, auto/SPLIT (SPLIT one of {', '.join(SPLITS)}), "
                             "N or keep:N with N >= 1")
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="a CPU preset of scripts/benchmark.py (tiny, small-cpu, toy)")
    parser.add_argument("--settings", default="auto,keep:1,keep:2", help="comma-separated settings (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="times each setting runs, in turn (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (default 4)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="unmeasured steps per run (default 1)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the FLOP floor after every step and report each setting's overhead ratio "
                             "(step time / floor time, the median over its steps)")
    parser.add_argument("--json", dest="json_out", default=None, help="write every run's step times here")
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
    except ValueError as err:
        parser.error(str(err))
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")

    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FLOWGRPO_CPU_SPLIT")}
    times: dict[str, list[float]] = {s: [] for s in settings}
    ratios: dict[str, list[float]] = {s: [] for s in settings}
    floors: dict[str, list[float]] = {s: [] for s in settings}
    plans: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="flowgrpo-threads-") as tmp:
        for round_index in range(args.rounds):
            order = settings[round_index % len(settings):] + settings[:round_index % len(settings)]
            for setting in order:
                out = str(Path(tmp) / f"{round_index}-{setting.replace(':', '-')}.json")
                cmd = benchmark_command(args.preset, setting, args.steps, args.warmup_steps, out, args.floor)
                proc = subprocess.run(cmd, cwd=REPO, env={**env, **split_env(setting)}, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return proc.returncode
                result = json.loads(Path(out).read_text())
                times[setting] += result["step_times_s"]
                plans[setting] = result["machine"].get("thread_plan", "")
                extra = ""
                if args.floor and result.get("overhead_ratio_per_step"):
                    ratios[setting] += result["overhead_ratio_per_step"]
                    floors[setting].append(result["floor_time_s"])
                    extra = f", overhead ratio {result['overhead_ratio']:.3f}, floor {result['floor_time_s']:.3f} s"
                print(f"[threads] round {round_index + 1}/{args.rounds} {setting}: median "
                      f"{statistics.median(result['step_times_s']):.3f} s/step{extra}", file=sys.stderr, flush=True)
    medians = {s: statistics.median(v) for s, v in times.items()}
    best = min(medians.values())
    with_floor = args.floor and all(ratios.values())
    header = "| setting | median s/step | min-max s/step | vs best |"
    if with_floor:
        header += " median floor s | median overhead ratio (min-max) |"
    lines = [f"preset {args.preset}: {args.rounds} alternating runs per setting, {args.steps} measured steps each",
             "", header, "|---|---|---|---|" + ("---|---|" if with_floor else "")]
    for s in settings:
        line = f"| `{s}` | {medians[s]:.3f} | {min(times[s]):.3f}-{max(times[s]):.3f} | {medians[s] / best:.2f}x |"
        if with_floor:
            line += (f" {statistics.median(floors[s]):.3f} | {statistics.median(ratios[s]):.3f} "
                     f"({min(ratios[s]):.2f}-{max(ratios[s]):.2f}) |")
        lines.append(line)
    print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "rounds": args.rounds, "step_times_s": times,
                                                   "median_s": medians, "thread_plans": plans,
                                                   "overhead_ratio_per_step": ratios if args.floor else None,
                                                   "floor_time_s": floors if args.floor else None}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
