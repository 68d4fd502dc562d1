"""Short toy-world runs of every trainer with fixed seeds, reduced to what must not change when the code is
restructured: a digest of the trained weights and the logged metrics.

Each run goes through the launch script (``flowgrpo.cli.train.main``) on the shipped toy world: two optimizer steps of
16 images, a checkpoint at step 1, and the final evaluation on two prompts. ``tests/trainer/test_behaviour_unchanged.py``
compares a fresh run with the record in ``tests/trainer/behaviour_data/behaviour_record.json``; to record again (only when a
change of behaviour is intended, said in the commit):

    PYTHONPATH=src python tests/support/behaviour_runs.py --record tests/trainer/behaviour_data/behaviour_record.json

The record holds, per run, the SHA-256 of the exported LoRA's tensors (exact; compared where the CPU kernels are the
ones it was recorded with, ``torch.backends.cpu.get_cpu_capability()``), a projection of the same tensors on 8 fixed
random directions (compared within a relative 1e-4 anywhere), and the logged metrics except timings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SMALL_LORA = ["--lora_r", "2", "--lora_alpha", "4", "--lora_target_modules", "to_q", "to_v"]
#: run name -> (recipe, extra command-line overrides); every run also gets COMMON
RUNS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo_kl": ("recipes/toy_kl_analytic.yaml", []),
    "flow_grpo_guards": ("recipes/toy.yaml", ["--filter_zero_std_groups", "true", "--regularizer", "gardo",
                                              "--gardo_auxiliary_rewards", "toy_shape", "--beta", "0.01"]),
    "diffusion_nft": ("recipes/toy_nft_fast.yaml", []),
    "awm": ("recipes/toy_awm.yaml", ["--per_device_train_batch_size", "24"]),  # one group of the recipe's 24
    "diffusion_dpo_online": ("recipes/toy_dpo.yaml", ["--dpo_mode", "online"]),
    # small LoRAs whose step-1 checkpoints are kept as test data: written by the code of the record, they must
    # resume with the code of today (RESUMED_RUNS)
    "resume_flow_grpo_guards": ("recipes/toy.yaml", ["--filter_zero_std_groups", "true", "--regularizer", "gardo",
                                                     "--gardo_auxiliary_rewards", "toy_shape", "--beta", "0.01",
                                                     *SMALL_LORA]),
    "resume_diffusion_nft": ("recipes/toy_nft_fast.yaml", SMALL_LORA),
}
#: the runs whose checkpoint-1 is kept, in tests/trainer/behaviour_data/checkpoints/<run>/checkpoint-1
RESUMED_RUNS = ("resume_flow_grpo_guards", "resume_diffusion_nft")
COMMON = ["--max_steps", "2", "--per_device_train_batch_size", "16", "--logging_steps", "1",
          "--eval_images_per_prompt", "1", "--eval_num_inference_steps", "4", "--per_device_eval_batch_size", "2",
          "--eval_on_start", "false", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "1",
          "--save_total_limit", "2", "--disable_tqdm", "true", "--seed", "0", "--cpu_threads", "1"]
#: logged keys that measure time or the machine, not the run
VOLATILE = ("timing/", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
            "memory/", "cpu_threads")
PROJECTIONS = 8


def weight_signature(lora_file: Path) -> dict:
    """The exact digest and a seed-fixed random projection of an exported LoRA's tensors (sorted by name)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(lora_file))
    digest = hashlib.sha256()
    flat = []
    for name in sorted(tensors):
        t = tensors[name].detach().float().contiguous()
        digest.update(name.encode())
        digest.update(t.numpy().tobytes())
        flat.append(t.reshape(-1).double())
    flat = torch.cat(flat)
    directions = torch.randn(PROJECTIONS, flat.numel(), generator=torch.Generator().manual_seed(0),
                             dtype=torch.float64)
    return {"sha256": digest.hexdigest(), "projection": (directions @ flat).tolist(), "numel": int(flat.numel())}


def _metrics(log_history: list[dict]) -> list[dict]:
    kept = []
    for entry in log_history:
        row = {k: v for k, v in entry.items() if not any(k.startswith(p) or p in k for p in VOLATILE)
               and isinstance(v, (int, float))}
        kept.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in sorted(row.items())})
    return kept


def run_one(name: str, toy_world: Path, output_dir: Path, resume_from: Path | None = None) -> dict:
    """One run of ``RUNS[name]`` on ``toy_world`` (a copy of the shipped world), or its continuation from the
    checkpoint ``resume_from``; returns its record."""
    from flowgrpo.cli.train import main
    from flowgrpo.toy.build import read_prompts

    recipe, extra = RUNS[name]
    output_dir.mkdir(parents=True, exist_ok=True)
    eval_file = output_dir / "eval_prompts.txt"
    eval_file.write_text("\n".join(read_prompts(toy_world, "eval")[:2]) + "\n", encoding="utf-8")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        trainer = main([recipe, "--model_name_or_path", str(toy_world),
                        "--dataset_name", str(toy_world / "prompts_train.txt"), "--eval_dataset_name", str(eval_file),
                        "--output_dir", str(output_dir / "out"), *COMMON, *extra,
                        *(["--resume_from_checkpoint", str(resume_from)] if resume_from else [])])
    finally:
        os.chdir(cwd)
    out = output_dir / "out"
    return {"weights": weight_signature(out / "pytorch_lora_weights.safetensors"),
            "checkpoint_weights": weight_signature(out / "checkpoint-2" / "pytorch_lora_weights.safetensors"),
            "metrics": _metrics(trainer.state.log_history)}


def cpu_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", required=True, help="the JSON file to write")
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--checkpoints", default=None,
                        help="also copy checkpoint-1 of the RESUMED_RUNS into this folder (<run>/checkpoint-1)")
    cli = parser.parse_args(argv)
    import tempfile

    import torch

    from flowgrpo.toy.build import cached_toy_world

    torch.set_num_threads(1)
    world = cached_toy_world("full", seed=0, log=lambda message: None)
    record = {"cpu_capability": cpu_capability(), "torch": torch.__version__, "runs": {}}
    with tempfile.TemporaryDirectory(dir=cli.workdir) as tmp:
        for name in cli.runs:
            record["runs"][name] = run_one(name, world, Path(tmp) / name)
            if cli.checkpoints and name in RESUMED_RUNS:
                import shutil

                target = Path(cli.checkpoints) / name / "checkpoint-1"
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(Path(tmp) / name / "out" / "checkpoint-1", target)
            print(name, record["runs"][name]["weights"]["sha256"], flush=True)
    Path(cli.record).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.record).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    main()
