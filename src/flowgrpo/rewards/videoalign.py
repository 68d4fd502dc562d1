"""`videoalign`: VideoReward (Liu et al., "Improving Video Generation with Human Feedback", 2025; ``KwaiVGI/VideoAlign``,
weights ``KlingTeam/VideoReward``), a video reward model scoring visual quality (VQ), motion quality (MQ) and text
alignment (TA), as DanceGRPO and UniRL train video generators on it.

Model: Qwen2-VL-2B-Instruct whose tokenizer gains three special tokens ``<|VQ_reward|> <|MQ_reward|> <|TA_reward|>``
(the embedding resized to ``len(tokenizer)``), plus ``rm_head = Linear(hidden, output_dim, bias=False)`` on the last
hidden states, in the backbone's dtype. The head is read at the three special tokens, in the order they occur in the
prompt (VQ, MQ, TA): with ``output_dim = 1`` (the released checkpoint) the three values are the head's outputs there;
with ``output_dim = 3`` the diagonal (token k's output k). ``output_dim`` is read from the checkpoint.

Checkpoint layout (the folder ``KlingTeam/VideoReward``): ``model_config.json`` (the training run's ``data_config``,
``model_config``, ``peft_lora_config`` and ``inference_config``) and ``checkpoint-<step>/model.pth``, the state dict of
the PEFT-wrapped model in the transformers 4.45 layout (``base_model.model.model.layers.*`` with LoRA
``base_layer`` / ``lora_A.default`` / ``lora_B.default`` on every language-model linear layer,
``base_model.model.visual.*``, ``base_model.model.rm_head.weight``, ``base_model.model.lm_head.weight``). The latest
step is used unless ``checkpoint_step`` names one. `convert_videoalign_state_dict` merges each LoRA into its weight,
``W + (lora_alpha / r) B A`` (``lora_alpha / sqrt(r)`` with rsLoRA), and maps the keys to transformers 5
(``model.*`` -> ``model.language_model.*``, ``visual.*`` -> ``model.visual.*``; the LM head is not loaded). The base
model (``model_config.model_name_or_path``, ``Qwen/Qwen2-VL-2B-Instruct``) gives the config, the tokenizer (plus the
three tokens, as the official code adds them) and the image-processor settings.

Frames, as the official ``VideoVLMRewardInference.reward`` reads an MP4 (its ``vision_process.py`` with decord):

1. ``through_mp4=True`` (default): the frames are written to an H.264 MP4 at ``fps`` frames per second and decoded
   again (`flowgrpo.rewards.video_io`), so the model sees the compression artefacts it sees in DanceGRPO and UniRL,
   which write their videos at 8 fps; the container's frame rate is ``fps``. ``through_mp4=False`` skips the round
   trip (the frames as generated, still at ``fps``).
2. ``n = round_2(clamp(total / fps * sample_fps, 4, floor_2(min(768, total))))`` frames (``sample_fps`` =
   ``data_config.fps``, 2.0; ``round_2`` rounds to a multiple of 2, Python's half-to-even rounding included; at most
   ``total``), or ``round_2(num_frames)`` when ``num_frames`` is given (``data_config.num_frames``); taken at
   ``torch.linspace(0, total - 1, n).round()`` (float32, half to even). The container fps changes n: 33 frames give 8
   frames at 8 fps but 4 at 16 fps.
3. each frame resized to qwen-vl-utils' ``smart_resize`` size (multiples of 28, area within ``[min_pixels,
   max_pixels]`` = ``[128 * 28 * 28, data_config.max_frame_pixels]``) by torchvision's tensor resize: bicubic with
   antialias in float32, clamped to [0, 255], rounded to uint8 (reproduced with ``torch.nn.functional.interpolate``,
   equal to torchvision's output bit for bit);
4. Qwen2-VL's image processor as transformers 4.45 applies it to videos: a second ``smart_resize`` with the
   processor's own bounds (a no-op for sizes already inside them; otherwise PIL bicubic on uint8), ``x / 255``,
   mean/std normalisation in float32, 14-pixel patches of 2 frames merged 2 x 2 (`video_patches`).

Prompt: `VIDEOALIGN_PROMPT` (the official ``DETAILED_PROMPT_WITH_SPECIAL_TOKEN``, byte for byte, trailing spaces
included) after the video in one user turn, rendered by the base model's chat template with the generation prompt;
``<|video_pad|>`` expands to one token per merged patch; rows padded on the right.

Positions: the official forward embeds the tokens, scatters the video features into the ``<|video_pad|>`` positions
and calls the Qwen2-VL decoder with ``position_ids=None`` and no ``rope_deltas``. Transformers 4.45's
``Qwen2VLModel.forward`` then uses ``cache_position`` expanded to the three multimodal-RoPE axes: a plain 1-D range
0..L-1 on all three, video tokens included (not Qwen2-VL's 3-D video positions). `VideoAlignModel` passes that range.

Score: ``(raw - mean) / std`` per dimension with ``use_norm`` (the checkpoint's ``inference_config``: VQ 3.6757 /
2.2476, MQ 1.1646 / 1.3811, TA 2.8105 / 2.5121), raw otherwise; ``Overall = VQ + MQ + TA``. The reward is the sum of
the chosen ``dimensions`` (default ``["Overall"]``); every dimension is also returned as a metric
(``rewards/videoalign/VQ`` ...). ``accepts_video = True``: each sample is a list of frames. Memory: Qwen2-VL-2B,
about 4.4 GB in bfloat16; a 33-frame 480x832 video at 8 fps is 8 frames of 336x588, 1008 video tokens.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .composition import RewardOutput
from .hpsv3 import smart_resize
from .qwen2vl_checkpoints import convert_qwen2vl_keys, load_exact_state
from .registry import register_reward
from .vlm_models import VLMReward, cached_vlm, load_vlm_processor

__all__ = [
    "DEFAULT_VIDEOALIGN_MODEL",
    "VIDEOALIGN_DIMENSIONS",
    "VIDEOALIGN_NORMALISATION",
    "VIDEOALIGN_PROMPT",
    "VIDEOALIGN_REWARD_TOKENS",
    "VideoAlignConfig",
    "VideoAlignReward",
    "build_videoalign_model",
    "convert_videoalign_state_dict",
    "resize_frames",
    "sample_frame_indices",
    "smart_nframes",
    "video_patches",
    "videoalign_prompt",
]

DEFAULT_VIDEOALIGN_MODEL = "KlingTeam/VideoReward"
MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_FILE = "model.pth"
VIDEOALIGN_REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
VIDEOALIGN_DIMENSIONS = ("VQ", "MQ", "TA", "Overall")
#: The published normalisation (mean, std) of each dimension, as the released ``inference_config`` holds it.
VIDEOALIGN_NORMALISATION = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}

# qwen-vl-utils' video constants as VideoAlign's vision_process.py has them
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
IMAGE_FACTOR = 28

VIDEOALIGN_PROMPT = (
    "\n"
    "You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion "
    "Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being "
    "the worst and 10 being the best. Each evaluation should be independent of the others.\n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions "
    "should be considered:\n"
    "- **Reasonableness:** The video should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements "
    "(e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of "
    "harmony and balance.\n"
    "- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or "
    "adult material. If such content is present, the image quality and satisfaction score should be the lowest "
    "possible. \n"
    "\n"
    "Please provide the ratings of Visual Quality: <|VQ_reward|>\n"
    "END\n"
    "\n"
    "**Motion Quality:**  \n"
    "Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following "
    "sub-dimensions:\n"
    "- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural "
    "jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body "
    "parts).\n"
    "- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should "
    "flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth "
    "movements).\n"
    "- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or "
    "camera angles should be seamless, and the overall dynamic feel should be visually pleasing.\n"
    "- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with "
    "the background, without obvious artifacts or the feeling of cut-and-paste effects.\n"
    "- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the "
    "video might have blurry or unsteady sections that hinder visual continuity.\n"
    "- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.\n"
    "\n"
    "Please provide the ratings of Motion Quality: <|MQ_reward|>\n"
    "END\n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the video matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align "
    "with the textual description. The subject should match the description in terms of number, appearance, and "
    "behavior.\n"
    "- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like "
    "talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, "
    "scale, and direction.\n"
    "- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if "
    "real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  \n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the "
    "video adheres to this style.\n"
    "- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are "
    "consistent with the expected behavior from the prompt.\n"
    "\n"
    "Textual prompt - {text_prompt}\n"
    "Please provide the ratings of Text Alignment: <|TA_reward|>\n"
    "END\n"
)


def videoalign_prompt(prompt: str) -> str:
    """The text VideoReward scores a video against: `VIDEOALIGN_PROMPT` with the generation prompt."""
    return VIDEOALIGN_PROMPT.format(text_prompt=prompt)


# --------------------------------------------------------------------------------------------------------------------
# frames
# --------------------------------------------------------------------------------------------------------------------


def _round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


def smart_nframes(total_frames: int, video_fps: float, sample_fps: float = 2.0, num_frames: int | None = None) -> int:
    """How many frames the official sampler takes from a video of ``total_frames`` at ``video_fps``.

    With ``num_frames``: ``round_2(num_frames)``; otherwise ``round_2(min(max(total / video_fps * sample_fps, 4),
    floor_2(min(768, total))))``; capped at ``total``.

    Raises:
        ValueError: fewer than 2 frames would be taken (the official code refuses those videos too).
    """
    if num_frames is not None:
        n = _round_by(num_frames, FRAME_FACTOR)
    else:
        min_frames = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        max_frames = math.floor(min(FPS_MAX_FRAMES, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
        n = total_frames / video_fps * sample_fps
        n = _round_by(min(max(n, min_frames), max_frames), FRAME_FACTOR)
    n = min(n, total_frames)
    if not FRAME_FACTOR <= n <= total_frames:
        raise ValueError(f"VideoReward samples {n} frames from a video of {total_frames}; it needs at least "
                         f"{FRAME_FACTOR} (generate videos of 2 frames or more)")
    return int(n)


def sample_frame_indices(total_frames: int, video_fps: float, sample_fps: float = 2.0,
                         num_frames: int | None = None) -> list[int]:
    """The official frame indices: ``torch.linspace(0, total - 1, n).round()`` with n = `smart_nframes`."""
    import torch

    n = smart_nframes(total_frames, video_fps, sample_fps, num_frames)
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def resize_frames(frames: Any, height: int, width: int) -> Any:
    """torchvision's ``resize(frames, [height, width], BICUBIC, antialias=True)`` of a ``(T, C, H, W)`` uint8 tensor:
    bicubic interpolation with antialias in float32, clamped to [0, 255], rounded, as uint8."""
    import torch

    out = torch.nn.functional.interpolate(frames.float(), size=(height, width), mode="bicubic", align_corners=False,
                                          antialias=True)
    return out.clamp(0, 255).round().to(torch.uint8)


def _processor_pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a Qwen2-VL image processor (its ``size`` or its older attributes)."""
    size = getattr(image_processor, "size", None)
    if isinstance(size, Mapping):
        low, high = size.get("shortest_edge"), size.get("longest_edge")
    else:  # transformers 5's SizeDict
        low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    if low is not None and high is not None:
        return int(low), int(high)
    low, high = getattr(image_processor, "min_pixels", None), getattr(image_processor, "max_pixels", None)
    if low is None or high is None:
        raise ValueError(f"{type(image_processor).__name__} has no pixel bounds (size['shortest_edge'/'longest_edge'] "
                         f"or min_pixels/max_pixels); give a Qwen2-VL base model")
    return int(low), int(high)


