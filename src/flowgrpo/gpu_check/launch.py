"""Check ``launch/<config>``: ``src/train.py`` under ``accelerate launch`` with one of accelerate_configs/, for real.

    accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes <visible GPUs> \\
        src/train.py <recipe written here>

(run under :mod:`.probe`, so every rank records its peak GPU memory). The recipe trains for 2 optimizer steps on the
``sd35m-launch`` pipeline (:mod:`.pipelines`: the SD3.5-Medium transformer and VAE at full size) at 512 px: 2 images
per process per step in groups of 2, 4 sampling steps with a window of 2, CFG 4.5, KL 0.04 (the reference pass),
gradient checkpointing, bf16, the JPEG-compressibility reward (cheap, and it gives every group a spread of rewards,
so the weights move), then an evaluation of 2 prompts and the save. LoRA r=16 by default; ``--full-finetune`` trains
the whole transformer instead.

Then, in this process, what a user would do with the result:

* LoRA: the exported ``pytorch_lora_weights.safetensors`` loads into the stock ``StableDiffusion3Pipeline`` of the
  same folder with ``load_lora_weights``: as many LoRA layers as the file has, non-zero B matrices, and images that
  differ from the base pipeline's with the same seed.
* Full fine-tuning: the saved ``transformer/`` has exactly the base transformer's tensor names, some of its weights
  differ from the base, and the stock pipeline samples finite images with it (the 5 GB folder is deleted afterwards
  unless ``--keep-outputs``).

``--recipe recipes/ocr.yaml`` launches that recipe file itself instead, as the README's launch line does, with
``--key value`` overrides that point it at the ``sd35m-launch`` folder and the shipped prompts and shorten it to
two steps of one micro-batch (:func:`recipe_launch_overrides`); ``--verify file`` then checks the exported LoRA
file alone (LoRA tensors named for diffusers, non-zero B matrices) without loading the pipeline a second time.

It also reads ``trainer_state.json`` (2 logged steps, the first-pass ratio at step 1 under distribution), checks that
the peak-memory records came from ranks 0 .. N-1 (N processes really trained), and, for the replicated configs (``single_gpu``, ``multi_gpu``, ``zero2`` with LoRA), every rank's records
(``FLOWGRPO_RANK_LOG_DIR``): world size = the processes launched, and the same trainable-weight digest on every rank
after every step (gradients were synchronised).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .plan import LAUNCH_CONFIGS, repo_root
from .probe import MEMORY_DIR_ENV, install_memory_recorder, read_memory_records, write_result

__all__ = ["RANK_LOGGED_CONFIGS", "accelerate_command", "check_rank_logs", "inspect_lora_file", "launch_recipe", "main",
           "read_training_log", "recipe_launch_overrides", "verify_full_finetune", "verify_lora_export",
           "write_prompt_files", "write_recipe"]

#: configs whose ranks hold full copies of the trainable weights (their digests can be compared across ranks)
RANK_LOGGED_CONFIGS = ("single_gpu", "multi_gpu", "zero2")
PROMPT = 'a wooden sign that says "OPEN"'


def write_prompt_files(folder: str | os.PathLike) -> Path:
    """``train.txt`` (the benchmark's OCR prompts) and ``test.txt`` (two of them) in ``folder``."""
    from ..benchmarking.presets import OCR_PROMPTS

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("\n".join(OCR_PROMPTS) + "\n")
    (folder / "test.txt").write_text("\n".join(OCR_PROMPTS[:2]) + "\n")
    return folder


def launch_recipe(model_dir: str | os.PathLike, data_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                  full_finetune: bool = False, **overrides: Any) -> dict[str, Any]:
    """The recipe of a launch check (flat keys of src/train.py); ``overrides`` replace any of them."""
    recipe: dict[str, Any] = {
        "model_name_or_path": str(model_dir), "dtype": "bfloat16", "bf16": True,
        "use_peft": not full_finetune, "lora_r": 16, "lora_alpha": 32, "lora_init": "gaussian",
        "activation_checkpointing": True,
        "dataset_name": str(data_dir), "reward_funcs": ["jpeg_compressibility"],
        "resolution": 512, "num_inference_steps": 4, "eval_num_inference_steps": 4, "guidance_scale": 4.5,
        "max_sequence_length": 256, "noise_level": 0.7, "sde_type": "sde", "sde_window_size": 2,
        "sde_window_range": [0, 2], "num_generations": 2, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1, "per_device_eval_batch_size": 2,
        "learning_rate": 1e-4 if full_finetune else 1e-3, "beta": 0.04, "max_steps": 2, "seed": 0,
        "output_dir": str(output_dir), "logging_steps": 1, "log_images_steps": 0, "eval_strategy": "no",
        "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0,
        "reward_num_workers": 1,
    }
    recipe.update(overrides)
    return recipe


def write_recipe(path: str | os.PathLike, recipe: dict[str, Any]) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by flowgrpo.gpu_check.launch\n" + yaml.safe_dump(recipe, sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recipe_launch_overrides(model_dir: str | os.PathLike, data_dir: str | os.PathLike,
                            output_dir: str | os.PathLike) -> list[str]:
    """``--key value`` overrides that run a shipped recipe for 2 optimizer steps of one micro-batch on a local model
    folder, with ``data_dir``'s prompts (its test prompts evaluated once at the end, at 10 steps), the
    JPEG-compressibility reward, and nothing saved but the final LoRA and state."""
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--max_steps", "2",
            "--gradient_accumulation_steps", "1", "--reward_funcs", "jpeg_compressibility", "--reward_kwargs", "{}",
            "--eval_strategy", "no", "--eval_num_inference_steps", "10", "--max_eval_samples", "8",
            "--save_strategy", "no", "--report_to", "none", "--log_images_steps", "0", "--logging_steps", "1",
            "--output_dir", str(output_dir), "--disable_tqdm", "true"]


