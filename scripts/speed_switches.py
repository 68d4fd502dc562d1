#!/usr/bin/env python
"""What ``rollout_cache`` and ``torch_compile`` buy on this machine, measured side by side (docs/benchmarks.md, "The
cost of a step").

    python scripts/speed_switches.py rollouts [--recipe recipes/toy_nft_fast.yaml] [--caches taylorseer pab faster]
        [--repeats 5] [--output FILE.json] [--key value ...]
    python scripts/speed_switches.py steps [--recipe recipes/toy.yaml] [--steps 6] [--output FILE.json]
        [--key value ...]

``rollouts``: the recipe's trainer is built as ``src/train.py`` builds it (``--key value`` flags override the
recipe), then one training rollout of its first generation batch (``RolloutEngine.generate``, the same prompts and
noise each time) is timed without a cache and with each cache in turn, in pairs whose order alternates (none first
in even repeats, the cache first in odd ones), so that a drift of the machine's speed falls on both. Recorded per
cache: the sampling seconds of each pair (``timing["rollout"]``: the transformer's passes and the solver, without
the decode and the rewards, which run in the background), the ratio none / cached of each pair and their median, the
fraction of hooked computations skipped, and the largest difference of the decoded images (in [0, 1]) from the
uncached rollout's. Caches the trainer refuses for the recipe's family are recorded with the refusal.

``steps``: ``--steps`` optimizer steps of the recipe (no evaluation, no saving), each step's wall seconds and, with
``--torch_compile true``, the seconds spent compiling (``timing/compile_s``). Run it with and without the flag,
alternating, for compile off against on: the first step (with the compilation) and the median of the others (the
steady step). Give each compiled run its own ``TORCHINDUCTOR_CACHE_DIR`` for the first step of a new user (inductor
otherwise reuses the kernels an earlier run compiled).

Prints one JSON object and writes it to ``--output`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_trainer(recipe: str, overrides: list[str], forced: dict):
    """The recipe's trainer, built as ``src/train.py`` builds it, with ``forced`` settings over the recipe."""
    from flowgrpo.cli import build_peft_config, load_prompt_dataset, parse_recipe
    from flowgrpo.cli.train import _prepare_toy_world_run, prepare_model_path
    from flowgrpo.trainer.registry import trainer_class

    script_args, model_args, training_args = parse_recipe([recipe, *overrides], overrides=forced)
    model = prepare_model_path(model_args, training_args)
    _prepare_toy_world_run(script_args, model, training_args)
    train_dataset, _ = load_prompt_dataset(script_args)
    return trainer_class(script_args.trainer)(
        model=model, reward_funcs=list(script_args.reward_funcs), args=training_args, train_dataset=train_dataset,
        peft_config=build_peft_config(model_args))


def _images(trainer, generation):
    import torch

    if "x0" not in generation.records[0]:
        return None
    finals = torch.cat([r["x0"] for r in generation.records])
    height, width = trainer.args.image_size
    with torch.no_grad():
        return trainer.policy.adapter.decode(finals.to(trainer.policy.dtype), height, width).float()