def video_patches(frames: Any, image_processor: Any) -> tuple[Any, list[int]]:
    """Qwen2-VL's video input of ``(T, C, H, W)`` uint8 frames: ``(pixel_values_videos, [t, h, w])``.

    As transformers 4.45's ``Qwen2VLImageProcessor`` processes a video: each frame resized to ``smart_resize(H, W,
    patch * merge, min_pixels, max_pixels)`` of the processor (PIL bicubic on uint8; nothing changes when the size is
    already that), ``x / 255`` then ``(x - mean) / std`` in float32, and the patches of ``temporal_patch_size`` frames
    by ``patch_size`` pixels laid out merge-window by merge-window: rows of ``C * temporal * patch * patch`` values.
    """
    import numpy as np
    import torch
    from PIL import Image

    patch = int(image_processor.patch_size)
    merge = int(image_processor.merge_size)
    temporal = int(image_processor.temporal_patch_size)
    low, high = _processor_pixel_bounds(image_processor)
    count, channels, height, width = frames.shape
    new_h, new_w = smart_resize(height, width, patch * merge, low, high)
    if (new_h, new_w) != (height, width):
        resized = [np.asarray(Image.fromarray(f.permute(1, 2, 0).numpy()).resize((new_w, new_h),
                                                                                  Image.Resampling.BICUBIC))
                   for f in frames]
        frames = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2)
    if count % temporal:
        frames = torch.cat([frames, frames[-1:].expand(temporal - count % temporal, -1, -1, -1)])
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(image_processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)
    pixels = (frames.double() * (1 / 255)).float()
    pixels = (pixels - mean) / std
    grid_t, grid_h, grid_w = pixels.shape[0] // temporal, new_h // patch, new_w // patch
    pixels = pixels.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    pixels = pixels.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return pixels.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch), [grid_t, grid_h, grid_w]