def accelerate_command(config: str, num_processes: int, recipe: str | os.PathLike, *, python: str | None = None,
                       port: int | None = None, extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``accelerate launch`` of src/train.py under the probe, with the config's process count overridden
    (``extra_args``: ``--key value`` overrides after the recipe)."""
    if config not in LAUNCH_CONFIGS:
        raise ValueError(f"config={config!r}; choose one of {', '.join(LAUNCH_CONFIGS)}.")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1.")
    return [python or sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", f"accelerate_configs/{config}.yaml", "--num_processes", str(num_processes),
            "--main_process_port", str(port if port is not None else _free_port()),
            "-m", "flowgrpo.gpu_check.probe", "src/train.py", str(recipe), *map(str, extra_args)]


def read_training_log(output_dir: str | os.PathLike, expected_steps: int) -> tuple[dict[str, Any], list[str]]:
    """Figures of ``trainer_state.json``: logged steps, the step-1 first-pass ratio, eval reward."""
    path = Path(output_dir) / "trainer_state.json"
    if not path.is_file():
        return {}, [f"no {path} (the run did not finish and save its state)"]
    state = json.loads(path.read_text())
    logs = [h for h in state.get("log_history", []) if "ratio_mean" in h]
    metrics = {"global_step": state.get("global_step"), "logged_steps": [h.get("step") for h in logs]}
    failures = []
    if state.get("global_step") != expected_steps or len(logs) != expected_steps:
        failures.append(f"expected {expected_steps} optimizer steps, the state has global_step="
                        f"{state.get('global_step')} and {len(logs)} training log(s)")
    if logs:
        first = logs[0]
        metrics.update({k: first.get(k) for k in ("on_policy_ratio_max_dev", "ratio_mean", "kl", "reward",
                                                  "grad_norm")})
    evals = [h for h in state.get("log_history", []) if "eval_reward" in h]
    metrics["eval_reward"] = evals[-1]["eval_reward"] if evals else None
    return metrics, failures


def check_rank_logs(rank_dir: str | os.PathLike, num_processes: int) -> tuple[dict[str, Any], list[str]]:
    """Every rank logged every step, saw the launched world size, and holds the same trainable weights."""
    rank_dir = Path(rank_dir)
    records = {}
    for rank in range(num_processes):
        path = rank_dir / f"rank{rank}.jsonl"
        if not path.is_file():
            return {}, [f"rank {rank} wrote no {path.name} (did {num_processes} processes start?)"]
        records[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    failures = []
    sizes = {r["world_size"] for recs in records.values() for r in recs}
    if sizes != {num_processes}:
        failures.append(f"world sizes {sorted(sizes)} != the {num_processes} processes launched")
    steps = {rank: [r["step"] for r in recs] for rank, recs in records.items()}
    if len({tuple(s) for s in steps.values()}) != 1:
        failures.append(f"ranks logged different steps: {steps}")
    digests = {}
    for step_index, per_rank in enumerate(zip(*records.values())):
        digests[step_index] = {r["trainable_sha1"] for r in per_rank}
        if len(digests[step_index]) != 1:
            failures.append(f"after logged step {step_index + 1} the ranks hold different trainable weights")
    return {"ranks": num_processes, "steps_per_rank": steps[0] if steps else [],
            "weights_equal_across_ranks": not any(len(d) != 1 for d in digests.values())}, failures


def _images(pipe, size: int, seed: int = 0):
    import torch

    return pipe(PROMPT, num_inference_steps=2, height=size, width=size, guidance_scale=1.0, max_sequence_length=32,
                output_type="np", generator=torch.Generator().manual_seed(seed)).images


def inspect_lora_file(output_dir: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """The exported ``pytorch_lora_weights.safetensors``: its LoRA tensors, named for diffusers (``transformer.``
    prefix), and how many B matrices training moved away from zero."""
    from safetensors import safe_open

    path = Path(output_dir) / "pytorch_lora_weights.safetensors"
    if not path.is_file():
        return {}, [f"no {path.name} in {output_dir}: the LoRA was not exported"]
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        lora_a = [k for k in keys if "lora_A" in k]
        nonzero_b = sum(int(f.get_tensor(k).abs().sum() > 0) for k in keys if "lora_B" in k)
    failures = []
    if not lora_a or not all(k.startswith("transformer.") for k in keys):
        failures.append(f"{path.name} holds {len(lora_a)} lora_A tensors; keys must start with 'transformer.' "
                        f"(first: {keys[:2]})")
    if nonzero_b == 0:
        failures.append("every lora_B is zero: training did not move the adapter")
    return {"lora_tensors": len(keys), "lora_layers_in_file": len(lora_a), "nonzero_lora_B": nonzero_b}, failures


def verify_lora_export(model_dir: str | os.PathLike, output_dir: str | os.PathLike, *, device: str = "cuda",
                       dtype: Any = None, size: int = 256) -> tuple[dict[str, Any], list[str]]:
    """Load the exported LoRA into the stock pipeline; see the module docstring for what must hold."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from peft.tuners.lora import LoraLayer

    dtype = dtype or torch.bfloat16
    found, failures = inspect_lora_file(output_dir)
    if not found:
        return found, failures
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype).to(device)
    base = _images(pipe, size)
    pipe.load_lora_weights(str(output_dir))
    loaded = sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules())
    tuned = _images(pipe, size)
    diff = float(np.abs(base.astype(np.float32) - tuned.astype(np.float32)).max())
    metrics = {**found, "lora_layers_loaded": loaded, "image_max_abs_diff": diff}
    if loaded != found["lora_layers_in_file"]:
        failures.append(f"load_lora_weights put {loaded} LoRA layers in the transformer, the file has "
                        f"{found['lora_layers_in_file']}")
    if not np.isfinite(tuned).all():
        failures.append("the pipeline with the LoRA produced non-finite images")
    elif diff == 0.0:
        failures.append("the LoRA does not change the pipeline's images (same seed)")
    del pipe
    return metrics, failures


