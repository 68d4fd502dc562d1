"""Fit the planner's MFU to published Flow-GRPO step times and print each point's error.

    PYTHONPATH=src python scripts/calibrate_plan.py

Each published point is planned as a shipped recipe plus the overrides that match its settings (the settings not
published are assumptions, stated in CALIBRATION_POINTS and docs/planning.md). For each point the MFU that reproduces
its time is step FLOPs / ((published time - communication time) x peak); the fitted MFU is their geometric mean.
"""

from __future__ import annotations

import json
import math
import sys

CALIBRATION_POINTS = [
    {"name": "verl-omni Qwen-Image Flow-GRPO LoRA, 4x H800", "seconds": 420.0,
     "source": "https://verl-omni.readthedocs.io/en/latest/algo/performance.html",
     "recipe": "recipes/qwenimage_ocr.yaml", "config": "accelerate_configs/fsdp8_qwenimage.yaml", "gpus": 4,
     "gpu": "h800-80gb",
     # published: 32 prompts x 16 images per step, LoRA rank 64, micro-batch 16. Assumed: 512 px, 10 steps, every
     # step but the last trained (Flow-GRPO), true CFG 4.0
     "overrides": ["--num_generations", "16", "--per_device_train_batch_size", "16", "--gradient_accumulation_steps",
                   "8", "--lora_r", "64", "--lora_alpha", "128", "--sde_window_size", "0"]},
    {"name": "verl-omni Qwen-Image Flow-GRPO full fine-tuning (no CFG), 4x H200", "seconds": 250.0,
     "source": "https://verl-omni.readthedocs.io/en/latest/algo/performance.html",
     "recipe": "recipes/qwenimage_ocr.yaml", "config": "accelerate_configs/fsdp8_qwenimage.yaml", "gpus": 4,
     "gpu": "h200-141gb",
     "overrides": ["--num_generations", "16", "--per_device_train_batch_size", "16", "--gradient_accumulation_steps",
                   "8", "--use_peft", "false", "--guidance_scale", "1.0", "--beta", "0", "--use_ema", "false",
                   "--sde_window_size", "0"]},
    {"name": "MM-GRPO SD3.5-M Flow-GRPO-Fast, 1x H800", "seconds": 58.0,
     "source": "MM-GRPO's published SD3.5-M Fast figure (settings assumed: recipes/ocr.yaml's per-GPU batch)",
     "recipe": "recipes/ocr.yaml", "config": "accelerate_configs/single_gpu.yaml", "gpus": 1, "gpu": "h800-80gb",
     "overrides": []},
]


def main() -> int:
    from flowgrpo.plan import plan_recipe
    from flowgrpo.plan.gpus import get_gpu

    rows = []
    for point in CALIBRATION_POINTS:
        plan = plan_recipe(point["recipe"], point["overrides"], config_file=point["config"], gpu=point["gpu"],
                           num_processes=point["gpus"], with_suggestions=False)
        comm = plan["details"]["comm_time_s"]
        peak = get_gpu(point["gpu"]).bf16_tflops * 1e12
        mfu = plan["step_flops"] / (max(point["seconds"] - comm, 1e-9) * peak)
        rows.append({"name": point["name"], "published_s": point["seconds"], "step_flops": plan["step_flops"],
                     "comm_s": comm, "mfu_that_fits": mfu})
    fitted = math.exp(sum(math.log(r["mfu_that_fits"]) for r in rows) / len(rows))
    for r in rows:
        predicted = r["step_flops"] / (fitted * get_gpu(
            next(p["gpu"] for p in CALIBRATION_POINTS if p["name"] == r["name"])).bf16_tflops * 1e12) + r["comm_s"]
        r["predicted_s"] = predicted
        r["error"] = predicted / r["published_s"] - 1
    json.dump({"mfu": fitted, "points": rows}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
