#!/usr/bin/env python
"""Reward hacking on the toy world: the unguarded run against each guard, over several seeds.

Every run is ``recipes/toy_hacking.yaml`` (training reward: the deliberately hackable ``toy_area``; gold evaluation
rewards: ``toy_shape`` and ``toy_color``) with one guard's overrides (`VARIANTS`). For each run it records the
training reward of every step, the gold rewards of every evaluation, the steps where the hacking alarm fired, the
training seconds and the gold rewards of the exported (best) weights; then it writes ``summary.md`` (a table per
guard: the gold rewards at the end of the unguarded trajectory and of the exported weights, the alarm, the cost in
training seconds) and ``health_demo.png`` (the training reward and the gold rewards against steps, mean over seeds).

    python scripts/health_demo.py --world ~/.cache/flowgrpo/toy-worlds/full-seed0-<fingerprint> \\
        --steps 150 --eval-every 25 --seeds 0 1 2 --output outputs/health_demo

Runs already recorded in ``--output`` are reused (``run-<variant>-seed<k>.json``), so an interrupted comparison
continues where it stopped. ``--world`` defaults to the cached toy world (built on first use, a few CPU minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "toy_hacking.yaml"

#: guard name -> command-line overrides of the recipe
VARIANTS: dict[str, list[str]] = {
    "unguarded": [],
    "alarm_stop": ["--on_hacking", "stop"],
    "kl": ["--beta", "0.04"],
    "sync_ref": ["--beta", "0.04", "--sync_ref_model", "true", "--ref_model_sync_steps", "10"],
    "gardo": ["--beta", "0.04", "--regularizer", "gardo", "--reward_funcs", "toy_area", "toy_count",
              "--reward_weights", "1", "0", "--gardo_auxiliary_rewards", "toy_count"],
    "dynamic_sampling": ["--filter_zero_std_groups", "true"],
    "base_model_tail": ["--base_model_tail_steps", "2"],
}
GOLD = ("toy_shape", "toy_color")


def run_one(world: Path, variant: str, seed: int, steps: int, eval_every: int, output: Path) -> dict:
    from flowgrpo.cli.train import main

    out_dir = output / f"{variant}-seed{seed}"
    argv = [str(RECIPE), "--model_name_or_path", str(world), "--dataset_name", str(world / "prompts_train.txt"),
            "--eval_dataset_name", str(world / "prompts_eval.txt"), "--output_dir", str(out_dir),
            "--max_steps", str(steps), "--eval_steps", str(eval_every), "--save_steps", str(eval_every),
            "--seed", str(seed), "--disable_tqdm", "true", *VARIANTS[variant]]
    tic = time.perf_counter()
    trainer = main(argv)
    wall = time.perf_counter() - tic
    history = trainer.state.log_history
    train = [{"step": h["step"], "reward": h["reward"]} for h in history if "reward" in h and "loss" in h]
    evals = [{"step": h["step"], **{g: h.get(f"eval_rewards/{g}/mean") for g in GOLD},
              "alarm": h.get("health/hacking_alarm", 0.0)} for h in history if f"eval_rewards/{GOLD[0]}/mean" in h]
    runtime = next((h["train_runtime"] for h in history if "train_runtime" in h), math.nan)
    record = {
        "variant": variant, "seed": seed, "steps_done": trainer.state.global_step, "train": train,
        # the last evaluation is the one after training, of the exported (best) weights
        "evals": evals[:-1], "exported": evals[-1] if evals else None,
        "alarm_steps": [e["step"] for e in evals[:-1] if e["alarm"]], "train_seconds": runtime, "wall_seconds": wall,
        "best_step": trainer.state.best_global_step, "best_metric": trainer.state.best_metric,
        "stopped_by_alarm": trainer.stopped_by_hacking_alarm,
    }
    trainer.reward_set.close()
    return record


def summarise(records: list[dict], output: Path) -> None:
    import numpy as np

    by_variant: dict[str, list[dict]] = {}
    for r in records:
        by_variant.setdefault(r["variant"], []).append(r)
    base_seconds = np.mean([r["train_seconds"] for r in by_variant.get("unguarded", [])] or [math.nan])
    lines = ["| guard | seeds | train reward, last 10 steps | shape: last eval | shape: exported | colour: last eval "
             "| colour: exported | alarm fired (runs) | steps run | training s (x unguarded) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for variant, runs in by_variant.items():
        def mean(values):
            values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
            return float(np.mean(values)) if values else math.nan

        last_train = mean([mean([t["reward"] for t in r["train"][-10:]]) for r in runs])
        cells = [variant, str(len(runs)), f"{last_train:.3f}"]
        for g in GOLD:
            cells.append(f"{mean([r['evals'][-1][g] for r in runs if r['evals']]):.3f}")
            cells.append(f"{mean([r['exported'][g] for r in runs if r['exported']]):.3f}")
        seconds = mean([r["train_seconds"] for r in runs])
        cells += [f"{sum(bool(r['alarm_steps']) for r in runs)}/{len(runs)}",
                  f"{mean([r['steps_done'] for r in runs]):.0f}", f"{seconds:.0f} ({seconds / base_seconds:.2f}x)"]
        lines.append("| " + " | ".join(cells) + " |")
    (output / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    plot(by_variant, output / "health_demo.png")


def plot(by_variant: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(by_variant)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows), dpi=100, sharey=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.axis("off")
    for ax, (variant, runs) in zip(flat, by_variant.items()):
        steps = sorted({t["step"] for r in runs for t in r["train"]})
        reward = [np.nanmean([next((t["reward"] for t in r["train"] if t["step"] == s), np.nan) for r in runs])
                  for s in steps]
        ax.plot(steps, reward, color="tab:blue", alpha=0.6, label="train reward (toy_area)")
        for g, colour in zip(GOLD, ("tab:orange", "tab:green")):
            points = sorted({e["step"] for r in runs for e in r["evals"]})
            values = [np.nanmean([next((e[g] for e in r["evals"] if e["step"] == s), np.nan) for r in runs])
                      for s in points]
            ax.plot(points, values, "o-", color=colour, label=f"gold {g}")
        for r in runs:
            for s in r["alarm_steps"]:
                ax.axvline(s, color="tab:red", alpha=0.3, lw=1)
        ax.set_title(f"{variant} ({len(runs)} seed{'s' if len(runs) > 1 else ''})", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("reward / accuracy")
    flat[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=Path, default=None, help="toy world folder (default: the cached 'full' one)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--output", type=Path, default=REPO / "outputs" / "health_demo")
    args = parser.parse_args()
    world = args.world
    if world is None:
        from flowgrpo.toy.build import cached_toy_world

        world = cached_toy_world("full", seed=0)
    args.output.mkdir(parents=True, exist_ok=True)
    records = []
    for variant in args.variants:
        for seed in args.seeds:
            path = args.output / f"run-{variant}-seed{seed}.json"
            if path.exists():
                records.append(json.loads(path.read_text()))
                continue
            record = run_one(Path(world), variant, seed, args.steps, args.eval_every, args.output)
            path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            records.append(record)
            print(f"[health demo] {variant} seed {seed}: alarm at {record['alarm_steps']}, exported "
                  f"{record['exported']}", flush=True)
    summarise(records, args.output)


if __name__ == "__main__":
    main()
