#!/usr/bin/env python
"""Which ``rollout_cache`` runs on which model family: each of diffusers' cache hooks on the tiny pipeline of every
family, without and with classifier-free guidance, through the rollout engine's own training rollout.

    python scripts/rollout_cache_table.py [--output outputs/rollout_cache_table.json] [--steps 8]

For each family (``flowgrpo.testing``'s tiny pipelines, the video families at 5 frames) a DiffusionNFT trainer is built
without a cache; then for each cache its hooks are put on the transformer(s) (`flowgrpo.trainer.rollout.cache`) and
``RolloutEngine.generate`` samples one micro-batch of two prompts, as a training rollout does, at guidance 1 and at
guidance 3 (FLUX.1 Kontext and FLUX.2: their embedded guidance, one pass). Recorded per (family, cache, guidance):
whether it ran (else the exception), the fraction of hooked computations skipped, the largest difference of the
final latents from the same rollout without the cache, and the transformer calls per denoising step (2: guidance
runs the conditional and unconditional passes one after the other). The configurations make each cache act within
``--steps`` steps (TaylorSeer: a full step every 2 after 2; FirstBlock: threshold 0.2; MagCache: ratios of 1, which
skip as much as its limits allow); the table they fill is ``flowgrpo.trainer.speed_settings.UNSUPPORTED`` and the one
in docs/benchmarks.md ("Cached rollouts"). Prints a markdown table; writes the records as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

#: what each cache is given here (the engine adds its callbacks and step count)
CONFIGS = {
    "first_block": {"threshold": 0.2},
    "taylorseer": {"cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"},
    "mag": {"mag_ratios": [1.0] * 64, "retention_ratio": 0.2},
    "faster": {},
    "pab": {},
}
#: family -> (variant, frames, text tokens, source images per row)
FAMILIES = {
    "sd3": (None, 1, 16, 0), "flux": (None, 1, 16, 0), "flux_kontext": (None, 1, 16, 1), "qwenimage": (None, 1, 16, 0),
    "qwenimage_edit": (None, 1, 16, 1), "wan": (None, 5, 16, 0), "wan_two_experts": ("two_experts", 5, 16, 0),
    "flux2_klein": (None, 1, 16, 0), "flux2": (None, 1, 128, 0), "zimage": (None, 1, 16, 0),
    "qwenimage_edit_plus": (None, 1, 16, 1), "qwenimage21": (None, 1, 16, 0), "wan_i2v": (None, 5, 512, 1),
    "ltx2": (None, 5, 16, 0), "hunyuanvideo15": (None, 5, 16, 0),
}


def _source_image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


def _trainer(name: str, guidance: float, steps: int, folder: Path):
    from datasets import Dataset
    from peft import LoraConfig

    from flowgrpo.testing import cached_tiny_pipeline_path
    from flowgrpo.trainer.registry import TRAINERS

    family = name.removesuffix("_two_experts")
    variant, frames, tokens, images = FAMILIES[name]
    spec = TRAINERS["diffusion_nft"]
    rows = {"prompt": ["a red circle", "two blue squares"]}
    if images:
        rows["image"] = [_source_image(0), _source_image(1)]
    args = spec.config_class()(
        output_dir=str(folder), report_to=[], per_device_train_batch_size=2, num_generations=2, resolution=32,
        num_frames=frames, num_inference_steps=steps, eval_num_inference_steps=2, guidance_scale=guidance,
        max_steps=1, max_sequence_length=tokens, save_strategy="no", disable_tqdm=True, seed=0, log_images_steps=0,
        dtype="float32", negative_prompt="")
    path = cached_tiny_pipeline_path(family, seed=0, variant=variant)
    return spec.trainer_class()(model=str(path), reward_funcs=lambda prompts, images, **_: [0.0] * len(prompts),
                                args=args, train_dataset=Dataset.from_dict(rows),
                                peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))


def _rollout(trainer) -> tuple:
    """One training rollout of the first two rows: the final latents and the transformer calls per step."""
    import torch

    engine = trainer.rollouts
    calls = [0]
    handles = [t.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
               for t in engine.adapter.transformers()]
    try:
        rows = [trainer.train_dataset[i] for i in range(2)]
        generation = engine.generate(rows, 0, 0)
        for job in generation.jobs:
            job.result()
    finally:
        for handle in handles:
            handle.remove()
    final = torch.cat([r["x0"] for r in generation.records])
    return final, calls[0] / trainer.args.num_inference_steps, generation.timing


def measure(name: str, guidance: float, steps: int) -> list[dict]:
    from flowgrpo.trainer.rollout.cache import RolloutCache

    out = []
    with tempfile.TemporaryDirectory() as folder:
        trainer = _trainer(name, guidance, steps, Path(folder))
        engine = trainer.rollouts
        tic = time.perf_counter()
        reference, calls_per_step, _ = _rollout(trainer)
        base_s = time.perf_counter() - tic
        uses_cfg = engine.adapter.uses_cfg(guidance)
        for kind, config in CONFIGS.items():
            record = {"family": name, "cache": kind, "guidance": guidance, "uses_cfg": uses_cfg,
                      "calls_per_step": calls_per_step}
            engine.cache = RolloutCache(kind, config, engine.adapter.transformers(), video=engine.adapter.is_video)
            try:
                tic = time.perf_counter()
                final, _, timing = _rollout(trainer)
                record.update(ok=True, seconds=time.perf_counter() - tic, uncached_seconds=base_s,
                              skipped=1 - timing["cache_computed"] / timing["cache_calls"] if timing.get(
                                  "cache_calls") else 0.0,
                              max_latent_diff=float((final - reference).abs().max()))
            except Exception as err:  # recorded: the table is what fails and why
                record.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            finally:
                engine.cache = None
            out.append(record)
        engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="outputs/rollout_cache_table.json")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args(argv)
    records = []
    for name in args.families:
        for guidance in (1.0, 3.0):
            records += measure(name, guidance, args.steps)
            print(f"[rollout-cache-table] {name} at guidance {guidance:g} done", file=sys.stderr, flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(records, indent=1))
    print("| family | guidance | calls/step | " + " | ".join(CONFIGS) + " |")
    print("|---|---|---|" + "---|" * len(CONFIGS))
    for name in args.families:
        for guidance in (1.0, 3.0):
            cells = []
            rows = [r for r in records if r["family"] == name and r["guidance"] == guidance]
            for r in rows:
                cells.append(f"skips {r['skipped']:.2f}, diff {r['max_latent_diff']:.2g}" if r["ok"]
                             else f"fails: {r['error']}")
            print(f"| {name} | {guidance:g} | {rows[0]['calls_per_step']:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
