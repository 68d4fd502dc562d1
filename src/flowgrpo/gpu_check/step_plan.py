"""Check ``plan_vs_measured``: ``flowgrpo plan``'s plan of a timed recipe step against what the step measured.

    python -m flowgrpo.gpu_check.step_plan --recipe recipes/ocr.yaml --measured DIR --gpu auto --output DIR \\
        [--key value ...]

Plans the step that :mod:`flowgrpo.gpu_check.recipe_step` timed: the same recipe with the same overrides, one
process (``accelerate_configs/single_gpu.yaml``: one GPU's share), on the GPU table entry of the machine it runs on
(``--gpu auto``: from ``nvidia-smi``'s name, e.g. ``h100-80gb``). The plan is made for the recipe's own model
(``stabilityai/stable-diffusion-3.5-medium`` from its packaged config), the architecture the random-weight pipeline
has. Compared, as ratios measured / planned:

* memory: the planned peak without its ``overhead`` allowance (CUDA context and fragmentation, which
  ``max_memory_allocated`` does not see) against the measured ``torch.cuda.max_memory_allocated``; and the planned
  peak with it against ``max_memory_reserved``;
* time: the planned step time (``step_flops`` at the fitted MFU) against the measured median step time; the MFU the
  measurement implies, ``step_flops / (step time x the GPU's peak bf16 FLOP/s)``, is what ``flowgrpo.plan``'s
  calibration (:mod:`flowgrpo.plan.calibration`) would need to predict it.

Passes when both were there to compare: the ratios are figures, not pass marks (``plan_vs_measured`` of
``make gpu-check`` holds the memory to +-20 %).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .probe import RESULT_FILE, write_result

__all__ = ["GIB", "PLAN_CONFIG", "compare_step", "gpu_table_entry", "main", "plan_overrides"]

GIB = 1024**3
PLAN_CONFIG = "accelerate_configs/single_gpu.yaml"
#: GPU names (nvidia-smi) -> entries of flowgrpo.plan's GPU table
_GPU_NAMES = (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("h800", "h800-80gb"), ("b200", "b200-180gb"),
              ("l40s", "l40s-48gb"), ("4090", "rtx4090-24gb"), ("3090", "rtx3090-24gb"))


def gpu_table_entry(name: str, memory_mib: float | None = None) -> str:
    """The plan's GPU table entry for a GPU called ``name`` by nvidia-smi (``"NVIDIA H100 80GB HBM3"`` ->
    ``"h100-80gb"``); an A100 is told apart by its memory."""
    key = name.lower().replace(" ", "")
    if "a100" in key:
        return "a100-40gb" if memory_mib is not None and memory_mib < 60 * 1024 else "a100-80gb"
    for marker, entry in _GPU_NAMES:
        if marker in key:
            return entry
    raise ValueError(f"GPU {name!r} has no entry in flowgrpo.plan's GPU table; pass --gpu with one of its names "
                     "(python -c 'from flowgrpo.plan.gpus import GPUS; print(list(GPUS))')")


def _detect_gpu() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=15, check=True).stdout.strip().splitlines()
    if not out:
        raise RuntimeError("nvidia-smi lists no GPU; pass --gpu NAME")
    name, _, memory = out[0].rpartition(",")
    return gpu_table_entry(name.strip(), float(memory) if re.fullmatch(r"\s*[\d.]+\s*", memory) else None)


def plan_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides the plan is made with: the step's own (the settings the check forces change nothing that the
    plan counts, except the reward, whose model the plan counts: it is set the same way)."""
    from .recipe_step import DEFAULT_REWARD, check_overrides

    check_overrides(overrides)
    given = {item[2:].split("=", 1)[0] for item in overrides if item.startswith("--")}
    extra = [] if "reward_funcs" in given else ["--reward_funcs", DEFAULT_REWARD]
    return [*extra, *overrides]


