"""``flowgrpo evaluate`` (also ``python -m flowgrpo.evaluate``): a benchmark's images under its protocol, scored.

    flowgrpo evaluate --benchmark geneval --model stabilityai/stable-diffusion-3.5-medium \
        --lora you/sd35m-geneval --output results/geneval
    flowgrpo evaluate --benchmark geneval --images path/to/geneval_images      # score another tool's images
    flowgrpo evaluate --benchmark ocr --recipe recipes/ocr.yaml --lora outputs/sd35m_ocr --output results/ocr
    accelerate launch --num_processes 8 -m flowgrpo.evaluate --benchmark geneval --lora ... --output ...

Settings, lowest precedence first: the model's own (resolved from its component configs, as the trainers do), the
benchmark's published protocol (``flowgrpo.evaluate.benchmarks``; its steps, guidance, size and text length only for
the model it was published for), the evaluation settings of ``--recipe``, then flags. Flags are written ``--key value``; ``--num-inference-steps``
spellings work too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .benchmarks import BENCHMARKS, DTYPES, MODEL_SETTINGS, ODE_SOLVERS, Benchmark, SamplingProtocol, get_benchmark

#: protocol fields that have a flag of the same name
_PROTOCOL_FLAGS = ("num_inference_steps", "guidance_scale", "height", "width", "max_sequence_length",
                   "negative_prompt", "images_per_prompt", "seed", "ode_solver", "dtype")


#: options of the geneval reward that shape its training score or its input, not the benchmark's verdict
_GENEVAL_TRAINING_ONLY = ("geneval_output", "partial_credit", "jpeg_quality")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **kwargs)


def build_parser(prog: str = "flowgrpo evaluate") -> argparse.ArgumentParser:
    benchmarks = "; ".join(f"{b.name}: {b.description}" for b in BENCHMARKS.values())
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate a benchmark's prompts under its protocol (fixed seeds, deterministic sampling), score "
                    "the images, and write GenEval's folder layout (<output>/<index>/metadata.jsonl, "
                    "<output>/<index>/samples/<n>.png), results.jsonl and a summary (summary.md, summary.json). "
                    "Runs that stop resume where they stopped; under accelerate launch the prompts are split between "
                    "the processes.",
        epilog="Benchmarks: " + benchmarks + ".\nPrecedence: the benchmark's protocol, then --recipe, then flags.")
    what = parser.add_argument_group("what to evaluate")
    _flag(what, "benchmark", default="geneval", metavar="NAME",
          help=f"one of {', '.join(BENCHMARKS)} (default: geneval)")
    _flag(what, "model", default=None, metavar="ID_OR_PATH",
          help="diffusers pipeline: Hub id or local folder (default: the recipe's model_name_or_path, else "
               "stabilityai/stable-diffusion-3.5-medium; toy: the cached toy world)")
    _flag(what, "revision", default=None, help="Hub revision of --model")
    _flag(what, "lora", default=None, metavar="ID_OR_PATH",
          help="LoRA to load with the pipeline's load_lora_weights: a Hub id, or a folder (a training output or "
               "checkpoint) holding pytorch_lora_weights.safetensors, or that file")
    _flag(what, "transformer", default=None, metavar="PATH",
          help="a fully fine-tuned transformer to use instead of the model's: the folder a run without LoRA wrote "
               "(<output_dir>/transformer, or <output_dir>)")
    _flag(what, "metadata", default=None, metavar="PATH",
          help="the benchmark's prompts: geneval: GenEval's evaluation_metadata.jsonl (default "
               "data/geneval/evaluation_metadata.jsonl, from `python scripts/prepare_data.py geneval`); geneval2: "
               "GenEval2's geneval2_data.jsonl (default data/geneval2/geneval2_data.jsonl, from `python "
               "scripts/prepare_data.py geneval2`); ocr / "
               "pickscore: a prompt file (default data/<name>/test.txt, or the recipe's test prompts); toy: default "
               "<model>/prompts_eval.txt")
    _flag(what, "recipe", default=None, metavar="YAML",
          help="a training recipe whose evaluation settings to use (eval_num_inference_steps, eval_guidance_scale, "
               "resolution, max_sequence_length, negative_prompt, dtype), with its model, test prompts and "
               "reward_kwargs")
    _flag(what, "output", default=None, metavar="DIR",
          help="folder for the images, results.jsonl and the summary (required unless --images)")
    _flag(what, "images", default=None, metavar="DIR",
          help="score this folder in GenEval's layout (made by any tool) instead of generating; results go to "
               "--output, default DIR itself")

    sampling = parser.add_argument_group("sampling (defaults: the recipe's, the benchmark's protocol for the model it "
                                         "was published for, else the model's own)")
    _flag(sampling, "num_inference_steps", type=int, default=None, metavar="N", help="ODE steps (geneval on SD3.5-M: 40; default: the model's own)")
    _flag(sampling, "guidance_scale", type=float, default=None, metavar="W",
          help="classifier-free guidance (geneval on SD3.5-M: 4.5; 1 = none; default: the model's own)")
    _flag(sampling, "resolution", type=int, default=None, metavar="PX", help="height and width (geneval on SD3.5-M: 512; default: the model's own)")
    _flag(sampling, "height", type=int, default=None, metavar="PX", help="image height (default: resolution)")
    _flag(sampling, "width", type=int, default=None, metavar="PX", help="image width (default: resolution)")
    _flag(sampling, "max_sequence_length", type=int, default=None, metavar="N",
          help="text tokens of the prompt encoder (geneval on SD3.5-M: 128, Flow-GRPO's evaluation; default: "
               "the model's own)")
    _flag(sampling, "negative_prompt", default=None, metavar="TEXT", help="negative prompt for guidance (default '')")
    _flag(sampling, "images_per_prompt", type=int, default=None, metavar="N",
          help="images per prompt (geneval: 4; ocr, pickscore: 1)")
    parser.add_argument("--n_samples", dest="images_per_prompt", type=int, help=argparse.SUPPRESS)  # GenEval's name
    _flag(sampling, "seed", type=int, default=None,
          help="base seed: image n of prompt i is drawn from seed + 100000 n + i (geneval: 42)")
    _flag(sampling, "ode_solver", default=None, choices=ODE_SOLVERS, help="deterministic solver (default euler)")
    _flag(sampling, "dtype", default=None, choices=DTYPES,
          help="model dtype (default auto: bfloat16 on a GPU, float32 on a CPU)")

    running = parser.add_argument_group("running")
    _flag(running, "batch_size", type=int, default=8, metavar="N", help="images per forward pass per process (8)")
    _flag(running, "max_prompts", type=int, default=None, metavar="N", help="only the first N prompts (quick runs)")
    _flag(running, "reward_kwargs", default=None, metavar="JSON",
          help="options of the scorers, by reward name, e.g. '{\"ocr\": {\"backend\": \"rapidocr\"}}' or "
               "'{\"geneval\": {\"detector\": \"...\"}}' (merged over the recipe's)")
    _flag(running, "skip_grid", action="store_true", help="do not write each prompt's grid.png")
    _flag(running, "skip_scoring", action="store_true",
          help="only generate (score later with --images, e.g. on another machine)")
    return parser


class UsageError(ValueError):
    """A command line that cannot run (the message names the flag and the fix)."""


def settings_from_args(args: argparse.Namespace):
    """Resolve flags, recipe and benchmark defaults into :class:`~flowgrpo.evaluate.runner.EvaluationSettings`;
    every check that needs no model runs here."""
    from .benchmarks import read_recipe_settings
    from .runner import EvaluationSettings

    try:
        benchmark = get_benchmark(args.benchmark)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.images is None and args.output is None:
        raise UsageError("--output DIR is required to generate (or give --images DIR to score existing images).")
    for name in ("batch_size", "max_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} {value} must be a positive integer.")
    reward_kwargs: dict[str, Any] = {}
    recipe = None
    if args.recipe is not None:
        try:
            recipe = read_recipe_settings(args.recipe)
        except ValueError as err:
            raise UsageError(str(err)) from err
        for name in benchmark.rewards or ("geneval",):
            options = dict(recipe.reward_kwargs.get(name) or {})
            if name == "geneval":  # what the training reward returns or how it receives images: not the benchmark's
                for key in _GENEVAL_TRAINING_ONLY:
                    options.pop(key, None)
            if name == "geneval2":  # the benchmark reports both means
                options.pop("aggregation", None)
            if options:
                reward_kwargs[name] = options
    for name, options in benchmark.reward_kwargs.items():
        reward_kwargs.setdefault(name, dict(options))
    if args.reward_kwargs:
        try:
            extra = json.loads(args.reward_kwargs)
        except json.JSONDecodeError as err:
            raise UsageError(f"--reward_kwargs {args.reward_kwargs!r} is not JSON: {err}.") from err
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise UsageError(f"--reward_kwargs must map reward names to option objects, got {extra!r}.")
        for name, options in extra.items():
            reward_kwargs[name] = {**reward_kwargs.get(name, {}), **options}

    if args.images is not None:
        images = Path(args.images)
        return EvaluationSettings(benchmark, Path(args.output) if args.output else images, benchmark.protocol,
                                  images=images, batch_size=args.batch_size, reward_kwargs=reward_kwargs)

    model = args.model or (recipe.model if recipe else None) or benchmark.default_model
    if model is None and benchmark.name == "toy":
        from ..toy.build import cached_toy_world

        model = str(cached_toy_world())
    protocol = _resolve_protocol(benchmark, args, recipe, model)
    metadata = args.metadata
    if metadata is None and recipe is not None and benchmark.name in ("ocr", "pickscore"):
        metadata = recipe.metadata
    if metadata is None:
        metadata = benchmark.default_metadata or str(Path(model) / "prompts_eval.txt")
    return EvaluationSettings(benchmark, Path(args.output), protocol, model=model, revision=args.revision,
                              lora=args.lora, transformer=args.transformer, metadata=str(metadata),
                              batch_size=args.batch_size, max_prompts=args.max_prompts, reward_kwargs=reward_kwargs,
                              skip_grid=args.skip_grid, skip_scoring=args.skip_scoring)


def _resolve_protocol(benchmark: Benchmark, args: argparse.Namespace, recipe: Any, model: str) -> SamplingProtocol:
    """The benchmark's protocol (its model settings only for the model it was published for), then the recipe's
    evaluation settings, then flags; what is still unset is the model's own (:func:`resolve_protocol_settings`)."""
    protocol = benchmark.protocol
    if benchmark.default_model is None or str(model).rstrip("/").lower() != benchmark.default_model.lower():
        protocol = replace(protocol, **{name: None for name in MODEL_SETTINGS})
    if recipe is not None:
        protocol = replace(protocol, **recipe.protocol_overrides)
    if args.resolution is not None:
        protocol = replace(protocol, height=args.resolution, width=args.resolution)
    flags = {name: getattr(args, name) for name in _PROTOCOL_FLAGS if getattr(args, name) is not None}
    protocol = replace(protocol, **flags)
    try:
        protocol.check()
        return resolve_protocol_settings(protocol, model, args.revision)
    except ValueError as err:
        raise UsageError(str(err)) from err


