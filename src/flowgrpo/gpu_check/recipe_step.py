"""Checks ``sd35m_step`` and ``nft_step``: one GPU's share of a shipped recipe's optimizer step at full size, timed.

    python -m flowgrpo.gpu_check.recipe_step --recipe recipes/ocr.yaml --output DIR [--key value ...]

The recipe is parsed as ``src/train.py`` parses it (:func:`flowgrpo.cli.parse_recipe`; ``--key value`` flags after
the options below override it), so one optimizer step is one process's share of the recipe's generation batch:
``per_device_train_batch_size x steps_per_generation`` images (``recipes/ocr.yaml``: 4 prompts x 8 images in 4
micro-batches of 8; ``recipes/nft_ocr.yaml``: 2 prompts x 24 images in 6 micro-batches of 8). The trainer the
recipe names (Flow-GRPO or DiffusionNFT) is built as ``src/train.py`` builds it, with the LoRA of the recipe, on:

* ``--model sd35m-random`` (default): the SD3.5-Medium architecture at full size with random weights, built on
  the GPU in bf16 (the ``sd35m-random`` benchmark preset's pipeline; nothing is downloaded);
* ``--model tiny``: the tiny SD3 test pipeline, for a CPU (with ``--use_cpu true --bf16 false --dtype float32`` and
  small sizes among the overrides).

What the check sets itself (and refuses as overrides, :data:`CONTROLLED_KEYS`): ``max_steps`` = warm-up + measured
steps, the output folder, no evaluation, saving, images or reporting. Defaults it changes, which overrides may set
back: the prompts (``data/ocr_synthetic``, shipped in the repository, for the recipe's ``data/ocr``) and the reward,
``jpeg_compressibility`` (PIL only: the OCR reward needs rapidocr, whose 27 MB wheel does not fit beside the others
in what the machine can be sent; the reward runs on the CPU in the background and leaves the GPU work unchanged;
``--reward_funcs ocr`` times it where rapidocr is installed).

Timing is the benchmark harness's (:func:`flowgrpo.benchmarking.harness.run_benchmark`, without the floor
measurement): per step and as medians over the measured steps, text encoding, sampling (``rollout``), VAE decode,
the exposed reward wait, training forward, training backward, optimizer and the rest, with the decode and reward
work done in the background; the peak ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``. For
Flow-GRPO the first step's on-policy figures are recorded too: the largest |ratio - 1| and the KL of the first pass.
After every step the figures so far are written to ``result.json`` (``partial: true``), so a check stopped at its
time limit still reports the steps it finished.

With ``--compare-timesteps-per-pass`` (the quick check's ``sd35m_step``) the timed steps are followed by
:func:`flowgrpo.benchmarking.harness.compare_timesteps_per_pass`: one more generation, trained (without an
optimizer step) at
``train_timesteps_per_pass`` 1 and ``all``, the training phase of each timed, with its peak memory and first-pass
ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .probe import install_memory_recorder, write_result

__all__ = ["CONTROLLED_KEYS", "DEFAULT_DATASET", "DEFAULT_REWARD", "MODELS", "check_overrides", "main",
           "parse_step_recipe", "step_preset", "step_settings"]

MODELS = {"sd35m-random": "sd35m-random", "tiny": "tiny"}  # --model -> the benchmark preset whose pipeline is built
DEFAULT_DATASET = "data/ocr_synthetic"
DEFAULT_REWARD = "jpeg_compressibility"
#: recipe keys the check sets itself: an override of one of them would break the timing or the report
CONTROLLED_KEYS = {
    "max_steps": "the check runs warm-up + measured steps (--steps, --warmup-steps)",
    "output_dir": "the check writes into its own work folder (--work)",
    "eval_strategy": "evaluation is not part of the timed step",
    "eval_on_start": "evaluation is not part of the timed step",
    "save_strategy": "saving is not part of the timed step",
    "report_to": "nothing is reported to trackers from the check",
    "logging_steps": "every step is logged (the step-1 figures are read from the log)",
    "log_images_steps": "logging images is not part of the timed step",
    "push_to_hub": "nothing is pushed from the check",
    "resume_from_checkpoint": "the check starts from the random-weight model",
    "trainer": "the recipe names the trainer; give another --recipe instead",
}
#: settings shown in the report: what makes one GPU's share of the step
SETTING_KEYS = ("resolution", "num_inference_steps", "guidance_scale", "sde_type", "sde_window_size",
                "sde_window_range", "noise_level", "sampler", "num_generations", "per_device_train_batch_size",
                "gradient_accumulation_steps", "steps_per_generation", "activation_checkpointing", "beta",
                "max_sequence_length", "dtype", "bf16", "use_ema", "timestep_fraction", "nft_beta",
                "train_timesteps_per_pass")


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse, before anything is built, overrides of :data:`CONTROLLED_KEYS` and arguments not in ``--key value``
    form (the recipe parser names unknown keys and bad values afterwards)."""
    if overrides and not overrides[0].startswith("--"):
        raise ValueError(f"recipe override {overrides[0]!r}: give recipe settings as --key value (e.g. "
                         "--guidance_scale 1.0)")
    for item in overrides:
        if not item.startswith("--"):
            continue  # a value (list settings take several)
        key = item[2:].split("=", 1)[0]
        if key in CONTROLLED_KEYS:
            raise ValueError(f"--{key} cannot be overridden here: {CONTROLLED_KEYS[key]}")


