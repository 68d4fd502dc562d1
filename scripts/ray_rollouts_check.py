#!/usr/bin/env python
"""The Ray rollout backend against the local one on the toy world: learning at equal steps, and throughput.

    python scripts/ray_rollouts_check.py learning --steps 150 --seeds 0 1 2 --output outputs/ray_learning
    python scripts/ray_rollouts_check.py learning --recipes recipes/toy_dgpo.yaml recipes/toy_crd.yaml \
        --steps 150 --seeds 0 1 2 --output outputs/ray_learning_dgpo_crd
    python scripts/ray_rollouts_check.py throughput --steps 40 --repeats 3 --output outputs/ray_throughput

``learning``: for each recipe (``recipes/toy_nft_fast.yaml``, ``recipes/toy.yaml``) and seed, the local backend and
``--rollout_backend ray --rollout_workers 1 --max_staleness 1`` train for ``--steps`` optimizer steps through the
launch script (``src/train.py``, one torch thread per process; the Ray run starts its own token-authenticated local
cluster), the pair of one seed running side by side (two runs at a time), then evaluate once at the last step on the
world's held-out prompts (43 prompts x 4 images, the recipe's evaluation settings). Reported per recipe and backend:
held-out shape accuracy (``eval_rewards/toy_shape/mean``) and colour accuracy, mean and standard deviation over the
seeds; and per recipe the paired differences Ray - local (mean and standard deviation over the seeds) with the noise
of one evaluation, the binomial standard error sqrt(p (1 - p) / n) of an accuracy p over the n images evaluated.
``--recipes`` picks the recipes (default: ``recipes/toy_nft_fast.yaml`` and ``recipes/toy.yaml``; DGPO and CRD:
``recipes/toy_dgpo.yaml recipes/toy_crd.yaml``). Runs already finished in ``--output`` are read back, not run again.

``throughput``: toy_nft_fast and toy (``--recipes``) for ``--steps`` steps without evaluation, alternating the local
backend with two torch threads, the Ray backend with a trainer of one thread and one worker of one thread
(``max_staleness 1``) and, for reference, the local backend with one thread, ``--repeats`` times each, one run at a
time; seconds per step measured from step 10 to the last (after start-up and the first generations), from each
run's step-end times, with the machine's load average at the end of each run.

Results: ``<output>/results.json`` and a markdown table on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("recipes/toy_nft_fast.yaml", "recipes/toy.yaml")
RAY = ["--rollout_backend", "ray", "--rollout_workers", "1", "--max_staleness", "1",
       "--rollout_worker_resources", '{"num_cpus": 1}']

#: run inside each child: the launch script, with a callback writing each step's end time
CHILD = r"""
import json, sys, time
from transformers import TrainerCallback
from flowgrpo.cli.train import main
from flowgrpo.trainer.online_trainer import OnlineRLTrainer
times = []
class StepClock(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        times.append(time.perf_counter())
init = OnlineRLTrainer.__init__
def with_clock(self, *a, **k):
    init(self, *a, **k)
    self.add_callback(StepClock())
OnlineRLTrainer.__init__ = with_clock
trainer = main(sys.argv[2:])
json.dump({"step_end_times": times, "log_history": trainer.state.log_history}, open(sys.argv[1], "w"))
"""


def _world() -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=print)


def _command(recipe: str, world: Path, out: Path, steps: int, seed: int, threads: int, extra: list[str],
             evaluate: bool) -> list[str]:
    cmd = [recipe, "--model_name_or_path", str(world), "--dataset_name", str(world / "prompts_train.txt"),
           "--eval_dataset_name", str(world / "prompts_eval.txt"), "--output_dir", str(out), "--max_steps", str(steps),
           "--seed", str(seed), "--cpu_threads", str(threads), "--eval_on_start", "false", "--disable_tqdm", "true",
           "--save_strategy", "no", *extra]
    cmd += ["--eval_strategy", "steps", "--eval_steps", str(steps)] if evaluate else ["--eval_strategy", "no"]
    return [sys.executable, "-c", CHILD, str(out / "clock.json"), *cmd]


def _start(cmd: list[str], out: Path, threads: int) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "FLOWGRPO_CPU_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    log = open(out / "log.txt", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _read(out: Path) -> dict:
    return json.loads((out / "clock.json").read_text())


def learning(args: argparse.Namespace) -> dict:
    world = _world()
    results = []
    for recipe in args.recipes or RECIPES:
        for seed in args.seeds:
            runs = {}
            for backend, extra in (("local", []), ("ray", RAY)):
                out = Path(args.output) / Path(recipe).stem / backend / f"seed{seed}"
                if not (out / "clock.json").is_file():
                    runs[backend] = (_start(_command(recipe, world, out, args.steps, seed, 1, extra, True), out, 1), out)
                else:
                    runs[backend] = (None, out)
            for backend, (proc, out) in runs.items():
                if proc is not None and proc.wait() != 0:
                    raise SystemExit(f"{recipe} {backend} seed {seed} failed: see {out / 'log.txt'}")
                history = _read(out)["log_history"]
                final = [h for h in history if "eval_rewards/toy_shape/mean" in h][-1]
                staleness = [h["rollout/staleness_mean"] for h in history if "rollout/staleness_mean" in h]
                results.append({"recipe": recipe, "backend": backend, "seed": seed, "step": final["step"],
                                "shape": final["eval_rewards/toy_shape/mean"],
                                "images": final.get("eval_rewards/toy_shape/count"),
                                "color": final.get("eval_rewards/toy_color/mean"),
                                "shape_cfg3": final.get("eval_cfg3_rewards/toy_shape/mean"),
                                "staleness_mean": statistics.fmean(staleness) if staleness else 0.0})
                print(json.dumps(results[-1]), flush=True)
    return {"steps": args.steps, "seeds": args.seeds, "runs": results}


def throughput(args: argparse.Namespace) -> dict:
    world = _world()
    rows = []
    recipes = args.recipes or RECIPES
    for repeat in range(args.repeats):
        for recipe in recipes:
            for backend, threads, extra in (("local", 2, []), ("ray", 1, RAY), ("local-1-thread", 1, [])):
                out = Path(args.output) / Path(recipe).stem / backend / f"repeat{repeat}"
                tic = time.perf_counter()
                proc = _start(_command(recipe, world, out, args.steps, 0, threads, extra, False), out, threads)
                if proc.wait() != 0:
                    raise SystemExit(f"{recipe} {backend} failed: see {out / 'log.txt'}")
                times = _read(out)["step_end_times"]
                per_step = (times[-1] - times[9]) / (len(times) - 10)
                rows.append({"recipe": recipe, "backend": backend, "repeat": repeat, "s_per_step": per_step,
                             "wall_s": time.perf_counter() - tic, "load_average": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
    return {"steps": args.steps, "repeats": args.repeats, "runs": rows}


def _paired(result: dict) -> str:
    """Per recipe: Ray - local held-out shape accuracy, paired by seed, and the noise of one evaluation."""
    lines = ["| recipe | Ray - local: mean +- sd of the paired differences | seeds | one evaluation's binomial SE |",
             "|---|---|---|---|"]
    for recipe in dict.fromkeys(r["recipe"] for r in result["runs"]):
        runs = {(r["backend"], r["seed"]): r for r in result["runs"] if r["recipe"] == recipe}
        seeds = sorted({seed for backend, seed in runs if ("local", seed) in runs and ("ray", seed) in runs})
        if not seeds:
            continue
        diffs = [runs[("ray", s)]["shape"] - runs[("local", s)]["shape"] for s in seeds]
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        p = statistics.fmean(runs[("local", s)]["shape"] for s in seeds)
        n = runs[("local", seeds[0])].get("images") or 172  # 43 held-out prompts x 4 images
        se = (p * (1 - p) / n) ** 0.5
        lines.append(f"| {recipe} | {100 * statistics.fmean(diffs):+.1f} +- {100 * spread:.1f} pts | {len(seeds)} | "
                     f"{100 * se:.1f} pts (p = {100 * p:.1f}%, n = {int(n)}) |")
    return "\n".join(lines)


def _table(result: dict, key: str) -> str:
    lines = []
    for recipe in dict.fromkeys(r["recipe"] for r in result["runs"]):
        for backend in ("local", "ray", "local-1-thread"):
            values = [r[key] for r in result["runs"] if r["recipe"] == recipe and r["backend"] == backend]
            if values:
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                lines.append(f"| {recipe} | {backend} | {statistics.fmean(values):.4f} | {spread:.4f} | {len(values)} |")
    return "\n".join(["| recipe | backend | mean | std | runs |", "|---|---|---|---|---|", *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("learning", "throughput"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recipes", nargs="+", default=None,
                        help="the recipes (default recipes/toy_nft_fast.yaml and recipes/toy.yaml)")
    parser.add_argument("--output", default="outputs/ray_rollouts_check")
    args = parser.parse_args()
    Path(args.output).mkdir(parents=True, exist_ok=True)
    result = learning(args) if args.mode == "learning" else throughput(args)
    (Path(args.output) / "results.json").write_text(json.dumps(result, indent=1))
    print(_table(result, "shape" if args.mode == "learning" else "s_per_step"))
    if args.mode == "learning":
        print(_paired(result))


if __name__ == "__main__":
    main()