# --------------------------------------------------------------------------------------------------------------------
# checkpoint
# --------------------------------------------------------------------------------------------------------------------


class VideoAlignConfig:
    """What the reward reads from a checkpoint's ``model_config.json`` (the official ``load_configs_from_json``).

    Raises:
        ValueError: settings this loader does not reproduce (another prompt template or frame sampler, a reward read
            somewhere else than at the special tokens), named with the value found.
    """

    def __init__(self, payload: Mapping[str, Any], source: str = MODEL_CONFIG_FILE):
        data, model = payload.get("data_config") or {}, payload.get("model_config") or {}
        peft, inference = payload.get("peft_lora_config") or {}, payload.get("inference_config")
        self.sample_fps = float(data.get("fps", 2.0) if data.get("fps") is not None else 2.0)
        self.num_frames = None if data.get("num_frames") is None else int(data["num_frames"])
        self.max_frame_pixels = int(data.get("max_frame_pixels", 240 * 320))
        template = data.get("prompt_template_type", "none")
        if template != "detailed_special":
            raise ValueError(f"{source}: prompt_template_type {template!r} is not supported; the released VideoReward "
                             f"uses 'detailed_special' (the special-token template)")
        sample_type = data.get("sample_type", "uniform")
        if sample_type != "uniform":
            raise ValueError(f"{source}: sample_type {sample_type!r} is not supported; only 'uniform' (the released "
                             f"checkpoint's) is")
        if not model.get("use_special_tokens") or model.get("reward_token", "special") not in ("special", "last"):
            raise ValueError(f"{source}: the reward must be read at the special tokens (use_special_tokens: true), got "
                             f"use_special_tokens={model.get('use_special_tokens')!r}")
        self.output_dim = int(model.get("output_dim", 1))
        if self.output_dim not in (1, 3):
            raise ValueError(f"{source}: output_dim {self.output_dim} is not supported (1: one value per special "
                             f"token, as released; 3: the diagonal)")
        self.base_model = model.get("model_name_or_path")
        self.lora = bool(peft.get("lora_enable", False))
        self.lora_r = int(peft.get("lora_r", 16))
        self.lora_alpha = float(peft.get("lora_alpha", 32))
        self.use_rslora = bool(peft.get("use_rslora", False))
        self.normalisation: dict[str, tuple[float, float]] | None = None
        if inference is not None:
            self.normalisation = {dim: (float(inference[f"{dim}_mean"]), float(inference[f"{dim}_std"]))
                                  for dim in ("VQ", "MQ", "TA")}

    @property
    def lora_scale(self) -> float:
        """``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), PEFT's scaling."""
        return self.lora_alpha / (math.sqrt(self.lora_r) if self.use_rslora else self.lora_r)

    @classmethod
    def from_folder(cls, folder: Path) -> VideoAlignConfig:
        path = folder / MODEL_CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {MODEL_CONFIG_FILE}: give the VideoReward folder (hub id "
                                    f"{DEFAULT_VIDEOALIGN_MODEL!r} or a local copy holding {MODEL_CONFIG_FILE} and "
                                    f"checkpoint-*/{CHECKPOINT_FILE})")
        return cls(json.loads(path.read_text(encoding="utf-8")), str(path))


