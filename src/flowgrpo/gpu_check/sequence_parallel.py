"""Check ``launch/sequence_parallel`` (two GPUs or more): sequence parallelism under ``accelerate launch`` on NCCL.

    python -m flowgrpo.gpu_check.sequence_parallel --num-processes N --model-dir DIR --output DIR

The CPU tests (tests/distributed/test_sequence_parallel.py) hold the arithmetic on gloo; this check runs the same
training on GPUs, where the collectives are NCCL's (the Ulysses all-to-alls, the gathers of uneven blocks, the SP
group leader's scores broadcast to the group) and the mesh is a CUDA one. On the tiny Wan pipeline (random weights,
float32) at 16 x 48 px and 9 frames (9 video tokens: two processes hold 5 and 4), with Flow-GRPO, SGD and 2 optimizer
steps of one group of 2 videos:

1. ``accelerate_configs/multi_gpu.yaml`` with 2 processes and ``sequence_parallel_size 2`` (one replica), and
   ``single_gpu.yaml`` with the same recipe and seed: the exported LoRAs must agree (max abs difference below
   ``TOLERANCE``) and the logged rewards must be equal; the two ranks hold the same weights after each step and log
   the same advantages.
2. With 4 GPUs or more, all of them (an even count) with ``sequence_parallel_size 2``: every rank the same weights
   after each step (DDP over the replicas, summed within each group).
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

from .launch import accelerate_command, check_rank_logs, inspect_lora_file, read_training_log, write_recipe
from .plan import repo_root
from .probe import write_result

__all__ = ["TOLERANCE", "compare_exports", "compare_group_logs", "main", "sequence_parallel_recipe"]

#: largest difference allowed between the LoRA of 2 sequence-parallel GPUs and that of one GPU (float32 kernels
#: that see other shapes; the CPU tests hold 1e-5)
TOLERANCE = 1e-4
PROMPTS = ["a red circle", 'a sign that says "hi"', "two blue squares", "a cat"]


def sequence_parallel_recipe(model_dir: str | os.PathLike, data_dir: str | os.PathLike,
                             output_dir: str | os.PathLike, sequence_parallel_size: int) -> dict[str, Any]:
    """The recipe both launches train (flat keys of src/train.py)."""
    return {
        "model_name_or_path": str(model_dir), "dtype": "float32", "use_peft": True, "lora_r": 2, "lora_alpha": 4,
        "lora_init": "gaussian", "dataset_name": str(data_dir), "reward_funcs": ["jpeg_compressibility"],
        "height": 16, "width": 48, "num_frames": 9, "num_inference_steps": 3, "eval_num_inference_steps": 3,
        "guidance_scale": 1.0, "max_sequence_length": 16, "noise_level": 1.0, "num_generations": 2,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "learning_rate": 1.0, "optim": "sgd",
        "beta": 0.0, "max_steps": 2, "seed": 0, "output_dir": str(output_dir), "logging_steps": 1,
        "log_images_steps": 0, "eval_strategy": "no", "save_strategy": "no", "report_to": "none",
        "disable_tqdm": True, "dataloader_num_workers": 0, "sequence_parallel_size": sequence_parallel_size,
    }


def compare_exports(first: str | os.PathLike, second: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """The largest difference between two exported LoRA files (same tensor names required)."""
    from safetensors.torch import load_file

    a = load_file(str(Path(first) / "pytorch_lora_weights.safetensors"))
    b = load_file(str(Path(second) / "pytorch_lora_weights.safetensors"))
    if set(a) != set(b):
        return {}, [f"the two exports hold different tensors ({len(a)} and {len(b)})"]
    largest = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    moved = max(float(t.abs().max()) for k, t in b.items() if "lora_B" in k)
    failures = [] if largest <= TOLERANCE else [
        f"the sequence-parallel LoRA differs from the one-GPU LoRA by {largest:.3g} (> {TOLERANCE})"]
    return {"lora_max_abs_diff": largest, "lora_B_max_abs": moved}, failures


def compare_group_logs(rank_dir: str | os.PathLike, group: list[int]) -> tuple[dict[str, Any], list[str]]:
    """The ranks of one SP group logged the same rewards and advantages at every step."""
    records = {r: [json.loads(line) for line in (Path(rank_dir) / f"rank{r}.jsonl").read_text().splitlines()
                   if line.strip()] for r in group}
    failures = []
    leader = records[group[0]]
    for rank in group[1:]:
        for step, (a, b) in enumerate(zip(leader, records[rank], strict=True), start=1):
            if a["logs"].get("reward") != b["logs"].get("reward") or a["local_advantages"] != b["local_advantages"]:
                failures.append(f"step {step}: rank {rank} logged other rewards or advantages than its group's "
                                f"leader (rank {group[0]})")
    return {"group": group, "steps": len(leader)}, failures


def _launch(config: str, processes: int, recipe: Path, env: dict[str, str]) -> tuple[int, float]:
    command = accelerate_command(config, processes, recipe)
    print(f"[sequence_parallel] $ {' '.join(command)}", flush=True)
    tic = time.monotonic()
    code = subprocess.run(command, cwd=repo_root(), env=env).returncode
    return code, round(time.monotonic() - tic, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, required=True, help="the GPUs to use (at least 2)")
    parser.add_argument("--model-dir", required=True, help="the tiny Wan pipeline folder (built when missing)")
    parser.add_argument("--output", required=True, help="the check's folder")
    args = parser.parse_args(argv)
    work = Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {"num_processes": args.num_processes}
    failures: list[str] = []
    try:
        if args.num_processes < 2:
            raise ValueError(f"--num-processes {args.num_processes}: sequence parallelism needs 2 GPUs or more.")
        from ..testing import save_tiny_pipeline

        model_dir = Path(args.model_dir)
        if not (model_dir / "model_index.json").is_file():
            save_tiny_pipeline("wan", model_dir, seed=0)
        data_dir = work / "prompts"
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "train.txt").write_text("\n".join(PROMPTS) + "\n")
        runs = [("sp2", "multi_gpu", 2, 2), ("one_gpu", "single_gpu", 1, 1)]
        if args.num_processes >= 4:
            runs.append(("all_gpus", "multi_gpu", args.num_processes - args.num_processes % 2, 2))
        for name, config, processes, size in runs:
            run_dir, rank_dir = work / name, work / name / "ranks"
            for old in rank_dir.glob("rank*.jsonl"):
                old.unlink()
            recipe = write_recipe(work / f"{name}.yaml", sequence_parallel_recipe(model_dir, data_dir, run_dir, size))
            code, seconds = _launch(config, processes, recipe, {**os.environ, "FLOWGRPO_RANK_LOG_DIR": str(rank_dir)})
            metrics[name] = {"processes": processes, "sequence_parallel_size": size, "wall_s": seconds}
            if code != 0:
                failures.append(f"{name}: accelerate launch exited with status {code} (see the output above)")
                continue
            found, problems = read_training_log(run_dir, expected_steps=2)
            problems += inspect_lora_file(run_dir)[1]
            ranks, rank_problems = check_rank_logs(rank_dir, processes)
            metrics[name].update(found, ranks=ranks)
            failures += [f"{name}: {p}" for p in problems + rank_problems]
            for leader in range(0, processes if size > 1 else 0, size):
                group, group_problems = compare_group_logs(rank_dir, list(range(leader, leader + size)))
                failures += [f"{name}: {p}" for p in group_problems]
        if not any(f.startswith(("sp2", "one_gpu")) for f in failures):
            found, problems = compare_exports(work / "one_gpu", work / "sp2")
            metrics["comparison"] = found
            failures += problems
            rewards = [metrics[n].get("reward") for n in ("sp2", "one_gpu")]
            if rewards[0] != rewards[1]:
                failures.append(f"the first step's reward differs: {rewards[0]} (2 GPUs, S=2) and {rewards[1]} (one)")
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    passed = not failures
    comparison = metrics.get("comparison", {})
    summary = (f"2 GPUs with S=2 vs one GPU: LoRA within {comparison.get('lora_max_abs_diff')}"
               if passed else "")
    write_result(passed, metrics, failures, summary)
    print(f"[sequence_parallel] {'PASSED' if passed else 'FAILED'} {json.dumps(metrics, default=str)}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