def resolve_protocol_settings(protocol: SamplingProtocol, model: str, revision: str | None = None) -> SamplingProtocol:
    """``protocol`` with its unset model settings (:data:`~flowgrpo.evaluate.benchmarks.MODEL_SETTINGS`) resolved
    from ``model``'s component configs, and every model setting checked against what the model can take, as the
    trainers do (:mod:`flowgrpo.models.defaults`: the evaluation steps and guidance, size and text length). The configs
    come from the folder, the Hub cache, else the planner's packaged config of a known Hub id; a model whose configs
    cannot be read is refused only when a setting is still unset."""
    import warnings

    from ..models.defaults import read_model_configs, resolve_generation_settings

    configs = read_model_configs(model, revision=revision)
    if configs is None:
        configs = _packaged_configs(model)
    missing = [name for name in MODEL_SETTINGS if getattr(protocol, name) is None]
    if configs is None:
        if missing:
            raise ValueError(f"--model {model!r}: its component configs cannot be read here (not a pipeline folder, "
                             f"and not in the Hugging Face cache) to find its own {', '.join(missing)}; give them as "
                             f"flags ({' '.join('--' + name for name in missing)}) or with --recipe.")
        return protocol
    settings = resolve_generation_settings(
        configs, {"height": protocol.height, "width": protocol.width, "max_sequence_length": protocol.max_sequence_length,
                  "eval_num_inference_steps": protocol.num_inference_steps,
                  "eval_guidance_scale": protocol.guidance_scale},
        negative_prompt=protocol.negative_prompt)
    for note in settings.warnings:
        warnings.warn(note, UserWarning, stacklevel=2)
    values = settings.values
    return replace(protocol, height=values["height"], width=values["width"],
                   max_sequence_length=values["max_sequence_length"],
                   num_inference_steps=values["eval_num_inference_steps"], guidance_scale=values["eval_guidance_scale"])


def _packaged_configs(model: str):
    """The component configs of a known Hub id from the planner's packaged files (``None`` for an unknown model)."""
    from ..plan.model_specs import load_model_spec
    from ..plan.recipe_settings import configs_from_spec

    try:
        return configs_from_spec(load_model_spec(str(model)), str(model))
    except (ValueError, FileNotFoundError, KeyError):
        return None


def main(argv: Sequence[str] | None = None, prog: str = "flowgrpo evaluate") -> int:
    """Run ``flowgrpo evaluate``; bad input exits with status 2 and one paragraph naming the fix."""
    from ..cli.notices import quiet_library_notices

    quiet_library_notices()
    parser = build_parser(prog)
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        settings = settings_from_args(args)
        from .runner import run_evaluation

        summary = run_evaluation(settings)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    if summary is not None:
        print(summary["markdown"], flush=True)
        print(f"[flowgrpo] results in {settings.output}", flush=True)
    return 0


__all__ = ["UsageError", "build_parser", "main", "settings_from_args"]
