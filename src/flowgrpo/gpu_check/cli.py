"""``python scripts/gpu_check.py --output outputs/gpu_check`` (``make gpu-check``): every GPU check, one subprocess each.

Exit status: 0 when every selected check passed, 1 when any failed or timed out, 2 for a machine without CUDA (said
before anything heavy is imported or built) or a bad selection, 130 when interrupted (the running check's processes
are terminated first; the report keeps what finished).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from .plan import Check, PlanError, build_plan, check_dir, repo_root, select_checks

__all__ = ["cuda_gpu_count", "main"]

EXIT_NO_CUDA = 2


def _nvidia_smi_gpus() -> int | None:
    """GPUs listed by ``nvidia-smi -L`` (``None`` when the tool is missing or fails): no torch import needed."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def cuda_gpu_count() -> tuple[int, str]:
    """``(visible CUDA GPUs, reason when 0)``: ``nvidia-smi`` first, then torch (a CPU build sees none)."""
    listed = _nvidia_smi_gpus()
    if listed == 0 or (listed is None and shutil.which("nvidia-smi") is not None):
        return 0, "nvidia-smi lists no GPU (or fails)"
    import torch  # nvidia-smi missing (some containers) or GPUs listed: ask the CUDA runtime

    if not torch.cuda.is_available():
        seen = f"nvidia-smi lists {listed} GPU(s) but " if listed else "nvidia-smi is not installed and "
        return 0, (f"{seen}torch {torch.__version__} cannot use CUDA (a CPU build, no driver, or a driver too old "
                   "for it); on a GPU machine reinstall with `make install TORCH=cuda`")
    count = torch.cuda.device_count()
    return count, "" if count else "torch sees no CUDA device (check CUDA_VISIBLE_DEVICES)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description="Run every GPU check (bf16 on-policy ratios, accelerate launches, benchmarks, "
                                         "the 24 GB memory recipe, OCR throughput); write report.md and report.json.")
    parser.add_argument("--output", default="outputs/gpu_check",
                        help="folder of the report, the per-check logs and the random-weight model folders the checks "
                             "build (reused by later runs; about 22 GB)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only these checks: exact names or group prefixes (e.g. bf16_onpolicy launch "
                             "launch/zero2 bench/sd35m-random memory reward)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (needs no GPU)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to plan for with --dry-run (default: what nvidia-smi lists, else 1)")
    parser.add_argument("--bench-steps", type=int, default=2, help="measured steps of each benchmark (default 2)")
    parser.add_argument("--bench-warmup-steps", type=int, default=1, help="warm-up steps of each benchmark (default 1)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every check's time limit (slower GPUs, shared machines)")
    parser.add_argument("--update-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH",
                        help="also write the measured rows into docs/benchmarks.md (or PATH)")
    return parser


def _print_plan(checks: list[Check], num_gpus: int, output: Path, note: str = "") -> None:
    total = sum(c.timeout_s for c in checks)
    print(f"gpu-check plan: {len(checks)} check(s) for {num_gpus} GPU(s){note}; output in {output}; "
          f"time limits add up to {total / 60:.0f} min")
    for i, check in enumerate(checks, 1):
        print(f"  {i:>2}. {check.name:<32} limit {check.timeout_s:>5.0f} s  {check.description}")
        print(f"      $ {' '.join(check.command)}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    output = Path(args.output).resolve()  # the checks run from the repository root
    if args.bench_steps < 1 or args.bench_warmup_steps < 0:
        print(f"gpu-check: error: --bench-steps {args.bench_steps} must be >= 1 and --bench-warmup-steps "
              f"{args.bench_warmup_steps} >= 0", file=sys.stderr)
        return 2

    if args.dry_run:
        num_gpus = args.gpus if args.gpus is not None else (_nvidia_smi_gpus() or 0)
        note = "" if args.gpus is not None or num_gpus else " (none found; planned as 1)"
        num_gpus = max(1, num_gpus)
    else:
        num_gpus, why = cuda_gpu_count()
        if num_gpus < 1:
            print(f"gpu-check: error: no CUDA GPU on this machine: {why}. The GPU checks need at least one CUDA GPU; "
                  "`python scripts/gpu_check.py --dry-run` prints the plan without one.", file=sys.stderr)
            return EXIT_NO_CUDA
        note = ""
    try:
        plan = build_plan(num_gpus, output, bench_steps=args.bench_steps, bench_warmup_steps=args.bench_warmup_steps,
                          timeout_scale=args.timeout_scale)
        checks = select_checks(plan, args.only)
    except PlanError as err:
        print(f"gpu-check: error: {err}", file=sys.stderr)
        return 2
    _print_plan(checks, num_gpus, output, note)
    if args.dry_run:
        return 0

    from .report import (
        benchmark_row,
        check_row,
        git_commit,
        machine_info,
        machine_label,
        update_benchmarks_doc,
        write_report,
    )
    from .runner import GpuMemorySampler, run_check

    repo = repo_root()
    machine = machine_info()
    commit = git_commit(repo)
    command = [sys.executable, "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the children import this very flowgrpo
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("WANDB_MODE", "disabled")
    results = []
    try:
        for i, check in enumerate(checks, 1):
            pending = [c.name for c in checks[i:]]
            write_report(results, output, machine=machine, commit=commit, command=command,
                         pending=[check.name, *pending], started_at=started, finished=False)
            print(f"[gpu-check] ({i}/{len(checks)}) {check.name}: running (limit {check.timeout_s:.0f} s)", flush=True)
            result = run_check(check, check_dir(output, check.name), cwd=repo, env=env, gpu_sampler=GpuMemorySampler())
            results.append(result)
            reason = f" - {result.failures[0]}" if result.failures else ""
            print(f"[gpu-check] ({i}/{len(checks)}) {check.name}: {result.status.upper()} in {result.wall_s:.0f} s"
                  f"{' - ' + result.summary if result.summary else ''}{reason}", flush=True)
    except KeyboardInterrupt:
        write_report(results, output, machine=machine, commit=commit, command=command,
                     pending=[c.name for c in checks[len(results):]], started_at=started, finished=False)
        print("[gpu-check] interrupted; the report holds the checks that finished", file=sys.stderr)
        return 130
    md, js = write_report(results, output, machine=machine, commit=commit, command=command, started_at=started)
    passed = sum(r.passed for r in results)
    print(f"[gpu-check] {passed} of {len(results)} checks passed; report: {md} and {js}")
    if args.update_docs:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        label = machine_label(machine)
        bench = {r.metrics["benchmark"]["preset"]: benchmark_row(r.metrics["benchmark"], date=date, machine=label,
                                                                 commit=commit)
                 for r in results if isinstance(r.metrics.get("benchmark"), dict)}
        rows = {r.name: check_row(r, date=date, machine=label, commit=commit) for r in results}
        path = update_benchmarks_doc(Path(args.update_docs) if Path(args.update_docs).is_absolute()
                                     else repo / args.update_docs, bench, rows)
        print(f"[gpu-check] rows written into {path}")
    return 0 if passed == len(results) else 1