def verify_full_finetune(model_dir: str | os.PathLike, output_dir: str | os.PathLike, *, device: str = "cuda",
                         dtype: Any = None, size: int = 256) -> tuple[dict[str, Any], list[str]]:
    """Reload the saved transformer into the stock pipeline; see the module docstring for what must hold."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline, SD3Transformer2DModel
    from safetensors import safe_open

    dtype = dtype or torch.bfloat16
    folder = Path(output_dir) / "transformer"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return {}, [f"no transformer/*.safetensors in {output_dir}: the fine-tuned transformer was not saved"]
    saved_keys: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            saved_keys.update(f.keys())
    base = SD3Transformer2DModel.from_pretrained(str(model_dir), subfolder="transformer", dtype=dtype)
    base_state = base.state_dict()
    missing, unexpected = sorted(set(base_state) - saved_keys), sorted(saved_keys - set(base_state))
    failures = []
    if missing or unexpected:
        failures.append(f"saved tensor names differ from the base transformer's: {len(missing)} missing (e.g. "
                        f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
        return {"saved_tensors": len(saved_keys)}, failures
    tuned = SD3Transformer2DModel.from_pretrained(str(folder), dtype=dtype)
    changed, largest = 0, 0.0
    for name, value in tuned.state_dict().items():
        if not torch.equal(value, base_state[name]):
            changed += 1
            largest = max(largest, float((value.float() - base_state[name].float()).abs().max()))
    del base, base_state
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), transformer=tuned, dtype=dtype).to(device)
    images = _images(pipe, size)
    metrics = {"saved_tensors": len(saved_keys), "changed_tensors": changed, "max_abs_weight_change": largest,
               "images_finite": bool(np.isfinite(images).all())}
    if changed == 0:
        failures.append("no weight of the saved transformer differs from the base: training did not change it")
    if not metrics["images_finite"]:
        failures.append("the stock pipeline with the fine-tuned transformer produced non-finite images")
    del pipe
    return metrics, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=LAUNCH_CONFIGS, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--model-dir", required=True, help="the sd35m-launch pipeline folder (built when missing)")
    parser.add_argument("--output", required=True, help="the check's folder")
    parser.add_argument("--full-finetune", action="store_true", help="train the whole transformer instead of a LoRA")
    parser.add_argument("--keep-outputs", action="store_true", help="keep a fine-tuned transformer after checking it")
    parser.add_argument("--recipe", default=None,
                        help="launch this recipe file with recipe_launch_overrides (e.g. recipes/ocr.yaml) instead of "
                             "the generated launch recipe")
    parser.add_argument("--verify", choices=["reload", "file"], default="reload",
                        help="reload the export into the stock pipeline (default) or only inspect the LoRA file")
    args = parser.parse_args(argv)
    if args.recipe and args.full_finetune:
        parser.error("--recipe launches a LoRA recipe as it is; --full-finetune goes with the generated recipe")
    install_memory_recorder("launch_verify")
    from .pipelines import ensure_pipeline

    work = Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Any] = {"config": args.config, "num_processes": args.num_processes,
                               "training": "full fine-tuning" if args.full_finetune else "LoRA"}
    failures: list[str] = []
    try:
        model_dir = ensure_pipeline("sd35m-launch", args.model_dir)
        run_dir = work / "run"
        extra: list[str] = []
        if args.recipe:
            recipe: Path | str = args.recipe
            extra = recipe_launch_overrides(model_dir, repo_root() / "data" / "ocr_synthetic", run_dir)
            metrics["recipe"] = args.recipe
        else:
            recipe = write_recipe(work / "recipe.yaml", launch_recipe(model_dir, write_prompt_files(work / "prompts"),
                                                                      run_dir, full_finetune=args.full_finetune))
        env = dict(os.environ)
        rank_dir = None
        if args.config in RANK_LOGGED_CONFIGS and not args.full_finetune:
            rank_dir = work / "ranks"
            for old in rank_dir.glob("rank*.jsonl"):
                old.unlink()
            env["FLOWGRPO_RANK_LOG_DIR"] = str(rank_dir)
        command = accelerate_command(args.config, args.num_processes, recipe, extra_args=extra)
        print(f"[launch] $ {' '.join(command)}", flush=True)
        tic = time.monotonic()
        code = subprocess.run(command, cwd=repo_root(), env=env).returncode
        metrics["launch_wall_s"] = round(time.monotonic() - tic, 1)
        if code != 0:
            failures.append(f"accelerate launch exited with status {code} (see the output above)")
        else:
            found, problems = read_training_log(run_dir, expected_steps=2)
            metrics.update(found)
            failures += problems
            if os.environ.get(MEMORY_DIR_ENV):  # every rank recorded its peak at exit: were N processes there?
                ranks = sorted(r.get("rank") for r in read_memory_records(os.environ[MEMORY_DIR_ENV])
                               if r.get("tag") == "train")
                metrics["ranks_recorded"] = ranks
                if ranks != list(range(args.num_processes)):
                    failures.append(f"GPU memory records came from ranks {ranks}, not from the "
                                    f"{args.num_processes} processes launched")
            if rank_dir is not None:
                found, problems = check_rank_logs(rank_dir, args.num_processes)
                metrics["ranks"] = found
                failures += problems
            if args.verify == "file":
                found, problems = inspect_lora_file(run_dir)
            else:
                verify = verify_full_finetune if args.full_finetune else verify_lora_export
                found, problems = verify(model_dir, run_dir)
            metrics["export"] = found
            failures += problems
            if args.full_finetune and not args.keep_outputs:
                import shutil

                shutil.rmtree(run_dir / "transformer", ignore_errors=True)
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    passed = not failures
    export = metrics.get("export") or {}
    summary = (f"x{args.num_processes} {metrics['training']}: ratio dev {metrics.get('on_policy_ratio_max_dev')}, "
               + (f"{export.get('lora_layers_in_file')} LoRA layers exported" if args.verify == "file" else
                  f"{export.get('lora_layers_loaded')} LoRA layers reloaded" if not args.full_finetune else
                  f"{export.get('changed_tensors')} tensors changed, reloaded"))
    write_result(passed, metrics, failures, summary if passed else "")
    print(f"[launch] {'PASSED' if passed else 'FAILED'} {json.dumps(metrics, default=str)}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
