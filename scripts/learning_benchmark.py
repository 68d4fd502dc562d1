#!/usr/bin/env python
"""Compare Flow-GRPO settings on the toy world by held-out accuracy against training wall-clock.

    python scripts/learning_benchmark.py --world .cache/toy-world --output outputs/learning_benchmark [--quick]
    python scripts/learning_benchmark.py --world .cache/toy-world --output DIR --only flow-grpo,fast-w2

Each setting trains the toy world's transformer with FlowGRPOTrainer on the recipe's rewards (the dense
``toy_shape_score`` of the world's weakest attribute, shape, plus half-weight ``toy_color``; ``--reward`` changes
them) from the same pretrained weights and seed, and measures the held-out accuracy (eval prompts, ODE sampling,
fixed seeds) before training, every ``--eval-every`` steps and at the end. Training wall-clock excludes these
evaluations. Writes, into ``--output``:

* ``results.json``  every run's settings, curves and before/after accuracies
* ``results.md``    a table: setting, steps, training seconds, accuracy before -> after, gain, per-step seconds
* ``accuracy_vs_time.png``  held-out accuracy against training seconds, one line per setting
* ``<setting>/``    each run's reward curve and before/after contact sheet

The world is built with ``scripts/make_toy_world.py`` when ``--world`` does not exist yet. ``--quick`` runs a
few settings for a few steps on a subset of eval prompts (minutes); the default grid (ten settings, 300 steps
each) takes roughly 40 minutes on 2 CPU cores, most of it in the settings that train every sampling step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    from flowgrpo.toy.learning import RLSettings, run_toy_rl
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flowgrpo.toy.learning import RLSettings, run_toy_rl


def settings_grid(reward: list[str] | None, steps: int) -> list[RLSettings]:
    """The compared settings. The base is the recipe (``RLSettings()``: Flow-GRPO-Fast, an SDE window of 2 of the
    first 4 steps); each other setting changes one thing: SDE on every step, CPS, the noise level, the group
    size at a fixed batch, the binary ``toy_shape`` reward instead of the dense score, attention-only LoRA, full
    fine-tuning instead of LoRA."""
    base = RLSettings(max_steps=steps)
    if reward:
        base = dataclasses.replace(base, reward=reward, reward_weights=None)
    return [
        dataclasses.replace(base, name="fast-w2"),
        dataclasses.replace(base, name="flow-grpo", sde_window_size=0, sde_window_range=None),
        dataclasses.replace(base, name="fast-w2-cps", sde_type="cps"),
        dataclasses.replace(base, name="cps", sde_type="cps", sde_window_size=0, sde_window_range=None),
        dataclasses.replace(base, name="noise-0.4", noise_level=0.4),
        dataclasses.replace(base, name="noise-1.0", noise_level=1.0),
        dataclasses.replace(base, name="group-4", num_generations=4, prompts_per_step=8),
        dataclasses.replace(base, name="group-16", num_generations=16, prompts_per_step=2),
        dataclasses.replace(base, name="binary-reward", reward=[
            "toy_shape" if r == "toy_shape_score" else r for r in ([base.reward] if isinstance(base.reward, str)
                                                                    else base.reward)]),
        dataclasses.replace(base, name="lora-attn-r16", lora_r=16, lora_target_modules=[
            "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]),
        dataclasses.replace(base, name="full-ft", use_lora=False, learning_rate=4e-5),
    ]


def quick_grid(reward: list[str] | None, steps: int) -> list[RLSettings]:
    names = {"fast-w2", "flow-grpo", "binary-reward"}
    return [s for s in settings_grid(reward, steps) if s.name in names]


def write_table(results: list[dict], path: Path) -> str:
    lines = [
        "| setting | trained | sampler | window | noise | G x prompts | steps | train s | s/step | before | after "
        "| gain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, a = r["settings"], r["target_attribute"]
        window = "all" if not s["sde_window_size"] else f"{s['sde_window_size']} in {s['sde_window_range']}"
        trained = f"LoRA r{s['lora_r']}" if s["use_lora"] else "all weights"
        lines.append(
            f"| {s['name']} | {trained}, lr {s['learning_rate']:g} | {s['sde_type']} | {window} | {s['noise_level']} | {s['num_generations']} x "
            f"{s['prompts_per_step']} | {s['max_steps']} | {r['train_seconds']:.0f} | "
            f"{r['train_seconds'] / max(1, s['max_steps']):.2f} | {r['before'][a]:.1%} | {r['after'][a]:.1%} | "
            f"{100 * r['gain']:+.1f} pts |")
    table = "\n".join(lines) + "\n"
    path.write_text(table, encoding="utf-8")
    return table


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=100)
    for r in results:
        a = r["target_attribute"]
        xs = [p["train_seconds"] for p in r["curve"]]
        ys = [p[a] for p in r["curve"]]
        ax.plot(xs, ys, "o-", lw=1.8, ms=3, label=r["settings"]["name"])
    attribute = results[0]["target_attribute"] if results else "accuracy"
    ax.set_xlabel("training wall-clock (s, evaluations excluded)")
    ax.set_ylabel(f"held-out {attribute} accuracy")
    ax.set_title("Flow-GRPO settings on the toy world")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=Path, default=Path(".cache/toy-world"), help="toy world folder")
    parser.add_argument("--world-seed", type=int, default=0, help="seed when the world has to be built")
    parser.add_argument("--output", type=Path, default=Path("outputs/learning_benchmark"))
    parser.add_argument("--reward", default=None,
                        help="comma-separated training rewards, equally weighted; the first is the target (default: "
                             "the recipe's toy_shape_score + 0.5 toy_color)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per setting (300; quick: 60)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (50; quick: 20)")
    parser.add_argument("--eval-images-per-prompt", type=int, default=None, help="(4; quick: 2)")
    parser.add_argument("--max-eval-prompts", type=int, default=None, help="(all 43; quick: 24)")
    parser.add_argument("--only", default=None, help="comma-separated setting names to run")
    parser.add_argument("--quick", action="store_true", help="3 settings, few steps, fewer eval images")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (60 if args.quick else 300)
    eval_every = args.eval_every or (20 if args.quick else 50)
    images_per_prompt = args.eval_images_per_prompt or (2 if args.quick else 4)
    max_prompts = args.max_eval_prompts or (24 if args.quick else None)
    rewards = [r.strip() for r in args.reward.split(",") if r.strip()] if args.reward else None
    grid = (quick_grid if args.quick else settings_grid)(rewards, steps)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {s.name: s for s in settings_grid(rewards, steps)}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            parser.error(f"unknown setting(s) {unknown}; choose from {sorted(known)}")
        grid = [known[n] for n in wanted]

    if not (args.world / "model_index.json").is_file():
        from flowgrpo.toy.build import build_toy_world

        print(f"[learning benchmark] building the toy world in {args.world}", flush=True)
        build_toy_world(args.world, seed=args.world_seed)

    args.output.mkdir(parents=True, exist_ok=True)
    results = []
    start = time.perf_counter()
    for settings in grid:
        result = run_toy_rl(args.world, settings, args.output / settings.name, eval_every=eval_every,
                            eval_images_per_prompt=images_per_prompt, max_eval_prompts=max_prompts)
        results.append(result)
        (args.output / "results.json").write_text(json.dumps({
            "world": str(args.world), "reward": rewards or RLSettings().reward, "quick": args.quick, "torch_threads":
            torch.get_num_threads(), "results": results}, indent=2) + "\n", encoding="utf-8")
    table = write_table(results, args.output / "results.md")
    plot(results, args.output / "accuracy_vs_time.png")
    print(table)
    print(f"[learning benchmark] {len(results)} settings in {time.perf_counter() - start:.0f} s; results in "
          f"{args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
