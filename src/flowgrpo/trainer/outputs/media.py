"""Generated videos as logs and cards show them: key frames, animated GIFs, TensorBoard and wandb videos.

A video sample is a list of ``PIL.Image`` frames. Contact sheets show its first, middle and last frame; TensorBoard
and wandb get animated GIFs, encoded here with Pillow (TensorBoard's own ``add_video`` and ``wandb.Video`` on raw
arrays need moviepy / imageio, which flowgrpo does not require). A GIF holds at most 256 colours per frame.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from PIL import Image

__all__ = ["encode_gif", "is_video", "key_frames", "tensorboard_video_summary", "video_grid"]


def is_video(sample: Any) -> bool:
    """A video sample is a list (or tuple) of frames."""
    return isinstance(sample, (list, tuple))


def key_frames(frames: Sequence[Image.Image]) -> list[Image.Image]:
    """The first, middle and last frame (fewer for videos of one or two frames)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    picks = sorted({0, (len(frames) - 1) // 2, len(frames) - 1})
    return [frames[i] for i in picks]


def encode_gif(frames: Sequence[Image.Image], fps: float = 8.0) -> bytes:
    """An animated GIF (looping) of ``frames``."""
    rgb = [f.convert("RGB") for f in frames]
    buffer = io.BytesIO()
    rgb[0].save(buffer, format="GIF", save_all=True, append_images=rgb[1:], duration=max(1, round(1000 / fps)),
                loop=0, optimize=False)
    return buffer.getvalue()


def video_grid(videos: Sequence[Sequence[Image.Image]], columns: int | None = None) -> list[Image.Image]:
    """Tile several videos (same frame size) into one: frame ``t`` of the result shows frame ``t`` of each video.

    Shorter videos hold their last frame.
    """
    if not videos:
        raise ValueError("video_grid needs at least one video")
    columns = columns or max(1, math.ceil(math.sqrt(len(videos))))
    rows = math.ceil(len(videos) / columns)
    width, height = videos[0][0].size
    length = max(len(v) for v in videos)
    out = []
    for t in range(length):
        canvas = Image.new("RGB", (columns * width, rows * height), "black")
        for k, video in enumerate(videos):
            r, c = divmod(k, columns)
            canvas.paste(video[min(t, len(video) - 1)].convert("RGB").resize((width, height)), (c * width, r * height))
        out.append(canvas)
    return out


def tensorboard_video_summary(tag: str, frames: Sequence[Image.Image], fps: float = 8.0) -> Any:
    """A TensorBoard summary holding ``frames`` as an animated GIF (what ``SummaryWriter.add_video`` writes)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = frames[0].size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=encode_gif(frames, fps))
    return Summary(value=[Summary.Value(tag=tag, image=image)])
