#!/usr/bin/env python
"""``make demo``: train on the embedded CPU default under ``accelerate launch`` and show what changed.

    python scripts/demo.py                                   # the toy world (recipes/toy_nft_fast.yaml), two CPU processes
    python scripts/demo.py --recipe recipes/tiny_cpu.yaml --num_processes 1 --max_steps 4

Steps: build the recipe's model folder if it is missing (the recipe's ``build_tiny_pipeline_if_missing``: the toy
world is copied from the one shipped in the package, or built in about 3.5 minutes on one core if the builder changed), run ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml
src/train.py RECIPE --output_dir OUT`` with its progress on the terminal, then write ``reward_curve.png`` and
``before_after.png`` next to the trained weights in OUT and print where everything is. The recipe's batch is the
batch of one process; with N processes each takes 1/N of it (when it divides), so the run trains what the recipe
describes. A previous demo's folder is kept as ``OUT.previous`` rather than overwritten.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = "recipes/toy_nft_fast.yaml"
DEFAULT_OUTPUT = "outputs/demo"
#: What the demo runs of the default recipe unless told otherwise: DiffusionNFT made cheap per step (6 sampling steps,
#: 2 of them trained per image; the algorithm that wins at equal training seconds on the toy world: ahead of
#: Flow-GRPO-Fast at the learning goal's 150 s over five seeds, docs/algorithms.md, "The fastest learner on the toy
#: world") for 250 optimizer steps, evaluated before and after only, on 43 held-out prompts x 8 images at the world's
#: own guidance 3 (paired: the same seeds before and after), so that a change of shape accuracy the size the run
#: makes is beyond the evaluation's noise. The exported LoRA is the evaluated one, the EMA of the weights.
DEMO_DEFAULTS = {"max_steps": 250, "eval_strategy": "no", "eval_images_per_prompt": 8, "eval_guidance_scale": 3.0,
                 "eval_guidance_scales": 3.0}


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"training recipe (default {DEFAULT_RECIPE})")
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT, help=f"where the run goes (default {DEFAULT_OUTPUT})")
    parser.add_argument("--num_processes", type=int, default=2,
                        help="CPU processes training together over gloo (1 runs a single process)")
    parser.add_argument("--max_steps", type=int, default=None,
                        help=f"override the recipe's max_steps (the default recipe: {DEMO_DEFAULTS['max_steps']})")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="further '--key value' recipe overrides, after '--'")
    return parser


def launch_command(recipe: str, output_dir: str, num_processes: int, max_steps: int | None,
                   extra: list[str]) -> list[str]:
    """The ``accelerate launch`` command line of the demo run."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if num_processes > 1:
        cmd += ["--config_file", "accelerate_configs/cpu_ddp.yaml", "--num_processes", str(num_processes)]
    else:
        cmd += ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--cpu"]
    cmd += ["src/train.py", recipe, "--output_dir", output_dir]
    if max_steps is not None:
        cmd += ["--max_steps", str(max_steps)]
    return cmd + [a for a in extra if a != "--"]


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    os.chdir(REPO)
    if args.num_processes < 1:
        print(f"error: --num_processes={args.num_processes} must be >= 1", file=sys.stderr)
        return 2
    from flowgrpo.cli import RecipeError, parse_recipe

    # Check the recipe and overrides here, in seconds, before any model is built or process started.
    overrides = {"output_dir": args.output_dir}
    extra = [a for a in args.extra if a != "--"]
    if args.recipe == DEFAULT_RECIPE:
        for key, value in DEMO_DEFAULTS.items():
            given = f"--{key}" in extra or any(a.startswith(f"--{key}=") for a in extra)
            if not given and not (key == "max_steps" and args.max_steps is not None):
                extra += [f"--{key}", str(value)]
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    try:
        _, model_args, training_args = parse_recipe([args.recipe, *extra], overrides=overrides)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    batch = training_args.per_device_train_batch_size
    if (args.num_processes > 1 and "--per_device_train_batch_size" not in extra
            and batch % args.num_processes == 0
            and (batch // args.num_processes) % training_args.num_generations == 0):
        extra += ["--per_device_train_batch_size", str(batch // args.num_processes)]

    out = Path(args.output_dir)
    if out.exists() and any(out.iterdir()):
        previous = out.with_name(out.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        out.rename(previous)
        print(f"[demo] the previous demo output was moved to {previous}", flush=True)

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.perf_counter()
    if model_args.build_tiny_pipeline_if_missing:
        # Made here, before the training processes start (the toy world is copied from the shipped one through the
        # shared cache).
        from flowgrpo.cli.train import prepare_model_path

        prepare_model_path(model_args)
    cmd = launch_command(args.recipe, str(out), args.num_processes, args.max_steps, extra)
    print("[demo] " + " ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        print(f"[demo] training failed with exit status {result.returncode}", file=sys.stderr)
        return result.returncode
    minutes = (time.perf_counter() - start) / 60

    from flowgrpo.cli.report import summarize_run

    summary = summarize_run(out, title=f"flowgrpo demo ({Path(args.recipe).stem})")
    print(f"\n[demo] finished in {minutes:.1f} min. In {out}/:")
    if (out / "pytorch_lora_weights.safetensors").is_file():
        print("  pytorch_lora_weights.safetensors  the LoRA; pipe.load_lora_weights('" + str(out) + "') loads it")
    if (out / "transformer").is_dir():
        print("  transformer/                      the fine-tuned transformer; "
              "SD3Transformer2DModel.from_pretrained(OUT, subfolder='transformer') loads it")
    print("  reward_curve.png                  training and evaluation reward per step")
    if summary["before_after"]:
        print("  before_after.png                  evaluation samples before and after training (same seeds)")
    if summary["train_reward_first"] is not None:
        print(f"  train reward: {summary['train_reward_first']:.4f} (first steps) -> "
              f"{summary['train_reward_last']:.4f} (last steps)")
    if summary["eval_first"] and summary["eval_last"] and summary["eval_first"][0] != summary["eval_last"][0]:
        (s0, r0), (s1, r1) = summary["eval_first"], summary["eval_last"]
        print(f"  eval reward:  {r0:.4f} (step {s0}) -> {r1:.4f} (step {s1})")
    for name, (first, last) in summary.get("eval_components", {}).items():
        line = f"  eval {name}: {first:.4f} -> {last:.4f} ({last - first:+.4f})"
        noise = summary.get("eval_noise", {}).get(name)
        if noise is not None:
            verdict = "beyond" if abs(last - first) > 2 * noise else "within"
            line += f"; evaluation noise: +-{2 * noise:.4f} (two standard errors over the same seeds), so {verdict} it"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