def parse_step_recipe(recipe: str, overrides: Sequence[str], *, max_steps: int, output_dir: str):
    """``(script_args, model_args, training_args)`` of the timed step: the recipe, the check's settings, then
    ``overrides`` (which win over the check's defaults but may not touch :data:`CONTROLLED_KEYS`)."""
    from ..cli import parse_recipe
    from .plan import repo_root

    check_overrides(overrides)
    forced = {"max_steps": max_steps, "output_dir": output_dir, "eval_strategy": "no", "eval_on_start": False,
              "save_strategy": "no", "report_to": "none", "logging_steps": 1, "log_images_steps": 0,
              "push_to_hub": False, "disable_tqdm": True, "dataset_name": str(repo_root() / DEFAULT_DATASET),
              "reward_funcs": [DEFAULT_REWARD], "reward_kwargs": None}
    return parse_recipe([recipe, *overrides], overrides=forced)


def step_settings(script_args: Any, model_args: Any, training_args: Any) -> dict[str, Any]:
    """The settings that define the step, for the report."""
    out = {key: getattr(training_args, key) for key in SETTING_KEYS if hasattr(training_args, key)}
    out.update({"trainer": script_args.trainer, "reward_funcs": list(script_args.reward_funcs),
                "images_per_step": training_args.per_device_train_batch_size * training_args.steps_per_generation,
                "use_peft": model_args.use_peft, "lora_r": model_args.lora_r, "lora_alpha": model_args.lora_alpha,
                "lora_target_modules": model_args.lora_target_modules})
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


def step_preset(recipe: str, model: str, script_args: Any, model_args: Any, training_args: Any, *, steps: int,
                warmup: int):
    """A :class:`~flowgrpo.benchmarking.presets.BenchmarkPreset` describing the recipe's step (the harness reports
    under its name and counts images per step with it; the trainer itself is built from the recipe)."""
    from ..benchmarking.presets import BenchmarkPreset, get_preset
    from ..cli.arguments import DEFAULT_LORA_TARGET_MODULES

    base = get_preset(MODELS[model])
    images = training_args.per_device_train_batch_size * training_args.steps_per_generation
    if images % training_args.num_generations:
        raise ValueError(f"{images} images per step is not a multiple of num_generations="
                         f"{training_args.num_generations}")
    return BenchmarkPreset(
        name=f"{Path(recipe).stem}@{model}", description=f"{recipe} at one GPU's share on the {model} pipeline",
        family=base.family, architecture=base.architecture, device=base.device, dtype=str(training_args.dtype),
        resolution=int(training_args.image_size[0]), num_prompts=images // training_args.num_generations,
        num_generations=training_args.num_generations,
        per_device_train_batch_size=training_args.per_device_train_batch_size,
        num_inference_steps=training_args.num_inference_steps,
        sde_window_size=int(getattr(training_args, "sde_window_size", 0) or 0),
        guidance_scale=float(training_args.guidance_scale), max_sequence_length=training_args.max_sequence_length,
        reward=tuple(script_args.reward_funcs), lora_rank=model_args.lora_r,
        lora_targets=tuple(model_args.lora_target_modules or DEFAULT_LORA_TARGET_MODULES),
        gradient_checkpointing=bool(training_args.activation_checkpointing), beta=float(training_args.beta),
        default_steps=steps, warmup_steps=warmup, trainer=script_args.trainer)


def _first_step_figures(trainer: Any) -> dict[str, Any]:
    """Flow-GRPO's first-pass figures at step 1 (absent for trainers that log no ratio), and with ``torch_compile``
    the seconds spent compiling up to the end of step 1 and the graphs compiled by then and by the last step."""
    logs = [h for h in trainer.state.log_history if "ratio_mean" in h or "compile/graphs" in h]
    if not logs:
        return {}
    first = logs[0]
    out = {k: first[k] for k in ("on_policy_ratio_max_dev", "ratio_mean", "kl", "approx_kl", "clip_frac",
                                 "timing/compile_s", "compile/graphs") if k in first}
    if "compile/recompiles" in logs[-1]:
        out["compile/recompiles"] = logs[-1]["compile/recompiles"]
    return out


def _cuda_peaks() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "max_memory_reserved_mib": torch.cuda.max_memory_reserved() / 2**20}


