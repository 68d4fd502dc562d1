"""Training samples to the loggers: images (or videos) with their prompts, rewards and the rewards' notes, sent to
every image-capable ``report_to`` backend.

TensorBoard: a contact sheet (``samples``; videos show their first, middle and last frame), the captions, and for
videos all samples tiled into one animated GIF (``samples/video``). wandb: ``samples`` holds one image, or one GIF
video, per sample.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from .contact_sheet import make_contact_sheet
from .media import encode_gif, is_video, tensorboard_video_summary, video_grid

__all__ = ["log_sample_images"]


def log_sample_images(callbacks: Sequence, images: list, prompts: list[str], rewards: list[float], step: int,
                      notes: list[str] | None = None, fps: int = 8) -> None:
    """Send the samples to the TensorBoard and wandb callbacks among ``callbacks`` (others are skipped)."""
    if not images:
        return
    from transformers.integrations import TensorBoardCallback, WandbCallback

    notes = notes or [""] * len(prompts)
    captions = [f"{p[:120]} | reward={r:.3f}" + (f" | {n}" if n else "") for p, r, n in zip(prompts, rewards, notes)]
    videos = all(is_video(im) for im in images)
    for cb in callbacks:
        if isinstance(cb, TensorBoardCallback) and getattr(cb, "tb_writer", None) is not None:
            sheet = np.asarray(make_contact_sheet(images, captions))
            cb.tb_writer.add_image("samples", sheet, global_step=step, dataformats="HWC")
            if videos:
                summary = tensorboard_video_summary("samples/video", video_grid(images), fps)
                cb.tb_writer._get_file_writer().add_summary(summary, step)
            cb.tb_writer.add_text("samples/prompts", "\n\n".join(captions), global_step=step)
            cb.tb_writer.flush()
        if isinstance(cb, WandbCallback) and getattr(cb, "_wandb", None) is not None and cb._wandb.run:
            wandb = cb._wandb
            if videos:
                media = [wandb.Video(io.BytesIO(encode_gif(v, fps)), format="gif", caption=c)
                         for v, c in zip(images, captions)]
            else:
                media = [wandb.Image(im, caption=c) for im, c in zip(images, captions)]
            wandb.log({"samples": media, "train/global_step": step})
