"""Check ``memory/sd35m_24gb``: does ``recipes/sd35m_24gb.yaml`` train SD3.5-Medium within 24 GB?

Runs the recipe as users do, with only the model, data, length and output changed::

    accelerate launch --config_file accelerate_configs/single_gpu.yaml src/train.py recipes/sd35m_24gb.yaml \\
        --model_name_or_path <sd35m-full> --dataset_name <8 OCR prompts> --max_steps 2 ...

on the ``sd35m-full`` pipeline (:mod:`.pipelines`: every component at full size, T5-XXL included) at the recipe's
512 px: two optimizer steps (two generation batches of 32 images, micro-batches of 4 with CFG), the 4-bit NF4
transformer, LoRA, 8-bit AdamW, gradient checkpointing, the prompt cache with the text encoders offloaded (the
first batch's prompts make the encoders visit the GPU, as every new prompt does), sliced VAE decoding, and an
evaluation of 4 prompts at 10 steps.

Recorded: the training process's ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (what the caching
allocator held), and the GPU's ``nvidia-smi`` memory while it ran minus the reading before it started (the
process's whole footprint: CUDA context and library workspaces included). A 24 GB card (24,576 MiB) keeps some
memory for the driver and, on a desktop, the display; the check passes when the footprint (or, without nvidia-smi,
the reserved peak plus 600 MiB of CUDA context) stays within :data:`BUDGET_MIB` = 23,552 MiB (23 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .plan import repo_root
from .probe import MEMORY_DIR_ENV, read_memory_records, write_result

__all__ = ["BUDGET_MIB", "CONTEXT_ESTIMATE_MIB", "main", "training_command"]

BUDGET_MIB = 23 * 1024
CONTEXT_ESTIMATE_MIB = 600
RECIPE = "recipes/sd35m_24gb.yaml"


def training_command(model_dir: str | os.PathLike, data_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                     python: str | None = None, recipe: str = RECIPE, max_steps: int = 2) -> list[str]:
    """The documented launch line of the recipe, under the probe, with the check's model, data and length."""
    return [python or sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            "accelerate_configs/single_gpu.yaml", "--num_processes", "1", "-m", "flowgrpo.gpu_check.probe",
            "src/train.py", recipe, "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
            "--output_dir", str(output_dir), "--max_steps", str(max_steps), "--max_eval_samples", "4",
            "--eval_num_inference_steps", "10", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
            "--logging_steps", "1", "--disable_tqdm", "true", "--log_images_steps", "0"]


def _write_prompts(folder: Path) -> Path:
    from ..benchmarking.presets import OCR_PROMPTS

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("\n".join(OCR_PROMPTS[:8]) + "\n")
    (folder / "test.txt").write_text("\n".join(OCR_PROMPTS[8:12]) + "\n")
    return folder


def _step_figures(output_dir: Path) -> dict[str, Any]:
    path = output_dir / "trainer_state.json"
    if not path.is_file():
        return {}
    logs = [h for h in json.loads(path.read_text()).get("log_history", []) if "ratio_mean" in h]
    keys = ("on_policy_ratio_max_dev", "timing/sampling", "timing/training", "timing/text_encoding", "reward")
    return {"steps": len(logs), "per_step": [{k: h.get(k) for k in keys} for h in logs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="the sd35m-full pipeline folder (built when missing)")
    parser.add_argument("--output", required=True, help="the check's folder")
    parser.add_argument("--recipe", default=RECIPE)
    args = parser.parse_args(argv)
    from .pipelines import ensure_pipeline
    from .runner import GpuMemorySampler

    work = Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {"recipe": args.recipe, "budget_mib": BUDGET_MIB}
    failures: list[str] = []
    memory_dir = Path(os.environ.get(MEMORY_DIR_ENV) or work / "memory")
    try:
        model_dir = ensure_pipeline("sd35m-full", args.model_dir)
        run_dir = work / "run"
        command = training_command(model_dir, _write_prompts(work / "prompts"), run_dir, recipe=args.recipe)
        env = {**os.environ, MEMORY_DIR_ENV: str(memory_dir)}
        sampler = GpuMemorySampler(interval_s=0.5)
        sampler.sample()  # the reading before training: whatever else holds GPU memory
        baseline = dict(sampler.peak_mib)
        sampler.peak_mib.clear()
        print(f"[memory] $ {' '.join(command)}", flush=True)
        tic = time.monotonic()
        sampler.start()
        try:
            code = subprocess.run(command, cwd=repo_root(), env=env).returncode
        finally:
            sampler.stop()
        metrics["wall_s"] = round(time.monotonic() - tic, 1)
        records = [r for r in read_memory_records(memory_dir) if r.get("tag") == "train"]
        devices = [d for r in records for d in (r.get("devices") or {}).values() if isinstance(d, dict)]
        if devices:
            metrics["max_memory_allocated_mib"] = max(d["max_memory_allocated_mib"] for d in devices)
            metrics["max_memory_reserved_mib"] = max(d["max_memory_reserved_mib"] for d in devices)
        if sampler.available and sampler.peak_mib:
            metrics["nvidia_smi_baseline_mib"] = baseline
            metrics["nvidia_smi_peak_mib"] = dict(sampler.peak_mib)
            metrics["footprint_mib"] = max(sampler.peak_mib[i] - baseline.get(i, 0.0) for i in sampler.peak_mib)
        metrics.update(_step_figures(run_dir))
        if code != 0:
            failures.append(f"the training run exited with status {code} (see the output above)")
        if "footprint_mib" in metrics:
            peak, how = metrics["footprint_mib"], "nvidia-smi footprint"
        elif "max_memory_reserved_mib" in metrics:
            peak, how = metrics["max_memory_reserved_mib"] + CONTEXT_ESTIMATE_MIB, "reserved + CUDA context estimate"
        else:
            peak, how = None, ""
            failures.append("no peak memory was recorded for the training process")
        metrics["peak_mib"], metrics["peak_measured_by"] = peak, how
        if peak is not None and peak > BUDGET_MIB:
            failures.append(f"peak {peak:.0f} MiB ({how}) exceeds the 24 GB card budget of {BUDGET_MIB} MiB")
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    passed = not failures
    peak = metrics.get("peak_mib")
    summary = ""
    if peak is not None:
        summary = (f"peak {peak / 1024:.2f} GiB ({metrics['peak_measured_by']}; torch reserved "
                   f"{metrics.get('max_memory_reserved_mib', 0) / 1024:.2f} GiB) vs budget {BUDGET_MIB / 1024:.0f} GiB")
    write_result(passed, metrics, failures, summary)
    print(f"[memory] {'PASSED' if passed else 'FAILED'} {json.dumps(metrics, default=str)}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