def compare_step(plan: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Planned against measured: memory in GiB, time in seconds, each with ``measured / planned``."""
    bench = measured.get("benchmark") or {}
    peaks = measured.get("peak_memory") or {}
    planned_alloc = (plan["peak_memory_gb"] - plan["breakdown_gb"]["overhead"]) * 1e9 / GIB
    planned_total = plan["peak_memory_gb"] * 1e9 / GIB
    out: dict[str, Any] = {"gpu": plan["gpu"]["name"], "planned_phases_gb": plan["phases"],
                           "planned_breakdown_gb": plan["breakdown_gb"], "step_flops": plan["step_flops"],
                           "mfu_assumed": plan["mfu_assumed"]}

    def ratio(measured_value: float | None, planned_value: float) -> float | None:
        return measured_value / planned_value if measured_value is not None and planned_value else None

    alloc = peaks.get("max_memory_allocated_mib")
    if alloc is None and bench.get("peak_memory_kind") == "cuda_max_allocated":
        alloc = bench.get("peak_memory_mb")
    reserved = peaks.get("max_memory_reserved_mib")
    out["memory"] = {"planned_allocated_gib": planned_alloc,
                     "measured_allocated_gib": alloc / 1024 if alloc is not None else None,
                     "allocated_ratio": ratio(alloc / 1024 if alloc is not None else None, planned_alloc),
                     "planned_peak_gib": planned_total,
                     "measured_reserved_gib": reserved / 1024 if reserved is not None else None,
                     "reserved_ratio": ratio(reserved / 1024 if reserved is not None else None, planned_total)}
    step = bench.get("step_time_s")
    out["time"] = {"planned_step_s": plan["est_step_time_s"], "measured_step_s": step,
                   "ratio": ratio(step, plan["est_step_time_s"]),
                   "implied_mfu": plan["step_flops"] / (step * plan["gpu"]["bf16_tflops"] * 1e12) if step else None,
                   "achieved_tflops": plan["step_flops"] / step / 1e12 if step else None}
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--measured", required=True, help="the timed step check's folder (its result.json)")
    parser.add_argument("--gpu", default="auto", help="flowgrpo.plan GPU table entry, or auto (nvidia-smi)")
    parser.add_argument("--output", required=True)
    args, overrides = parser.parse_known_args(argv)
    metrics: dict[str, Any] = {"recipe": args.recipe, "overrides": list(overrides), "config_file": PLAN_CONFIG}
    failures: list[str] = []
    try:
        plan_args = plan_overrides(overrides)
        result_path = Path(args.measured) / RESULT_FILE
        if not result_path.is_file():
            raise FileNotFoundError(f"{result_path}: the timed step did not write its result (run it first)")
        measured = json.loads(result_path.read_text()).get("metrics") or {}
        if not (measured.get("benchmark") or {}).get("step_time_s"):
            raise ValueError(f"{result_path} holds no finished step time (the step check failed or was stopped "
                             f"before its measured steps: {json.loads(result_path.read_text()).get('failures')})")
        gpu = _detect_gpu() if args.gpu == "auto" else args.gpu
        from ..plan import plan_recipe

        plan = plan_recipe(args.recipe, plan_args, gpu=gpu, config_file=PLAN_CONFIG, with_suggestions=False)
        metrics["plan"] = {k: v for k, v in plan.items() if k != "details"}
        metrics["comparison"] = compare_step(plan, measured)
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    summary = ""
    if "comparison" in metrics:
        mem, time_ = metrics["comparison"]["memory"], metrics["comparison"]["time"]
        summary = (f"memory: planned {_fmt(mem['planned_allocated_gib'])} GiB, measured "
                   f"{_fmt(mem['measured_allocated_gib'])} GiB (x{_fmt(mem['allocated_ratio'])}); step: planned "
                   f"{_fmt(time_['planned_step_s'])} s, measured {_fmt(time_['measured_step_s'])} s "
                   f"(x{_fmt(time_['ratio'])}, implied MFU {_fmt(time_['implied_mfu'], 2)})")
    write_result(not failures, metrics, failures, summary, check_dir=args.output)
    print(f"[step_plan] {'PASSED' if not failures else 'FAILED'}: {summary or failures}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