def _checkpoint_dirs(folder: Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders, latest step first (the official order)."""
    found = [Path(p) for p in glob.glob(os.path.join(folder, "checkpoint-*")) if re.fullmatch(r"checkpoint-\d+",
                                                                                              Path(p).name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


def resolve_videoalign_folder(name_or_path: str, checkpoint_step: int | None = None) -> tuple[Path, Path]:
    """``(folder, checkpoint file)``: a local VideoReward folder, or its files from the hub (the config and one
    ``checkpoint-<step>/model.pth``; the latest step unless ``checkpoint_step``)."""
    local = Path(name_or_path).expanduser()
    if not local.is_dir():
        if str(name_or_path).count("/") != 1 or local.is_absolute():
            raise FileNotFoundError(f"VideoReward checkpoint {name_or_path!r} not found: give a local folder holding "
                                    f"{MODEL_CONFIG_FILE} and checkpoint-*/{CHECKPOINT_FILE}, or a hub id such as "
                                    f"{DEFAULT_VIDEOALIGN_MODEL!r}")
        from huggingface_hub import snapshot_download

        pattern = f"checkpoint-{checkpoint_step}/*" if checkpoint_step is not None else "checkpoint-*/*"
        local = Path(snapshot_download(str(name_or_path), allow_patterns=[MODEL_CONFIG_FILE, pattern]))
    candidates = _checkpoint_dirs(local)
    if not candidates:
        raise FileNotFoundError(f"{local} has no checkpoint-<step> folder (the VideoReward layout is "
                                f"checkpoint-<step>/{CHECKPOINT_FILE} beside {MODEL_CONFIG_FILE})")
    chosen = candidates[0]
    if checkpoint_step is not None:
        named = local / f"checkpoint-{int(checkpoint_step)}"
        if named not in candidates:
            raise FileNotFoundError(f"{local} has no checkpoint-{checkpoint_step}; it has "
                                    f"{[p.name for p in candidates]}")
        chosen = named
    file = chosen / CHECKPOINT_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{chosen} has no {CHECKPOINT_FILE}; only full-model checkpoints (the released "
                                f"layout) load here, not adapter_model.safetensors + non_lora_state_dict.pth")
    return local, file


def convert_videoalign_state_dict(state: Mapping[str, Any], lora_scale: float) -> dict[str, Any]:
    """VideoReward's ``model.pth`` (the PEFT-wrapped model's state dict, transformers 4.45 layout) as the plain
    weights of `VideoAlignModel`.

    The ``base_model.model.`` prefix is dropped; each LoRA-wrapped linear layer becomes one weight
    ``W + lora_scale * B @ A`` (computed in float32, stored in W's dtype) and its ``base_layer`` bias; a
    ``modules_to_save`` copy replaces its ``original_module``; ``model.*`` -> ``model.language_model.*``, ``visual.*``
    -> ``model.visual.*``; ``rm_head.weight`` kept; ``lm_head.weight`` dropped. Keys already in the current layout load
    as they are.

    Raises:
        ValueError: a key of neither layout, or a LoRA factor without its pair or base weight.
    """
    import torch

    plain: dict[str, Any] = {}
    lora: dict[str, dict[str, Any]] = {}
    saved: dict[str, Any] = {}
    for key, value in state.items():
        key = key.removeprefix("base_model.model.")
        match = re.fullmatch(r"(.+)\.lora_([AB])\.[^.]+\.weight", key)
        if match:
            lora.setdefault(match.group(1), {})[match.group(2)] = value
            continue
        if ".lora_" in key:
            raise ValueError(f"LoRA weight {key!r} is not a lora_A / lora_B matrix of a linear layer; this loader "
                             f"merges linear LoRA only")
        match = re.fullmatch(r"(.+)\.modules_to_save\.[^.]+\.(.+)", key)
        if match:
            saved[f"{match.group(1)}.{match.group(2)}"] = value
            continue
        if ".original_module." in key:
            continue
        plain[key.replace(".base_layer.", ".")] = value
    plain.update(saved)
    for module, factors in lora.items():
        weight_key = f"{module}.weight"
        if set(factors) != {"A", "B"} or weight_key not in plain:
            raise ValueError(f"LoRA of {module!r} is incomplete: factors {sorted(factors)}, base weight "
                             f"{'present' if weight_key in plain else 'missing'}")
        base = plain[weight_key]
        delta = factors["B"].float() @ factors["A"].float()
        plain[weight_key] = (base.float() + lora_scale * delta).to(base.dtype)
    converted = convert_qwen2vl_keys(plain, ("rm_head.",), checkpoint="a VideoReward",
                                     expected="model.*, visual.*, rm_head.* and lm_head.weight, optionally under "
                                              "base_model.model.")
    return {key: value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            for key, value in converted.items()}


def build_videoalign_model(config: Any, reward_token_ids: Sequence[int], output_dim: int = 1) -> Any:
    """A new `VideoAlignModel` (random weights): Qwen2-VL's ``Qwen2VLModel`` for ``config`` plus ``rm_head``."""
    import torch
    from torch import nn
    from transformers import Qwen2VLModel

    class VideoAlignModel(nn.Module):
        """Qwen2-VL backbone (no LM head) + ``rm_head``; ``forward`` gives ``(batch, 3)``: VQ, MQ, TA raw."""

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.reward_token_ids = [int(t) for t in reward_token_ids]
            self.output_dim = int(output_dim)
            self.model = Qwen2VLModel(config)
            self.rm_head = nn.Linear(config.text_config.hidden_size, self.output_dim, bias=False)

        def forward(self, input_ids: Any, attention_mask: Any, pixel_values_videos: Any, video_grid_thw: Any,
                    **unused: Any) -> Any:
            """The head at the three special tokens, in their order in each row (see the module docstring)."""
            embeds = self.model.get_input_embeddings()(input_ids)
            features = self.model.get_video_features(pixel_values_videos, video_grid_thw).pooler_output
            features = torch.cat(list(features)).to(embeds.device, embeds.dtype)
            video_mask = (input_ids == self.config.video_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(video_mask, features)
            batch, length = input_ids.shape
            # As the official forward under transformers 4.45: no position ids, so 0..L-1 on every RoPE axis.
            positions = torch.arange(length, device=embeds.device).view(1, 1, -1).expand(3, batch, -1)
            hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                               position_ids=positions, use_cache=False).last_hidden_state
            is_reward = torch.zeros_like(input_ids, dtype=torch.bool)
            for token in self.reward_token_ids:
                is_reward |= input_ids == token
            counts = is_reward.sum(-1)
            if not bool((counts == 3).all()):
                raise ValueError(f"each row needs the three reward tokens {VIDEOALIGN_REWARD_TOKENS} once, found "
                                 f"{counts.tolist()} (does a prompt contain one of them?)")
            values = self.rm_head(hidden[is_reward]).view(batch, 3, -1)
            if self.output_dim == 3:
                values = values.diagonal(dim1=1, dim2=2)
            return values.reshape(batch, 3)

    return VideoAlignModel()


def load_videoalign(folder: Path, checkpoint: Path, settings: VideoAlignConfig, base_model_name_or_path: str,
                    device: Any, dtype: Any) -> tuple[Any, Any]:
    """``(VideoAlignModel, processor)``: the base model's config and processor plus the three reward tokens, the
    checkpoint converted and loaded strictly, in ``dtype`` on ``device``, eval mode."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    processor = load_vlm_processor(base_model_name_or_path)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(VIDEOALIGN_REWARD_TOKENS)})
    token_ids = processor.tokenizer.convert_tokens_to_ids(list(VIDEOALIGN_REWARD_TOKENS))
    raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = convert_videoalign_state_dict(raw, settings.lora_scale)
    embed_key = "model.language_model.embed_tokens.weight"
    if embed_key not in state:
        raise ValueError(f"{checkpoint}: no token embedding ({embed_key}) in the VideoReward checkpoint")
    rows = int(state[embed_key].shape[0])
    if max(token_ids) >= rows:
        raise ValueError(f"the reward tokens get ids {token_ids} from {base_model_name_or_path!r}'s tokenizer but the "
                         f"checkpoint's embedding has {rows} rows: use the base model VideoReward was trained from "
                         f"({settings.base_model or 'Qwen/Qwen2-VL-2B-Instruct'})")
    config = AutoConfig.from_pretrained(base_model_name_or_path)
    config.text_config.vocab_size = rows
    head_rows = int(state["rm_head.weight"].shape[0]) if "rm_head.weight" in state else settings.output_dim
    if head_rows != settings.output_dim:
        raise ValueError(f"{checkpoint}: rm_head has {head_rows} outputs but {MODEL_CONFIG_FILE} says output_dim "
                         f"{settings.output_dim}")
    with init_empty_weights(include_buffers=False):
        model = build_videoalign_model(config, token_ids, settings.output_dim)
    load_exact_state(model, state, checkpoint=f"{checkpoint}: the VideoReward checkpoint",
                     base_model=base_model_name_or_path)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, processor


# --------------------------------------------------------------------------------------------------------------------
# the reward
# --------------------------------------------------------------------------------------------------------------------


def _check_dimensions(dimensions: Any) -> tuple[str, ...]:
    chosen = (dimensions,) if isinstance(dimensions, str) else tuple(dimensions)
    bad = [d for d in chosen if d not in VIDEOALIGN_DIMENSIONS]
    if not chosen or bad:
        raise ValueError(f"dimensions must be some of {list(VIDEOALIGN_DIMENSIONS)}, got {list(chosen)}")
    if len(set(chosen)) != len(chosen) or ("Overall" in chosen and len(chosen) > 1):
        raise ValueError(f"dimensions {list(chosen)} count a dimension twice ('Overall' is VQ + MQ + TA): give each "
                         f"once, and 'Overall' alone")
    return chosen


@register_reward("videoalign")
class VideoAlignReward(VLMReward):
    """VideoReward's VQ / MQ / TA of each (prompt, video) (see the module docstring).

    Args:
        dimensions: which of ``VQ``, ``MQ``, ``TA``, ``Overall`` the reward sums (default ``["Overall"]``; a single
            name works too).
        use_norm: normalise each dimension with the checkpoint's published mean and std (the official default).
        fps: the frame rate of the video container the official path reads (default 8, as DanceGRPO and UniRL write
            their videos); it decides how many frames are sampled.
        through_mp4: encode the frames to an H.264 MP4 and decode them, as the official path reads a file (default
            true; needs PyAV: ``pip install 'flowgrpo[video]'``).
        num_frames: sample this many frames instead of by frame rate (default: the checkpoint's ``num_frames``).
        max_pixels: the frame area bound (default: the checkpoint's ``max_frame_pixels``); ``min_pixels`` the lower
            one (qwen-vl-utils' 128 * 28 * 28).
        model_name_or_path: the VideoReward folder (hub id ``KlingTeam/VideoReward`` or a local copy).
        base_model_name_or_path: the Qwen2-VL it was trained from (default: the checkpoint's ``model_name_or_path``).
        checkpoint_step: which ``checkpoint-<step>`` to load (default the latest).
        device (alias ``reward_device``), dtype (default bfloat16 on CUDA, float32 on CPU), batch_size: placement.
    """

    accepts_video = True

    def __init__(
        self,
        dimensions: str | Sequence[str] = ("Overall",),
        use_norm: bool = True,
        fps: float = 8.0,
        through_mp4: bool = True,
        num_frames: int | None = None,
        max_pixels: int | None = None,
        min_pixels: int = VIDEO_MIN_PIXELS,
        model_name_or_path: str = DEFAULT_VIDEOALIGN_MODEL,
        base_model_name_or_path: str | None = None,
        checkpoint_step: int | None = None,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 2,
        reward_device: str | None = None,
    ):
        self.dimensions = _check_dimensions(dimensions)
        if not float(fps) > 0:
            raise ValueError(f"fps must be positive (the video container's frame rate), got {fps}")
        if num_frames is not None and int(num_frames) < FRAME_FACTOR:
            raise ValueError(f"num_frames must be at least {FRAME_FACTOR}, got {num_frames}")
        if max_pixels is not None and int(max_pixels) < IMAGE_FACTOR * IMAGE_FACTOR:
            raise ValueError(f"max_pixels must be at least {IMAGE_FACTOR * IMAGE_FACTOR}, got {max_pixels}")
        if int(min_pixels) < 1:
            raise ValueError(f"min_pixels must be positive, got {min_pixels}")
        if through_mp4:
            from .video_io import require_av

            require_av()
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.use_norm = bool(use_norm)
        self.fps = float(fps)
        self.through_mp4 = bool(through_mp4)
        self.num_frames = None if num_frames is None else int(num_frames)
        self.max_pixels = None if max_pixels is None else int(max_pixels)
        self.min_pixels = int(min_pixels)
        self.model_name_or_path = str(model_name_or_path)
        self.base_model_name_or_path = base_model_name_or_path
        self.checkpoint_step = checkpoint_step
        self.__name__ = "videoalign"
        self._settings: VideoAlignConfig | None = None

    def __repr__(self) -> str:
        return (f"VideoAlignReward(dimensions={list(self.dimensions)}, fps={self.fps}, through_mp4={self.through_mp4}, "
                f"model={self.model_name_or_path!r})")

    # ---- loading ------------------------------------------------------------------------------------------------

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        folder, checkpoint = resolve_videoalign_folder(self.model_name_or_path, self.checkpoint_step)
        settings = VideoAlignConfig.from_folder(folder)
        base = self.base_model_name_or_path or settings.base_model
        if not base:
            raise ValueError(f"{folder / MODEL_CONFIG_FILE} names no base model (model_config.model_name_or_path); "
                             f"pass base_model_name_or_path='Qwen/Qwen2-VL-2B-Instruct'")
        self._settings = settings
        key = ("videoalign", str(checkpoint), str(base), str(device), str(dtype))
        return cached_vlm(key, lambda: load_videoalign(folder, checkpoint, settings, str(base), device, dtype))

    @property
    def settings(self) -> VideoAlignConfig:
        """The checkpoint's ``model_config.json`` settings (loads the model first)."""
        self.load()
        assert self._settings is not None
        return self._settings

    # ---- inputs -------------------------------------------------------------------------------------------------

    def read_video(self, frames: Sequence[Any]) -> tuple[Any, float]:
        """``((T, H, W, 3) uint8 array, container fps)`` of one video: through the MP4 round trip or as given."""
        from .video_io import as_uint8_frames, decode_mp4, encode_mp4

        if self.through_mp4:
            return decode_mp4(encode_mp4(frames, self.fps))
        return as_uint8_frames(frames), self.fps

    def sample_video(self, video: Any, video_fps: float) -> Any:
        """The official frame sampling and resize of one decoded video: ``(n, 3, h, w)`` uint8."""
        import torch

        settings = self.settings
        num_frames = self.num_frames if self.num_frames is not None else settings.num_frames
        indices = sample_frame_indices(len(video), video_fps, settings.sample_fps, num_frames)
        frames = torch.from_numpy(video[indices]).permute(0, 3, 1, 2)
        max_pixels = self.max_pixels if self.max_pixels is not None else settings.max_frame_pixels
        height, width = smart_resize(frames.shape[2], frames.shape[3], IMAGE_FACTOR, self.min_pixels, max_pixels)
        return resize_frames(frames, height, width)

    def inputs(self, prompts: Sequence[str], frames: Sequence[Any]) -> dict[str, Any]:
        """The model inputs of one batch of sampled ``(n, 3, h, w)`` uint8 videos, right-padded as the official code
        pads them."""
        import torch

        model, processor = self.load()
        video_token = "<|video_pad|>"
        merge = int(processor.image_processor.merge_size)
        texts, pixel_values, grids = [], [], []
        template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the base model's processor has no chat template; give a Qwen2-VL base model folder "
                             "with one")
        for prompt, video in zip(prompts, frames):
            patches, grid = video_patches(video, processor.image_processor)
            messages = [{"role": "user", "content": [{"type": "video"},
                                                     {"type": "text", "text": videoalign_prompt(prompt)}]}]
            text = processor.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
            if text.count(video_token) != 1:
                raise ValueError(f"the chat template rendered {text.count(video_token)} {video_token} tokens for one "
                                 f"video; give a Qwen2-VL base model")
            tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            texts.append(text.replace(video_token, video_token * tokens))
            pixel_values.append(patches)
            grids.append(grid)
        batch = processor.tokenizer(texts, padding=True, padding_side="right", return_tensors="pt")
        device = model.model.device
        return {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device),
                "pixel_values_videos": torch.cat(pixel_values).to(device),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long, device=device)}

    # ---- scoring ------------------------------------------------------------------------------------------------

    def dimension_scores(self, prompts: Sequence[str], videos: Sequence[Sequence[Any]]) -> list[dict[str, float]]:
        """``{"VQ", "MQ", "TA", "Overall"}`` per video (a list of frames), normalised when ``use_norm`` (as the
        official ``reward``)."""
        return self._scores(prompts, [self.read_video(frames) for frames in videos])

    def dimension_scores_of_mp4(self, prompts: Sequence[str], files: Sequence[bytes | str | os.PathLike]
                                ) -> list[dict[str, float]]:
        """The same for MP4 files (paths or bytes) read as the official code reads them, at their own frame rate
        (``fps`` and ``through_mp4`` play no part)."""
        from .video_io import decode_mp4

        decoded = [decode_mp4(f if isinstance(f, bytes) else Path(f).read_bytes()) for f in files]
        return self._scores(prompts, decoded)

    def _scores(self, prompts: Sequence[str], decoded: Sequence[tuple[Any, float]]) -> list[dict[str, float]]:
        import torch

        if len(prompts) != len(decoded):
            raise ValueError(f"videoalign got {len(prompts)} prompts and {len(decoded)} videos")
        with self._lock, torch.inference_mode():
            model, _ = self.load()
            sampled = [self.sample_video(video, video_fps) for video, video_fps in decoded]
            raw = [model(**self.inputs(prompts[sl], sampled[sl])).float().cpu() for sl in self.chunks(len(prompts))]
        values = torch.cat(raw).tolist() if raw else []
        norm = self.settings.normalisation if self.use_norm else None
        out = []
        for vq, mq, ta in values:
            scores = {"VQ": vq, "MQ": mq, "TA": ta}
            if norm is not None:
                scores = {dim: (value - norm[dim][0]) / norm[dim][1] for dim, value in scores.items()}
            scores["Overall"] = scores["VQ"] + scores["MQ"] + scores["TA"]
            out.append(scores)
        return out

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> RewardOutput:
        if len(prompts) != len(images):
            raise ValueError(f"videoalign got {len(prompts)} prompts and {len(images)} videos")
        videos = [list(v) if isinstance(v, (list, tuple)) else [v] for v in images]
        scores = self.dimension_scores(list(prompts), videos) if videos else []
        total = [math.fsum(s[d] for d in self.dimensions) for s in scores]
        return RewardOutput(total, metrics={dim: [s[dim] for s in scores] for dim in VIDEOALIGN_DIMENSIONS})
