"""MP4 in memory for the rewards that score a video the way its official code reads it from a file (``videoalign``).

Official video reward models read an ``.mp4`` written by the training script, so what they see has been through a
lossy H.264 round trip at the container's frame rate. `encode_mp4` and `decode_mp4` reproduce that round trip in
memory with PyAV (``pip install 'flowgrpo[video]'``), which bundles FFmpeg with libx264:

* encoding: H.264 (libx264), ``yuv420p``, constant rate factor 25, at ``fps`` frames per second: the settings of
  diffusers' ``export_to_video`` (imageio-ffmpeg with ``quality=5``, which it maps to ``-crf 25``), with which
  DanceGRPO-style scripts write their rollouts, except two that make the bytes a function of the frames alone: one
  encoder thread, and no macroblock-tree rate control (``mbtree=0``). With x264's defaults the same frames encode to
  different files from call to call (measured with PyAV 18.1's x264: 40 encodings of one 64x48 clip in one process
  gave two or three different files, the less common ones 3 to 16 times; 12 of a 832x480 clip gave two, 10 and 2),
  so the same video would get different rewards; with these two settings every encoding gave the same file;
* decoding: every frame, converted to RGB24 by FFmpeg's scaler, with the container's average frame rate and frame
  count, as ``decord.VideoReader`` reports them (``len(vr)``, ``vr.get_avg_fps()``). On the same file the RGB
  frames equal decord 0.6.0's bit for bit (checked on the tiny test videos).

yuv420p needs even frame sides; odd sides are refused with the fix (score without the round trip).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

__all__ = ["MP4_CRF", "decode_mp4", "encode_mp4", "require_av"]

#: The H.264 constant rate factor of the round trip (imageio-ffmpeg's mapping of diffusers' default quality 5).
MP4_CRF = 25


def require_av() -> Any:
    """The ``av`` module (PyAV), or an ImportError naming the extra that installs it."""
    try:
        import av
    except ImportError as exc:
        raise ImportError("encoding and decoding MP4 videos needs PyAV: pip install 'flowgrpo[video]' (or pip install "
                          "av); or pass through_mp4=False to score the frames without the MP4 round trip") from exc
    return av


def as_uint8_frames(frames: Sequence[Any]) -> Any:
    """``(T, H, W, 3)`` uint8 RGB array of PIL images or ``HxWx3`` uint8 arrays, all of one size."""
    import numpy as np
    from PIL import Image

    arrays = []
    for i, frame in enumerate(frames):
        if isinstance(frame, Image.Image):
            array = np.asarray(frame.convert("RGB"))
        else:
            array = np.asarray(frame)
            if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
                raise TypeError(f"frame {i} must be a PIL image or an HxWx3 uint8 array, got {type(frame).__name__} "
                                f"{getattr(array, 'dtype', '')} {getattr(array, 'shape', '')}")
        arrays.append(array)
    if not arrays:
        raise ValueError("a video needs at least one frame")
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"the frames of a video must share one size, got {sorted({a.shape for a in arrays})}")
    return np.stack(arrays)


def encode_mp4(frames: Sequence[Any], fps: float, crf: int = MP4_CRF) -> bytes:
    """The frames as an H.264 ``yuv420p`` MP4 at ``fps`` frames per second (see the module docstring).

    Raises:
        ValueError: no frames, frames of different sizes, odd sides, or ``fps`` not positive.
    """
    av = require_av()
    video = as_uint8_frames(frames)
    _, height, width, _ = video.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 in yuv420p needs even frame sides, got {width}x{height}; generate an even size or "
                         f"pass through_mp4=False")
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    rate = Fraction(fps).limit_denominator(1001)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(int(crf)), "x264-params": "mbtree=0"}
        stream.codec_context.thread_count = 1
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_mp4(data: bytes) -> tuple[Any, float]:
    """``(frames, fps)``: every frame of an MP4 as a ``(T, H, W, 3)`` uint8 RGB array, and the container's average
    frame rate (what decord's ``get_avg_fps`` reports)."""
    import numpy as np

    av = require_av()
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.base_rate
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError("the MP4 holds no decodable frame")
    return np.stack(frames), float(rate)