def _summary(result: dict[str, Any], passes: dict[str, Any] | None = None) -> str:
    parts = [f"step {result['step_time_s']:.2f} s (median of {len(result['step_times_s'])})",
             f"{result['images_per_s']:.2f} images/s"]
    if result.get("peak_memory_kind") == "cuda_max_allocated":
        parts.append(f"peak {result['peak_memory_mb'] / 1024:.1f} GiB allocated")
    b = result["breakdown"]
    parts.append(f"sampling {b['rollout']:.2f} s, training {b['training_forward'] + b['training_backward']:.2f} s")
    if passes:
        t = passes["training_s"]
        parts.append(f"training phase at train_timesteps_per_pass 1 / all: {t['1']:.2f} / {t['all']:.2f} s")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="a shipped recipe, e.g. recipes/ocr.yaml")
    parser.add_argument("--output", required=True, help="the check's folder (result.json)")
    parser.add_argument("--work", default=None, help="the trainer's output folder (default: <output>/run)")
    parser.add_argument("--model", choices=sorted(MODELS), default="sd35m-random")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (default 2)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="warm-up steps before them (default 1)")
    parser.add_argument("--compare-timesteps-per-pass", action="store_true",
                        help="after the timed steps, time the training phase of one fresh generation at "
                             "train_timesteps_per_pass 1 and all (compare_timesteps_per_pass)")
    args, overrides = parser.parse_known_args(argv)
    install_memory_recorder("recipe_step")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {"recipe": args.recipe, "model": args.model, "overrides": list(overrides),
                               "steps": args.steps, "warmup_steps": args.warmup_steps}
    failures: list[str] = []
    records: list[dict[str, Any]] = []
    tic = time.monotonic()

    def write(partial: bool, summary: str = "") -> None:
        metrics["wall_s"] = round(time.monotonic() - tic, 2)
        metrics["partial"] = partial
        write_result(not failures and not partial, metrics, failures, summary, check_dir=out)

    try:
        if args.steps < 1 or args.warmup_steps < 0:
            raise ValueError(f"--steps {args.steps} must be >= 1 and --warmup-steps {args.warmup_steps} >= 0")
        check_overrides(overrides)  # before the heavy imports: a bad override costs nothing
        from ..benchmarking.harness import run_benchmark
        from ..cli.parser import check_training_hardware

        work = str(Path(args.work) if args.work else out / "run")
        script_args, model_args, training_args = parse_step_recipe(
            args.recipe, overrides, max_steps=args.warmup_steps + args.steps, output_dir=work)
        check_training_hardware(training_args)
        metrics["settings"] = step_settings(script_args, model_args, training_args)
        preset = step_preset(args.recipe, args.model, script_args, model_args, training_args, steps=args.steps,
                             warmup=args.warmup_steps)
        built: dict[str, Any] = {}

        def build_from_recipe(preset, max_steps: int, output_dir: str, seed: int = 0):
            from ..benchmarking.presets import build_preset_pipeline, get_preset
            from ..cli import build_peft_config, load_prompt_dataset
            from ..trainer.registry import trainer_class

            t0 = time.monotonic()
            pipeline = build_preset_pipeline(get_preset(MODELS[args.model]), seed=seed)
            metrics["pipeline_build_s"] = round(time.monotonic() - t0, 2)
            train_dataset, _ = load_prompt_dataset(script_args)
            built["trainer"] = trainer_class(script_args.trainer)(
                model=pipeline, reward_funcs=list(script_args.reward_funcs), args=training_args,
                train_dataset=train_dataset, peft_config=build_peft_config(model_args))
            return built["trainer"]

        def on_step(record: dict[str, Any]) -> None:
            records.append({**record, **_cuda_peaks()})
            metrics["step_records"] = records
            write(partial=True)
            print(f"[recipe_step] step {record['step']}: {record['step_time_s']:.2f} s", flush=True)

        result = run_benchmark(preset, args.steps, warmup_steps=args.warmup_steps, measure_floor=False,
                               seed=0, trainer_builder=build_from_recipe, on_step=on_step,
                               log=lambda msg: print(msg, flush=True))
        trainer = built["trainer"]
        metrics["benchmark"] = result
        metrics["peak_memory"] = _cuda_peaks()
        metrics["first_step"] = _first_step_figures(trainer)
        metrics["trainable_parameters"] = result.get("parameters", {}).get("trainable")
        if args.compare_timesteps_per_pass:
            write(partial=True, summary=_summary(result))  # the step's figures are kept if the comparison stops
            from ..benchmarking.harness import compare_timesteps_per_pass

            metrics["timesteps_per_pass"] = compare_timesteps_per_pass(trainer)
        write(partial=False, summary=_summary(result, metrics.get("timesteps_per_pass")))
        print(f"[recipe_step] PASSED {json.dumps({k: metrics[k] for k in ('first_step', 'peak_memory')})}",
              flush=True)
        return 0
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
        write(partial=bool(records))
        print(f"[recipe_step] FAILED: {failures[-1]}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
