"""Check ``bf16_onpolicy``: is the first-pass likelihood ratio still 1 (and the KL 0) when everything runs in bf16?

In exact arithmetic the first pass over a fresh batch recomputes the very transitions that were sampled, so
``ratio = exp(logp_theta - logp_old) = 1``; with a zero-initialised LoRA B, the reference policy (adapter off) equals
the policy and ``kl = 0``. In bf16 on a GPU the training forward runs with gradients (and checkpointing) where the
rollout ran without: any kernel that differs between the two shows up here. For each model below, one optimizer
step of ``FlowGRPOTrainer`` in bf16 (bf16 weights, bf16 autocast), classifier-free guidance on where the family uses
it, KL weight 0.04; recorded at step 1: ``on_policy_ratio_max_dev`` (max |ratio - 1| over the trained transitions),
``ratio_mean``, ``kl``, ``approx_kl``.

* ``sd3-tiny``, ``flux-tiny``: the tiny test pipelines (:mod:`flowgrpo.testing`), 64 px, 4 images, 4 steps, window 2.
* ``sd35m-random``: the SD3.5-Medium architecture at full size (the benchmark preset's pipeline), 512 px, 4 images,
  10 steps, window 3, CFG 4.5, 256 T5 tokens, LoRA r=32 on both streams' attention, gradient checkpointing.

``--cfg both`` also runs every model that uses classifier-free guidance with guidance 1.0, i.e. without it (one
pass per step instead of two: a different batch shape, so different kernels), recorded as ``<model>/no-cfg``; FLUX
embeds its guidance and runs once either way.

Passes when every model ran and stayed within ``FlowGRPOConfig.on_policy_tolerance`` (1e-3, the trainer's own
warning threshold) for the ratio and the KL; ``tolerance_held`` names the tightest of 0, 1e-7, ..., 1e-1 that held.

``--device cpu --models sd3-tiny`` is a reduced mode that runs on a CPU (bf16 there too).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .probe import install_memory_recorder, write_result

__all__ = ["CFG_MODELS", "MODELS", "TOLERANCES", "main", "run_model", "runs_for", "tightest_tolerance"]

MODELS = ("sd3-tiny", "flux-tiny", "sd35m-random")
TOLERANCES = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
PROMPTS = ['a storefront sign that says "OPEN"', 'a poster with the word "SALE"', 'a mug printed with "GOOD MORNING"',
           'a street sign reading "MAIN ST"', 'a chalkboard with "MENU"', 'a banner saying "WELCOME"']


def tightest_tolerance(deviation: float) -> float | None:
    """The smallest of :data:`TOLERANCES` that bounds ``deviation`` (``None`` beyond the largest)."""
    return next((t for t in TOLERANCES if abs(deviation) <= t), None)


def _trainer_for(model: str, device: str, work: Path, guidance_scale: float | None = None):
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from ..trainer import FlowGRPOConfig, FlowGRPOTrainer

    common = dict(output_dir=str(work / model), report_to=[], max_steps=1, save_strategy="no", logging_steps=1,
                  disable_tqdm=True, log_images_steps=0, seed=0, learning_rate=1e-4, dtype="bfloat16", bf16=True,
                  use_cpu=device == "cpu", beta=0.04, noise_level=0.7, per_device_train_batch_size=4,
                  num_generations=4, reward_num_workers=1)
    if model in ("sd3-tiny", "flux-tiny"):
        from ..testing import cached_tiny_pipeline_path

        family = model.split("-")[0]
        source: Any = str(cached_tiny_pipeline_path(family))  # the fingerprinted user cache
        args = FlowGRPOConfig(**common, resolution=64, num_inference_steps=4, eval_num_inference_steps=4,
                              sde_window_size=2, sde_window_range=[0, 2], max_sequence_length=16,
                              guidance_scale=guidance_scale or (4.5 if family == "sd3" else 3.5))
        lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                          target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    elif model == "sd35m-random":
        from ..benchmarking.presets import build_preset_pipeline, get_preset

        if device != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("sd35m-random builds the full-size SD3.5-Medium architecture on a CUDA GPU; run it with "
                               "--device cuda on a GPU machine.")
        preset = get_preset("sd35m-random")
        source = build_preset_pipeline(preset)  # bf16, on the GPU
        args = FlowGRPOConfig(**common, resolution=512, num_inference_steps=10, eval_num_inference_steps=10,
                              sde_window_size=3, max_sequence_length=256, guidance_scale=guidance_scale or 4.5,
                              activation_checkpointing=True)
        lora = LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=list(preset.lora_targets))
    else:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return FlowGRPOTrainer(model=source, reward_funcs="jpeg_compressibility", args=args,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora)


#: models whose guidance is classifier-free (two passes a step); FLUX.1 embeds its guidance scale
CFG_MODELS = ("sd3-tiny", "sd35m-random")


def runs_for(models: list[str], cfg: str) -> list[tuple[str, str, float | None]]:
    """``(name, model, guidance_scale)`` of each run: ``cfg`` ``on`` runs every model at its own guidance,
    ``off`` the CFG models at 1.0 (no guidance), ``both`` the two."""
    if cfg not in ("on", "off", "both"):
        raise ValueError(f"cfg={cfg!r}; choose on, off or both")
    runs = []
    for model in models:
        if cfg in ("on", "both") or model not in CFG_MODELS:
            runs.append((model, model, None))
        if cfg in ("off", "both") and model in CFG_MODELS:
            runs.append((f"{model}/no-cfg", model, 1.0))
    return runs


def run_model(model: str, device: str, work: Path, guidance_scale: float | None = None) -> dict[str, Any]:
    """One bf16 optimizer step on ``model``; the step-1 figures, wall time and peak memory."""
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    trainer = _trainer_for(model, device, work / ("no-cfg" if guidance_scale == 1.0 else "default"),
                           guidance_scale)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "ratio_mean" in h]
    if not logs:
        raise RuntimeError(f"{model}: the step logged no ratio_mean (log history: {trainer.state.log_history})")
    log = logs[0]
    params = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if not p.requires_grad]
    out = {
        "on_policy_ratio_max_dev": float(log["on_policy_ratio_max_dev"]),
        "ratio_mean": float(log["ratio_mean"]),
        "kl": float(log.get("kl", 0.0)),
        "approx_kl": float(log["approx_kl"]),
        "clip_frac": float(log["clip_frac"]),
        "base_weight_dtype": str(params[0].dtype) if params else None,
        "guidance_scale": float(trainer.args.guidance_scale),
        "cfg": bool(trainer.adapter.uses_cfg(trainer.args.guidance_scale)),
        "wall_s": round(time.perf_counter() - tic, 2),
    }
    if device == "cuda":
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    trainer.reward_set.close()
    del trainer
    gc.collect()  # the trainer sits in reference cycles (callbacks): free its GPU memory before the next model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="work folder (tiny pipelines, trainer output)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cfg", choices=["on", "off", "both"], default="on",
                        help="CFG models at their guidance (on), at 1.0 (off) or both")
    args = parser.parse_args(argv)
    install_memory_recorder("bf16_onpolicy")
    work = Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    from ..trainer import FlowGRPOConfig

    tolerance = FlowGRPOConfig.__dataclass_fields__["on_policy_tolerance"].default
    per_model: dict[str, Any] = {}
    failures: list[str] = []
    runs = runs_for(args.models, args.cfg)
    for name, model, guidance in runs:
        print(f"[bf16_onpolicy] {name} on {args.device}", flush=True)
        try:
            result = run_model(model, args.device, work, guidance)
        except Exception as err:
            traceback.print_exc()
            failures.append(f"{name}: {type(err).__name__}: {err}")
            per_model[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        per_model[name] = result
        print(f"[bf16_onpolicy] {name}: {result}", flush=True)
        # what finished so far, in case the run is stopped at its time limit before the next model
        write_result(False, {"models": per_model, "tolerance": tolerance, "device": args.device, "partial": True},
                     failures, f"{len(per_model)} of {len(runs)} runs finished")
        if result["on_policy_ratio_max_dev"] > tolerance:
            failures.append(f"{name}: first-pass max |ratio - 1| = {result['on_policy_ratio_max_dev']:.3g} > "
                            f"{tolerance}")
        if abs(result["kl"]) > tolerance:
            failures.append(f"{name}: KL at step 1 = {result['kl']:.3g} > {tolerance}")
    ran = [m for m in per_model.values() if "error" not in m]
    max_dev = max((m["on_policy_ratio_max_dev"] for m in ran), default=None)
    max_kl = max((abs(m["kl"]) for m in ran), default=None)
    metrics = {"models": per_model, "tolerance": tolerance, "max_ratio_deviation": max_dev, "max_abs_kl": max_kl,
               "tolerance_held": tightest_tolerance(max(max_dev, max_kl)) if ran else None, "device": args.device}
    summary = (f"max |ratio-1| {max_dev:.3g}, max |KL| {max_kl:.3g} over {len(ran)} model(s); tolerance held: "
               f"{metrics['tolerance_held']}") if ran else "no model ran"
    passed = not failures and len(ran) == len(runs)
    write_result(passed, metrics, failures, summary)
    print(f"[bf16_onpolicy] {'PASSED' if passed else 'FAILED'}: {summary}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
