"""Check ``reward/ocr_throughput``: does the OCR reward keep up with the rollout?

The trainer scores each decoded micro-batch in a background thread while the next one is sampled, so the reward
costs nothing as long as the OCR scores images at least as fast as the GPU samples them; otherwise the step waits
for it (``timing/reward`` and the benchmark's ``reward`` column). This check measures both rates on this machine:

* OCR: the ``ocr`` reward (rapidocr, PP-OCR in onnxruntime on the host's CPU) on 512 px images with rendered words
  (``--images``, default 64: one generation batch of the benchmark preset), for onnxruntime's default thread count,
  1 thread, and the host's cores shared by the GPUs (``cores // GPUs``: what each training process gets when every
  GPU runs one). The mean OCR score on these clear renderings shows the engine reads them.
* Rollout: images per second of one process sampling with the ``sd35m-random`` preset (SD3.5-Medium architecture
  at full size, 512 px, micro-batches of 8, 10 steps, CFG 4.5, bf16) and decoding, after one warm-up micro-batch.

``keeps_up`` compares, per training process, OCR at ``cores // GPUs`` threads with the rollout rate.
``--device cpu --rollout-preset tiny`` is a reduced mode for a CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

from .probe import install_memory_recorder, write_result

__all__ = ["WORDS", "main", "measure_ocr", "measure_rollout", "render_text_images"]

WORDS = ["OPEN", "SALE", "MENU", "HELLO", "FLOW", "WELCOME", "COFFEE", "MAIN ST", "BAR", "EXIT", "HOTEL", "PIZZA"]


def render_text_images(count: int, size: int = 512, seed: int = 0) -> tuple[list[str], list[Any]]:
    """``count`` prompts with a quoted word and images of that word in large dark letters on a light background."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(seed)
    font = ImageFont.load_default(size=max(12, size // 7))
    prompts, images = [], []
    for i in range(count):
        word = WORDS[i % len(WORDS)]
        image = Image.new("RGB", (size, size), tuple(rng.randint(200, 255) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        box = draw.textbbox((0, 0), word, font=font)
        x = (size - (box[2] - box[0])) // 2 + rng.randint(-size // 16, size // 16)
        y = (size - (box[3] - box[1])) // 2 + rng.randint(-size // 8, size // 8)
        draw.text((x, y), word, fill=tuple(rng.randint(0, 60) for _ in range(3)), font=font)
        prompts.append(f'a sign that says "{word}"')
        images.append(image)
    return prompts, images


def measure_ocr(prompts: list[str], images: list[Any], num_threads: int | None) -> dict[str, Any]:
    """Images per second of the ``ocr`` reward with ``num_threads`` onnxruntime threads (``None``: its default)."""
    from ..rewards import get_reward

    reward = get_reward("ocr", num_threads=num_threads)
    reward(prompts[:2], images[:2])  # builds the engine and warms it up
    tic = time.perf_counter()
    scores = reward(prompts, images)
    seconds = time.perf_counter() - tic
    valid = [s for s in scores if s is not None]
    return {"num_threads": num_threads, "images": len(images), "seconds": round(seconds, 3),
            "images_per_s": len(images) / seconds, "mean_score": sum(valid) / len(valid) if valid else None}


def measure_rollout(preset_name: str = "sd35m-random", micro_batches: int = 2, warmup: int = 1) -> dict[str, Any]:
    """Images per second of sampling + decoding micro-batches with the preset's settings (one process)."""
    import torch

    from ..benchmarking.harness import build_trainer
    from ..benchmarking.presets import OCR_PROMPTS, get_preset

    preset = get_preset(preset_name)
    with tempfile.TemporaryDirectory(prefix="flowgrpo-ocr-rollout-") as tmp:
        trainer = build_trainer(preset, max_steps=1, output_dir=tmp)
        args, device = trainer.args, trainer.accelerator.device
        height, width = args.image_size
        micro = args.per_device_train_batch_size
        prompts = [OCR_PROMPTS[i % len(OCR_PROMPTS)] for i in range(micro)]
        generator = torch.Generator().manual_seed(0)
        window = (0, max(1, args.sde_window_size))
        times = []

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        with trainer.policy.generation_context() as model:
            embeds, rows = trainer.rollouts.encode_unique(prompts)
            embeds = embeds.index_select(rows)
            for _ in range(warmup + micro_batches):
                sync()
                tic = time.perf_counter()
                final, _ = trainer.rollouts.sample(model, embeds, args.num_inference_steps, args.guidance_scale,
                                                   args.noise_level, window, generator, record=True)
                trainer.adapter.decode(final.to(trainer.policy.dtype), height, width)
                sync()
                times.append(time.perf_counter() - tic)
        trainer.reward_set.close()
    measured = times[warmup:]
    return {"preset": preset.name, "micro_batch": micro, "num_inference_steps": args.num_inference_steps,
            "guidance_scale": args.guidance_scale, "resolution": height, "micro_batch_seconds": measured,
            "images_per_s": micro * len(measured) / sum(measured)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the check's folder")
    parser.add_argument("--num-gpus", type=int, default=1, help="training processes that share this host's CPU")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="onnxruntime thread counts to measure (0 = its default); default: 0, 1, cores // GPUs")
    parser.add_argument("--rollout-preset", default="sd35m-random")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the reduced mode (use a CPU preset such as tiny)")
    args = parser.parse_args(argv)
    install_memory_recorder("ocr_throughput")
    cores = os.cpu_count() or 1
    shared = max(1, cores // max(1, args.num_gpus))
    thread_counts = list(dict.fromkeys(args.threads if args.threads is not None else [0, 1, shared]))
    metrics: dict[str, Any] = {"host_cpus": cores, "num_gpus": args.num_gpus, "threads_per_process": shared}
    failures: list[str] = []
    try:
        prompts, images = render_text_images(args.images, args.size)
        metrics["ocr"] = []
        for threads in thread_counts:
            found = measure_ocr(prompts, images, threads or None)
            metrics["ocr"].append(found)
            print(f"[ocr_throughput] OCR with {threads or 'default'} thread(s): {found}", flush=True)
        scores = [m["mean_score"] for m in metrics["ocr"] if m["mean_score"] is not None]
        if not scores or min(scores) < 0.5:
            failures.append(f"the OCR read the rendered words badly (mean scores {scores}); its throughput is not "
                            "the reward's")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda needs a CUDA GPU")
        metrics["rollout"] = measure_rollout(args.rollout_preset)
        print(f"[ocr_throughput] rollout: {metrics['rollout']}", flush=True)
        per_process = next((m for m in metrics["ocr"] if m["num_threads"] == shared), metrics["ocr"][-1])
        ocr_rate, rollout_rate = per_process["images_per_s"], metrics["rollout"]["images_per_s"]
        metrics.update({"ocr_images_per_s_per_process": ocr_rate, "ocr_threads_compared": per_process["num_threads"],
                        "rollout_images_per_s_per_process": rollout_rate, "ocr_over_rollout": ocr_rate / rollout_rate,
                        "keeps_up": ocr_rate >= rollout_rate})
    except Exception as err:
        traceback.print_exc()
        failures.append(f"{type(err).__name__}: {err}")
    passed = not failures
    summary = ""
    if "keeps_up" in metrics:
        threads = metrics["ocr_threads_compared"] or "default"
        summary = (f"OCR {metrics['ocr_images_per_s_per_process']:.2f} img/s per process ({threads} threads) vs rollout "
                   f"{metrics['rollout_images_per_s_per_process']:.2f} img/s: "
                   + ("keeps up" if metrics["keeps_up"] else "does NOT keep up"))
    write_result(passed, metrics, failures, summary)
    print(f"[ocr_throughput] {'PASSED' if passed else 'FAILED'}: {summary}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
