"""Check ``plan_vs_measured``: the planner's peak for ``recipes/sd35m_24gb.yaml`` against what the GPU measured.

Runs after ``memory/sd35m_24gb`` and reads its ``torch.cuda.max_memory_allocated`` (``max_memory_allocated_mib``).
Plans the same run (the recipe with the check's full-size SD3.5-M folder as ``model_name_or_path``, one GPU) with
:mod:`flowgrpo.plan` and compares the planned peak without its ``overhead`` allowance (CUDA context and
fragmentation are not in ``max_memory_allocated``) to the measured peak. Passes within :data:`TOLERANCE`.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from .probe import RESULT_FILE, write_result

__all__ = ["TOLERANCE", "compare", "main"]

TOLERANCE = 0.20
RECIPE = "recipes/sd35m_24gb.yaml"
GIB = 1024 ** 3


def compare(planned: dict[str, Any], measured_mib: float) -> dict[str, Any]:
    """Planned peak minus its overhead allowance (GB) against the measured ``max_memory_allocated`` (MiB)."""
    planned_bytes = (planned["peak_memory_gb"] - planned["breakdown_gb"]["overhead"]) * 1e9
    measured_bytes = measured_mib * 1024 ** 2
    return {"planned_allocated_gib": planned_bytes / GIB, "measured_allocated_gib": measured_bytes / GIB,
            "ratio": planned_bytes / measured_bytes if measured_bytes else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", required=True, help="the memory/sd35m_24gb check's folder")
    parser.add_argument("--model-dir", required=True, help="the sd35m-full pipeline folder that check trained")
    parser.add_argument("--gpu", default="rtx4090-24gb", help="GPU table entry of the plan (memory only)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    metrics: dict[str, Any] = {"recipe": RECIPE, "tolerance": TOLERANCE}
    failures: list[str] = []
    try:
        result_path = Path(args.measured) / RESULT_FILE
        if not result_path.is_file():
            raise FileNotFoundError(f"{result_path}: run the memory/sd35m_24gb check first")
        measured = json.loads(result_path.read_text()).get("metrics", {}).get("max_memory_allocated_mib")
        if measured is None:
            raise ValueError(f"{result_path} records no max_memory_allocated_mib")
        from ..plan import plan_recipe

        plan = plan_recipe(RECIPE, ["--model_name_or_path", str(args.model_dir)], gpu=args.gpu,
                           config_file="accelerate_configs/single_gpu.yaml", with_suggestions=False)
        metrics.update(compare(plan, float(measured)))
        metrics["planned_peak_gb"] = plan["peak_memory_gb"]
        metrics["planned_phases_gb"] = plan["phases"]
        ratio = metrics["ratio"]
        if ratio is None or abs(ratio - 1) > TOLERANCE:
            failures.append(f"planned {metrics['planned_allocated_gib']:.2f} GiB vs measured "
                            f"{metrics['measured_allocated_gib']:.2f} GiB (ratio {ratio}) is outside +-{TOLERANCE:.0%}")
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    summary = ""
    if "ratio" in metrics and metrics["ratio"] is not None:
        summary = (f"planned {metrics['planned_allocated_gib']:.2f} GiB vs measured max_memory_allocated "
                   f"{metrics['measured_allocated_gib']:.2f} GiB (x{metrics['ratio']:.2f})")
    write_result(not failures, metrics, failures, summary, check_dir=args.output)
    print(f"[plan_vs_measured] {'PASSED' if not failures else 'FAILED'} {json.dumps(metrics, default=str)}",
          flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
