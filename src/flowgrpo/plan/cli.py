"""``flowgrpo plan RECIPE [--config_file ACCELERATE_CONFIG] [--gpu NAME] [--num_processes N] [--json OUT]
[--key value ...]``: will the recipe fit, and how long will a step take, without a GPU and without weights."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .gpus import DEFAULT_GPU, GPUS, get_gpu
from .model_specs import spec_for_model_args

JSON_KEYS = ("fits", "peak_memory_gb", "gpu", "world_size", "phases", "breakdown_gb", "step_flops", "est_step_time_s",
             "mfu_assumed", "method", "suggestions")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo plan", allow_abbrev=False,
        description="Plan a recipe's per-GPU memory and step time on fake tensors (no GPU, no weights). Other "
                    "--key value flags override the recipe, as in training.")
    parser.add_argument("recipe", help="a recipe YAML, e.g. recipes/ocr.yaml")
    parser.add_argument("--config_file", default=None,
                        help="accelerate config (default: the one the recipe's header names, else one GPU)")
    parser.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU})")
    parser.add_argument("--num_processes", type=int, default=None, help="GPUs (default: the accelerate config's)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the plan as JSON to this file")
    parser.add_argument("--no_suggestions", action="store_true", help="skip re-planning the suggested changes")
    parser.add_argument("--check_sharding", action="store_true",
                        help="FSDP configs: also shard the transformer with FSDP2's fully_shard on a fake process group "
                             "and compare rank 0's states with the planned ones (a few seconds more)")
    return parser


def plan_recipe(recipe: str, overrides: Sequence[str] = (), *, config_file: str | None = None, gpu: str = DEFAULT_GPU,
                num_processes: int | None = None, with_suggestions: bool = True,
                check_sharding: bool = False) -> dict[str, Any]:
    """The plan of ``recipe`` as the ``--json`` dictionary (plus ``details``; with ``check_sharding`` and an FSDP
    config, ``details["fsdp2_check"]``: :func:`~flowgrpo.plan.fsdp_fake.fsdp2_states` against the plan)."""
    from ..cli.parser import parse_recipe
    from .accelerate_config import intended_config, load_parallelism
    from .calibration import CALIBRATION_ERROR, CALIBRATION_SOURCE, MFU
    from .planner import check_wrap_classes, make_plan, plan_inputs, sequence_parallel_families, suggestions

    gpu_spec = get_gpu(gpu)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes {num_processes}: give at least 1.")
    script_args, model_args, training_args = parse_recipe([recipe, *overrides])
    if config_file is None:
        named = intended_config(recipe)
        if named and (Path(recipe).resolve().parents[1] / named).is_file():
            config_file = str(Path(recipe).resolve().parents[1] / named)
    if training_args.use_cpu and config_file and "cpu" in Path(config_file).name:
        config_file = None
    parallel = load_parallelism(config_file, num_processes)
    training_args.check_sequence_parallel_launch(parallel.world_size)
    spec = spec_for_model_args(model_args)
    if training_args.sequence_parallel_size > 1 and spec.family not in sequence_parallel_families():
        from ..models import family_adapter_class

        refusal = family_adapter_class(spec.pipeline_class).sequence_parallel_refusal
        raise ValueError(f"sequence_parallel_size={training_args.sequence_parallel_size} with {spec.family}: {refusal}")
    from .recipe_settings import resolve_recipe_settings

    resolve_recipe_settings(script_args, model_args, training_args, spec)  # the model's own where the recipe is silent
    check_wrap_classes(spec, parallel)
    inputs = plan_inputs(script_args, model_args, training_args, parallel, gpu_spec, spec)
    plan = make_plan(inputs)
    peak = plan.peak_gb
    result: dict[str, Any] = {
        "fits": bool(peak <= gpu_spec.memory_gb),
        "peak_memory_gb": round(peak, 3),
        "gpu": {"name": gpu_spec.name, "memory_gb": gpu_spec.memory_gb, "bf16_tflops": gpu_spec.bf16_tflops},
        "world_size": parallel.world_size,
        "phases": {k: round(v, 3) for k, v in plan.phases.items()},
        "breakdown_gb": {k: round(v, 3) for k, v in plan.breakdown.items()},
        "step_flops": float(plan.step_flops),
        "est_step_time_s": round(plan.step_time_s, 2),
        "mfu_assumed": MFU,
        "method": plan.method,
        "suggestions": suggestions(plan) if with_suggestions else [],
    }
    result["details"] = {
        "recipe": recipe, "model": spec.name, "model_source": spec.origin, "sources": spec.sources,
        "parallelism": parallel.kind, "accelerate_config": parallel.source, "comm_time_s": round(plan.comm_time_s, 2),
        "calibration": {"source": CALIBRATION_SOURCE, "error": CALIBRATION_ERROR}, "notes": plan.notes,
        "deepspeed_check": plan.deepspeed_check,
        "timesteps_per_pass": {"per_pass": inputs.settings.timesteps_per_pass,
                               "trained_timesteps": inputs.settings.trained_steps,
                               "passes_per_micro_batch": inputs.settings.trained_pass_count},
    }
    if inputs.sequence_parallel_size > 1:
        sp_seconds = plan.sequence_parallel_bytes / (gpu_spec.interconnect_gbs * 1e9)
        result["sequence_parallel"] = {
            "size": inputs.sequence_parallel_size,
            "data_parallel_replicas": parallel.world_size // inputs.sequence_parallel_size,
            "all_to_all_gb_per_step": round(plan.sequence_parallel_bytes / 1e9, 3),
            "all_to_all_s": round(sp_seconds, 2),
        }
    if training_args.rollout_backend == "ray":  # the trainer and a rollout worker on their own GPUs
        from .disaggregated import plan_rollout_backend

        backend = plan_rollout_backend(plan, training_args)
        result["rollout_backend"] = backend
        result["fits"] = backend["trainer_fits"] and backend["worker_fits"]
    if check_sharding and parallel.kind == "fsdp":
        from .fsdp_fake import fsdp2_states

        result["details"]["fsdp2_check"] = fsdp2_states(spec, inputs.settings, parallel).as_dict()
    return result


def format_table(result: dict[str, Any]) -> str:
    gpu = result["gpu"]
    d = result.get("details", {})
    lines = [f"plan: {d.get('recipe', '')}  model {d.get('model', '')} ({d.get('model_source', '')})",
             f"      {result['world_size']} x {gpu['name']} ({gpu['memory_gb']} GB, {gpu['bf16_tflops']} bf16 TFLOP/s), "
             f"{d.get('parallelism', '')} [{d.get('accelerate_config', '')}], method {result['method']}",
             "",
             f"  {'per GPU':<20}{'GB':>10}"]
    for key, value in result["breakdown_gb"].items():
        lines.append(f"  {key:<20}{value:>10.2f}")
    lines.append(f"  {'phase rollout':<20}{result['phases']['rollout']:>10.2f}")
    lines.append(f"  {'phase training':<20}{result['phases']['training']:>10.2f}")
    verdict = "fits" if result["fits"] else "DOES NOT FIT"
    lines.append(f"  {'peak':<20}{result['peak_memory_gb']:>10.2f}   {verdict} in {gpu['memory_gb']} GB")
    lines.append("")
    lines.append(f"  step: {result['step_flops']:.3e} FLOPs per GPU, about {result['est_step_time_s']:.1f} s at MFU "
                 f"{result['mfu_assumed']} (communication {d.get('comm_time_s', 0)} s)")
    passes = d.get("timesteps_per_pass")
    if passes and passes["trained_timesteps"] > 1:
        lines.append(f"  training: {passes['per_pass']} of {passes['trained_timesteps']} trained timesteps per pass "
                     f"(train_timesteps_per_pass), {passes['passes_per_micro_batch']:g} forward + backward passes a "
                     "micro-batch")
    cal = d.get("calibration", {})
    if cal:
        lines.append(f"  calibration: {cal['source']}; error: {cal['error']}")
    for note in d.get("notes", []):
        lines.append(f"  note: {note}")
    if d.get("deepspeed_check"):
        lines.append(f"  DeepSpeed's own model-state estimate: {d['deepspeed_check']['deepspeed_model_states_gb']:.2f}"
                     " GB per GPU")
    if d.get("fsdp2_check"):
        check = d["fsdp2_check"]
        ratios = ", ".join(f"{k} {v:.4f}" for k, v in check["rank0_over_planned"].items())
        lines.append(f"  FSDP2 on a fake process group ({check['world_size']} ranks, {check['wrapped_modules']} wrapped "
                     f"modules), rank 0 over planned: {ratios}")
    sp = result.get("sequence_parallel")
    if sp:
        lines.append(f"  sequence parallelism: {sp['size']} processes per sample (Ulysses), "
                     f"{sp['data_parallel_replicas']} data-parallel replica(s); all-to-all "
                     f"{sp['all_to_all_gb_per_step']:.1f} GB per GPU per step, {sp['all_to_all_s']:.2f} s (in the "
                     "communication time)")
    backend = result.get("rollout_backend")
    if backend:
        lines.append("")
        lines.append(f"  rollout_backend ray: {backend['workers']} worker(s) {backend['worker_resources']}, max_staleness "
                     f"{backend['max_staleness']}, weight_sync_steps {backend['weight_sync_steps']}")
        lines.append(f"  {'per worker GPU':<20}{'GB':>10}")
        for key, value in backend["worker_breakdown_gb"].items():
            lines.append(f"  {key:<20}{value:>10.2f}")
        lines.append(f"  {'worker peak':<20}{backend['worker_peak_gb']:>10.2f}   "
                     f"{'fits' if backend['worker_fits'] else 'DOES NOT FIT'}")
        lines.append(f"  {'trainer peak':<20}{backend['trainer_peak_gb']:>10.2f}   "
                     f"{'fits' if backend['trainer_fits'] else 'DOES NOT FIT'} (+{backend['trainer_extra_records_gb']:.2f} "
                     "GB of records arriving ahead)")
        lines.append(f"  step time: rollout {backend['rollout_s']:.2f} s, training {backend['training_s']:.2f} s, sync "
                     f"{backend['sync_s']:.3f} s -> {backend['step_time_sequential_s']:.2f} s without overlap "
                     f"(max_staleness 0), {backend['step_time_overlapped_s']:.2f} s with overlap (max_staleness >= 1)")
    if result["suggestions"]:
        lines.append("")
        lines.append("  suggestions (each re-planned):")
        for s in result["suggestions"]:
            peak = "n/a" if s.get("peak_memory_gb") is None else f"{s['peak_memory_gb']:.2f} GB"
            time = f", about {s['est_step_time_s']:.1f} s a step" if "est_step_time_s" in s else ""
            lines.append(f"    {s['change']:<60} -> {peak}{time}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``flowgrpo plan``; returns the exit status (0 planned, 2 bad input)."""
    from ..cli.notices import quiet_library_notices
    from ..cli.parser import RecipeError

    quiet_library_notices()
    parser = _parser()
    args, overrides = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result = plan_recipe(args.recipe, overrides, config_file=args.config_file, gpu=args.gpu,
                             num_processes=args.num_processes, with_suggestions=not args.no_suggestions,
                             check_sharding=args.check_sharding)
    except (RecipeError, ValueError) as err:
        print(f"flowgrpo plan: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(format_table(result), flush=True)
    if args.json_out:
        keys = JSON_KEYS + tuple(k for k in ("sequence_parallel", "rollout_backend") if k in result)
        Path(args.json_out).write_text(json.dumps({k: result[k] for k in keys}, indent=1) + "\n")
    return 0


__all__ = ["JSON_KEYS", "format_table", "main", "plan_recipe"]