def measure_rollouts(args, overrides: list[str]) -> dict:
    from flowgrpo.models import family_adapter_class
    from flowgrpo.trainer.rollout.cache import RolloutCache, check_rollout_cache_fields
    from flowgrpo.trainer.speed_settings import parse_rollout_cache_config, rollout_cache_refusal

    forced = {"max_steps": 1, "eval_strategy": "no", "eval_on_start": False, "save_strategy": "no",
              "report_to": "none", "output_dir": str(Path(args.work) / "rollouts"), "disable_tqdm": True}
    trainer = build_trainer(args.recipe, overrides, forced)
    engine = trainer.rollouts
    family = family_adapter_class(type(trainer.pipeline).__name__).family
    uses_cfg = engine.adapter.uses_cfg(trainer.args.guidance_scale)
    rows = [dict(trainer.train_dataset[i % len(trainer.train_dataset)])
            for i in range(trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation)]
    config = parse_rollout_cache_config(args.cache_config)

    def rollout(cache):
        engine.cache = cache
        try:
            generation = engine.generate(rows, 0, 0)
            for job in generation.jobs:
                job.result()
            return generation
        finally:
            engine.cache = None

    rollout(None)  # warm-up: first-call allocations and lazy imports
    reference = rollout(None)
    reference_images = _images(trainer, reference)
    out = {"recipe": args.recipe, "overrides": overrides, "family": family, "uses_cfg": uses_cfg,
           "images": len(rows), "num_inference_steps": trainer.args.num_inference_steps,
           "guidance_scale": trainer.args.guidance_scale, "torch_threads": __import__("torch").get_num_threads(),
           "load_before": os.getloadavg(), "caches": {}}
    for kind in args.caches:
        fields = config.get(kind, {})
        refusal = rollout_cache_refusal(kind, family, uses_cfg, fields)
        if refusal is None:
            try:
                check_rollout_cache_fields(kind, fields)
            except ValueError as err:
                refusal = str(err)
        if refusal is not None:
            out["caches"][kind] = {"refused": refusal}
            continue
        cache = RolloutCache(kind, fields, engine.adapter.transformers(), video=engine.adapter.is_video)
        pairs, skipped, difference = [], [], 0.0
        for repeat in range(args.repeats):
            order = ("none", kind) if repeat % 2 == 0 else (kind, "none")
            seconds = {}
            for name in order:
                generation = rollout(cache if name == kind else None)
                seconds[name] = generation.timing["rollout"]
                if name == kind:
                    skipped.append(1 - generation.timing["cache_computed"] / generation.timing["cache_calls"])
                    images = _images(trainer, generation)
                    if images is not None and reference_images is not None:
                        difference = max(difference, float((images - reference_images).abs().max()))
            pairs.append(seconds)
        ratios = [p["none"] / p[kind] for p in pairs]
        out["caches"][kind] = {
            "config": fields, "pairs_s": pairs, "speedup_per_pair": ratios,
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "none_median_s": statistics.median(p["none"] for p in pairs),
            "cached_median_s": statistics.median(p[kind] for p in pairs),
            "skipped_fraction": statistics.mean(skipped), "max_image_difference": difference}
        pairs_text = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"[speed] {kind}: x{out['caches'][kind]['speedup_median']:.2f} (pairs {pairs_text}), skipped "
              f"{out['caches'][kind]['skipped_fraction']:.2f}, images differ by up to {difference:.3f}",
              file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()
    return out


def measure_steps(args, overrides: list[str]) -> dict:
    from transformers import TrainerCallback

    forced = {"max_steps": args.steps, "eval_strategy": "no", "eval_on_start": False, "save_strategy": "no",
              "report_to": "none", "output_dir": str(Path(args.work) / "steps"), "disable_tqdm": True,
              "logging_steps": 1}
    trainer = build_trainer(args.recipe, overrides, forced)
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.tic = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.tic)

    trainer.add_callback(StepClock())
    load_before = os.getloadavg()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "timing/training" in h or "compile/graphs" in h]
    first = logs[0] if logs else {}
    out = {"recipe": args.recipe, "overrides": overrides, "torch_compile": bool(trainer.args.torch_compile),
           "backend": trainer.args.torch_compile_backend, "step_s": times, "first_step_s": times[0],
           "steady_step_s": statistics.median(times[1:]) if len(times) > 1 else None,
           "compile_s": first.get("timing/compile_s"), "graphs": logs[-1].get("compile/graphs") if logs else None,
           "recompiles": logs[-1].get("compile/recompiles") if logs else None,
           "first_pass_ratio_max_dev": first.get("on_policy_ratio_max_dev"),
           "torch_threads": __import__("torch").get_num_threads(), "load_before": load_before,
           "load_after": os.getloadavg()}
    print(f"[speed] compile {out['torch_compile']}: first step {times[0]:.2f} s, steady {out['steady_step_s']:.3f} s",
          file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("rollouts", "steps"))
    parser.add_argument("--recipe", default=None, help="rollouts: recipes/toy_nft_fast.yaml; steps: recipes/toy.yaml")
    parser.add_argument("--caches", nargs="+", default=["taylorseer", "pab", "faster", "mag", "first_block"])
    parser.add_argument("--cache-config", default=None,
                        help='JSON: {cache: {field: value}}, each cache\'s rollout_cache_config (default: diffusers\')')
    parser.add_argument("--repeats", type=int, default=5, help="rollouts: pairs per cache")
    parser.add_argument("--steps", type=int, default=6, help="steps: optimizer steps")
    parser.add_argument("--work", default="outputs/speed_switches", help="the trainers' output folders")
    parser.add_argument("--output", default=None)
    args, overrides = parser.parse_known_args(argv)
    os.chdir(REPO)  # recipes name repository-relative paths
    if args.what == "rollouts":
        args.recipe = args.recipe or "recipes/toy_nft_fast.yaml"
        result = measure_rollouts(args, overrides)
    else:
        args.recipe = args.recipe or "recipes/toy.yaml"
        result = measure_steps(args, overrides)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
