#!/usr/bin/env python
"""On-policy distillation of two experts into one student, on the toy world.

    python scripts/opd_demo.py --output outputs/opd_demo                       # everything, seeds 0, 1, 2
    python scripts/opd_demo.py --output outputs/opd_demo --stage experts       # the two teachers only
    python scripts/opd_demo.py --output outputs/opd_demo --stage students --seeds 1
    python scripts/opd_demo.py --output outputs/opd_demo --stage evaluate      # the table from what exists

1. *Experts* (``--expert_recipe``, default ``recipes/toy_nft_fast.yaml``, ``--expert_steps``): a shape expert trained
   from the world on ``toy_shape_score`` alone and a colour expert on ``toy_color`` alone (the recipe's other rewards
   logged at weight 0), each exported as a LoRA (``<output>/experts/{shape,color}``).
2. *Students* (``recipes/toy_opd.yaml``, ``--student_steps``, one per seed): a fresh LoRA on the world distilled from
   both experts at once, ``teachers: [{lora: shape, dataset_name: shape}, {lora: color, dataset_name: color}]``; the
   toy prompts carry no domain, so the two teachers take turns, one generation batch each
   (``<output>/students/seed<k>``).
3. *Evaluation*: held-out shape and colour accuracy of the world, each expert and each student, as the leaderboard
   measures them (the 43 eval prompts x ``--images_per_prompt`` 8 images, 20 ODE steps at CFG 3, image seeds from
   1234), written to ``<output>/opd_demo.json`` and ``<output>/opd_demo.md``. With ``--students_from ARCHIVE`` the
   students are the leaderboard's ``diffusion-opd`` row instead (``ARCHIVE/diffusion-opd/seed<k>.json``: the same
   student, experts and evaluation, five seeds, trained by ``scripts/learning_benchmark.py --leaderboard``), and
   stage 2 is skipped.

Each training run uses the launch script (``flowgrpo.cli.train.main``) with one torch thread; finished stages are
reused (a folder with its LoRA is not trained again). ``--world`` defaults to the shared toy-world cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
try:
    import flowgrpo  # noqa: F401
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, str(REPO / "src"))

LORA = "pytorch_lora_weights.safetensors"
#: expert -> the recipe's reward weights over [toy_shape_score, toy_color, toy_shape]
EXPERTS = {"shape": ("1.0", "0.0", "0.0"), "color": ("0.0", "1.0", "0.0")}


def launch(recipe: str, world: Path, output: Path, *flags: str) -> None:
    from flowgrpo.cli.train import main

    main([str(REPO / "recipes" / recipe) if "/" not in recipe else recipe, "--model_name_or_path", str(world),
          "--dataset_name", str(world / "prompts_train.txt"), "--eval_dataset_name", str(world / "prompts_eval.txt"),
          "--output_dir", str(output), "--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no",
          "--cpu_threads", "1", "--disable_tqdm", "true", *flags])


def train_experts(args, world: Path) -> None:
    for name, weights in EXPERTS.items():
        folder = args.output / "experts" / name
        if (folder / LORA).is_file():
            print(f"[opd demo] expert {name}: {folder} (reused)")
            continue
        print(f"[opd demo] training the {name} expert ({args.expert_recipe}, {args.expert_steps} steps)")
        launch(args.expert_recipe, world, folder, "--reward_funcs", "toy_shape_score", "toy_color", "toy_shape",
               "--reward_weights", *weights, "--max_steps", str(args.expert_steps), "--seed", str(args.expert_seed))


def train_students(args, world: Path) -> None:
    teachers = json.dumps([{"lora": str(args.output / "experts" / name), "dataset_name": name} for name in EXPERTS])
    for seed in args.seeds:
        folder = args.output / "students" / f"seed{seed}"
        if (folder / LORA).is_file():
            print(f"[opd demo] student seed {seed}: {folder} (reused)")
            continue
        print(f"[opd demo] distilling both experts into a student (seed {seed}, {args.student_steps} steps)")
        launch("toy_opd.yaml", world, folder, "--teacher_lora", "", "--teachers", teachers,
               "--max_steps", str(args.student_steps), "--seed", str(seed), *args.student_flags)


def evaluate(args, world: Path) -> dict:
    import torch
    from diffusers import DiffusionPipeline

    from flowgrpo.toy.build import evaluate_pipeline, read_prompts
    from flowgrpo.toy.provenance import weights_digest

    prompts = read_prompts(world, "eval")
    archived, seeds = ({}, args.seeds) if args.students_from is None else leaderboard_students(
        args.students_from, len(prompts), args.images_per_prompt)
    models = {"world": None, **{f"{n} expert": args.output / "experts" / n for n in EXPERTS}}
    if args.students_from is None:
        models.update({f"student seed {s}": args.output / "students" / f"seed{s}" for s in args.seeds})
    results = {}
    for name, folder in models.items():
        if folder is not None and not (folder / LORA).is_file():
            continue
        pipe = DiffusionPipeline.from_pretrained(str(world))
        if folder is not None:
            pipe.load_lora_weights(str(folder))
        with torch.no_grad():
            acc = evaluate_pipeline(pipe, prompts, images_per_prompt=args.images_per_prompt, num_inference_steps=20,
                                    guidance_scale=3.0, max_sequence_length=8, seed=1234)
        results[name] = {"shape": acc["shape"], "color": acc["color"], "all": acc["all"], "images": acc["n"]}
        print(f"[opd demo] {name}: shape {acc['shape']:.1%}, colour {acc['color']:.1%}")
    results.update(archived)
    students = [v for k, v in results.items() if k.startswith("student")]
    if students:
        results["students"] = {key: {"mean": statistics.mean(s[key] for s in students),
                                     "min": min(s[key] for s in students), "max": max(s[key] for s in students)}
                               for key in ("shape", "color")}
    summary = {"results": results, "images_per_prompt": args.images_per_prompt, "prompts": len(prompts),
               "expert_recipe": args.expert_recipe, "expert_steps": args.expert_steps,
               "student_steps": args.student_steps, "student_flags": args.student_flags, "seeds": seeds,
               "students_from": None if args.students_from is None else str(args.students_from),
               "experts": {name: {"lora": str(args.output / "experts" / name),
                                  "sha256": weights_digest(args.output / "experts" / name)} for name in EXPERTS}}
    (args.output / "opd_demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.output / "opd_demo.md").write_text(render(summary))
    return summary


def leaderboard_students(archive: Path, prompts: int, images_per_prompt: int) -> tuple[dict, list[int]]:
    """The leaderboard's ``diffusion-opd`` runs in ``archive`` as the demo's student rows (their final held-out
    accuracies), and their seeds; a run evaluated on other prompts or images is refused, naming the flag that
    matches it."""
    rows, seeds = {}, []
    for path in sorted((archive / "diffusion-opd").glob("seed*.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        if run["eval"]["images_per_prompt"] != images_per_prompt or run["eval"]["prompts"] != prompts:
            raise SystemExit(f"{path}: evaluated on {run['eval']['prompts']} prompts x "
                             f"{run['eval']['images_per_prompt']} images, not the demo's {prompts} x "
                             f"{images_per_prompt}; pass --images_per_prompt {run['eval']['images_per_prompt']}")
        after = run["after"]
        name = f"student seed {run['settings']['seed']} (leaderboard, {run['settings']['max_steps']} steps)"
        rows[name] = {"shape": after["shape"], "color": after["color"], "all": after["all"], "images": after["n"]}
        seeds.append(int(run["settings"]["seed"]))
        print(f"[opd demo] {name}: shape {after['shape']:.1%}, colour {after['color']:.1%}")
    if not rows:
        raise SystemExit(f"{archive / 'diffusion-opd'} holds no runs: make them with scripts/learning_benchmark.py "
                         "--leaderboard --only diffusion-opd")
    return rows, seeds


def render(summary: dict) -> str:
    rows = ["| model | held-out shape | held-out colour |", "|---|---|---|"]
    for name, r in summary["results"].items():
        if name == "students":
            rows.append(f"| students, mean (lowest-highest) | {r['shape']['mean']:.1%} ({r['shape']['min']:.1%}-"
                        f"{r['shape']['max']:.1%}) | {r['color']['mean']:.1%} ({r['color']['min']:.1%}-"
                        f"{r['color']['max']:.1%}) |")
        else:
            rows.append(f"| {name} | {r['shape']:.1%} | {r['color']:.1%} |")
    return ("Held-out accuracy on the toy world's " + f"{summary['prompts']} eval prompts x "
            f"{summary['images_per_prompt']} images (20 ODE steps, CFG 3). Experts: {summary['expert_recipe']}, "
            f"{summary['expert_steps']} steps each; students: recipes/toy_opd.yaml from both experts, "
            + (f"{summary['student_steps']} steps" if not summary.get("students_from") else
               f"the leaderboard's diffusion-opd runs ({summary['students_from']})") + ".\n\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("outputs/opd_demo"))
    parser.add_argument("--world", type=Path, default=None, help="toy world folder (default: the shared cache)")
    parser.add_argument("--stage", choices=("all", "experts", "students", "evaluate"), default="all")
    parser.add_argument("--seeds", default="0,1,2", help="the students' seeds")
    parser.add_argument("--expert_recipe", default="toy_nft_fast.yaml")
    parser.add_argument("--expert_steps", type=int, default=300)
    parser.add_argument("--expert_seed", type=int, default=0)
    parser.add_argument("--student_steps", type=int, default=300)
    parser.add_argument("--images_per_prompt", type=int, default=8)
    parser.add_argument("--students_from", type=Path, default=None,
                        help="a leaderboard archive (docs/learning_leaderboard_runs): its diffusion-opd runs are the "
                             "students (no students trained here)")
    parser.add_argument("--student_flags", nargs=argparse.REMAINDER, default=[],
                        help="more flags for the students' launch (last on the line)")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    import torch

    torch.set_num_threads(1)
    if args.world is None:
        from flowgrpo.toy.build import cached_toy_world

        args.world = cached_toy_world("full", seed=0)
    args.output.mkdir(parents=True, exist_ok=True)
    if args.stage in ("all", "experts"):
        train_experts(args, args.world)
    if args.stage in ("all", "students") and args.students_from is None:
        train_students(args, args.world)
    if args.stage in ("all", "evaluate"):
        evaluate(args, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
