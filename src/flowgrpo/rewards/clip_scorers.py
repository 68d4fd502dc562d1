"""CLIP-family scorers built on transformers' ``CLIPModel`` and ``CLIPProcessor``: ``aesthetic``,
``clipscore`` and ``pickscore``.

All three load their model lazily, on the first call, with ``from_pretrained(model_id)`` (a hub id or a
local folder written by ``save_pretrained``), run it in inference mode on CUDA when available (else CPU),
and score images in chunks of ``batch_size``. Loaded models are cached per process and shared between
scorers with the same model id, device and dtype (``aesthetic`` and ``clipscore`` on the same CLIP load it
once). Calls are serialised by a lock per scorer, so a scorer can be used from `RewardSet.submit`'s pool.

Let ``e_img = f_img / ||f_img||`` and ``e_txt = f_txt / ||f_txt||`` be the L2-normalised projected CLIP image
and text embeddings (``get_image_features`` / ``get_text_features``).

* ``aesthetic``: the LAION "improved aesthetic predictor": an MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1, with
  dropout layers at indices 1, 3, 5, as in its published ``sac+logos+ava1-l14-linearMSE.pth``) applied to
  ``e_img`` of CLIP ViT-L/14 (``openai/clip-vit-large-patch14``). Scores are on the AVA 1-10 scale (real
  images mostly 4-7). The MLP weights (``mlp_path``: a local ``.pth``/``.safetensors`` file, or
  ``"owner/repo/file.pth"`` on the hub) must be given; the prompts are ignored.
* ``clipscore``: ``scale * max(cos(e_img, e_txt), 0)`` with ``scale = 100`` by default (the torchmetrics
  convention, real image-caption pairs score ~20-35); ``scale=2.5`` gives CLIP-S of Hessel et al. (2021).
* ``pickscore``: ``logit_scale.exp() * cos(e_img, e_txt)``, PickScore's own scoring (its logit scale is ~100, so
  real images score ~18-24). ``divide_by`` rescales it (Flow-GRPO's reference divides by 26 to land near
  [0, 1]). Model ``yuvalkirstain/PickScore_v1`` with the processor of
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.

* ``pickscore_rank``: group-wise ranks of PickScore, ``k / n`` for the ``k``-th smallest of a group of ``n``
  (Flow-Factory's; robust to the reward's scale). See `PickScoreRank`.
* ``image_similarity``: ``cos(e_img(generated), e_img(source))`` against the row's source ``image`` (editing), CLIP
  ViT-L/14 with Flow-GRPO's preprocessing, no scale. See `ImageSimilarity`.

Text longer than the text encoder's context (77 tokens for CLIP) is truncated. Every scorer has ``to(device)`` and
``offload()`` (see `flowgrpo.rewards.placement`) for ``reward_offload``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .placement import pick_device, resolve_device, resolve_dtype
from .registry import register_reward

logger = logging.getLogger(__name__)

__all__ = ["AestheticScorer", "CLIPScore", "ImageSimilarity", "PickScore", "PickScoreRank", "build_aesthetic_mlp",
           "clip_pixels_from_tensor", "load_aesthetic_mlp", "reference_clip_pixels"]

DEFAULT_CLIP_L14 = "openai/clip-vit-large-patch14"
DEFAULT_PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

_MODELS: dict[tuple, tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()


def load_clip(model_id: str, processor_id: str | None, device: Any, dtype: Any) -> tuple[Any, Any]:
    """``(CLIPModel, CLIPProcessor)`` from ``from_pretrained``, in eval mode on ``device``; cached per process."""
    key = (str(model_id), str(processor_id or model_id), str(device), str(dtype))
    with _MODELS_LOCK:
        cached = _MODELS.get(key)
        if cached is not None:
            return cached
        import torch
        from transformers import CLIPModel, CLIPProcessor

        with torch.inference_mode(False):  # normal tensors even for a caller in inference mode: a differentiable
            model = CLIPModel.from_pretrained(model_id, dtype=dtype)  # call may use the shared model later
            model.to(device).eval().requires_grad_(False)
        processor = CLIPProcessor.from_pretrained(processor_id or model_id)
        _MODELS[key] = (model, processor)
        return model, processor


def model_features(output: Any) -> Any:
    """Projected embeddings from ``get_*model_features`` (a tensor, or an output object whose pooler is projected)."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if pooled is None:
        raise TypeError(f"unexpected CLIP feature output {type(output).__name__}")
    return pooled


def _as_pil(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    import numpy as np

    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    raise TypeError(f"CLIP scorers need PIL images (or HxWxC uint8 arrays), got {type(image).__name__}")


class _CLIPScorer:
    """Lazy CLIP model + processor, chunked normalised embeddings. Subclasses define ``_score``."""

    def __init__(
        self,
        model_id: str,
        processor_id: str | None = None,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: str | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_id = model_id
        self.processor_id = processor_id
        self.device_name = pick_device(device, reward_device)
        self.dtype_name = dtype
        self.batch_size = int(batch_size)
        self._lock = threading.Lock()
        self._model: Any = None
        self._processor: Any = None

    def load(self) -> tuple[Any, Any]:
        """Load (once) and return ``(model, processor)``."""
        if self._model is None:
            self._model, self._processor = load_clip(
                self.model_id, self.processor_id, resolve_device(self.device_name), resolve_dtype(self.dtype_name)
            )
        return self._model, self._processor

    @property
    def device(self) -> Any:
        return self.load()[0].device

    def to(self, device: Any = None) -> _CLIPScorer:
        """Move the CLIP weights to ``device`` (default: the scorer's device); see `flowgrpo.rewards.placement`.
        A model shared with another scorer (same model id, device and dtype) moves for both."""
        model, _ = self.load()
        model.to(resolve_device(device if device is not None else self.device_name))
        return self

    def offload(self) -> None:
        """Move the CLIP weights to the CPU (nothing to do before the first load)."""
        if self._model is not None:
            self._model.to("cpu")

    def image_embeddings(self, images: Sequence[Any]) -> Any:
        """L2-normalised projected image embeddings, float32, shape ``(n, projection_dim)``."""
        import torch

        model, processor = self.load()
        chunks = []
        for start in range(0, len(images), self.batch_size):
            batch = [_as_pil(im) for im in images[start:start + self.batch_size]]
            inputs = processor(images=batch, return_tensors="pt")
            pixel_values = inputs["pixel_values"].to(model.device, model.dtype)
            feats = model_features(model.get_image_features(pixel_values=pixel_values)).float()
            chunks.append(feats / feats.norm(dim=-1, keepdim=True))
        return torch.cat(chunks)

    def image_embeddings_from_tensor(self, images: Any) -> Any:
        """`image_embeddings` of float images ``(N, 3, H, W)`` in [0, 1], preprocessed in torch as the processor does
        (`clip_pixels_from_tensor`), with gradient; float32 on the model's device."""
        import torch

        model, processor = self.load()
        chunks = []
        for start in range(0, images.shape[0], self.batch_size):
            pixels = clip_pixels_from_tensor(images[start:start + self.batch_size], processor.image_processor)
            feats = model_features(model.get_image_features(pixel_values=pixels.to(model.device, model.dtype))).float()
            chunks.append(feats / feats.norm(dim=-1, keepdim=True))
        return torch.cat(chunks)

    def text_embeddings(self, texts: Sequence[str]) -> Any:
        """L2-normalised projected text embeddings, float32, shape ``(n, projection_dim)``."""
        import torch

        model, processor = self.load()
        max_length = model.config.text_config.max_position_embeddings
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            inputs = processor.tokenizer(
                list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                max_length=max_length, return_tensors="pt",
            )
            inputs = {k: v.to(model.device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            feats = model_features(model.get_text_features(**inputs)).float()
            chunks.append(feats / feats.norm(dim=-1, keepdim=True))
        return torch.cat(chunks)

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        from .differentiable import is_image_tensor

        if is_image_tensor(images):
            return self._call_with_grad(prompts, images)
        if len(prompts) != len(images):
            raise ValueError(f"{type(self).__name__} got {len(prompts)} prompts and {len(images)} images")
        if not images:
            return []
        import torch

        with self._lock:
            self._prepare()  # outside inference mode: the weights stay usable by a differentiable call
            with torch.inference_mode():
                scores = self._score(list(prompts), list(images))
        return [float(s) for s in scores.cpu().tolist()]

    def _call_with_grad(self, prompts: Sequence[str], images: Any) -> Any:
        """The differentiable call (`flowgrpo.rewards.differentiable`): float32 scores ``(N,)`` on the images'
        device, with their gradient; the text embeddings carry none."""
        from .differentiable import check_image_tensor, check_score_tensor

        name = type(self).__name__
        if not getattr(self, "differentiable", False):
            raise TypeError(f"reward {name!r} is not differentiable: it scores PIL images (a list), not a tensor")
        check_image_tensor(images, len(prompts), name)
        if not len(prompts):
            return images.new_zeros(0, dtype=images.dtype)
        with self._lock:
            self._prepare()
            scores = self._score_embeddings(list(prompts), self.image_embeddings_from_tensor(images))
        return check_score_tensor(scores, len(prompts), name).to(images.device)

    def _prepare(self) -> None:
        """Load every weight the scorer uses (before inference mode is entered)."""
        self.load()

    def _score(self, prompts: list[str], images: list[Any]) -> Any:
        return self._score_embeddings(prompts, self.image_embeddings(images))

    def _score_embeddings(self, prompts: list[str], image_embeddings: Any) -> Any:
        """The scores from the normalised image embeddings (the text ones are computed here, without gradient)."""
        raise NotImplementedError

    def _text(self, prompts: list[str]) -> Any:
        import torch

        with torch.no_grad():
            return self.text_embeddings(prompts)


# ---- aesthetic -------------------------------------------------------------------------------------


def build_aesthetic_mlp(input_dim: int = 768) -> Any:
    """A new LAION improved-aesthetic-predictor head: an ``nn.Module`` whose ``layers`` is the ``nn.Sequential``.

    Parameter names (``layers.0.weight`` ... ``layers.7.bias``) match the published checkpoint.
    """
    from torch import nn

    class _AestheticMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_dim = input_dim
            self.layers = nn.Sequential(
                nn.Linear(input_dim, 1024), nn.Dropout(0.2),
                nn.Linear(1024, 128), nn.Dropout(0.2),
                nn.Linear(128, 64), nn.Dropout(0.1),
                nn.Linear(64, 16),
                nn.Linear(16, 1),
            )

        def forward(self, embeddings: Any) -> Any:
            return self.layers(embeddings)

    return _AestheticMLP()


def _resolve_weights_file(path: str | Path) -> Path:
    local = Path(path).expanduser()
    if local.is_file():
        return local
    parts = str(path).split("/")
    if len(parts) >= 3 and not Path(path).is_absolute():
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id="/".join(parts[:2]), filename="/".join(parts[2:])))
    raise FileNotFoundError(
        f"aesthetic MLP weights {str(path)!r} not found: give a local .pth/.safetensors file or "
        f"'owner/repo/filename' on the hub"
    )


def load_aesthetic_mlp(path: str | Path) -> Any:
    """`build_aesthetic_mlp` with weights from a ``.pth`` (a plain state dict, loaded with ``weights_only=True``) or a
    ``.safetensors`` file; the input size is read from the weights. Keys may carry a ``module.`` prefix."""
    import torch

    file = _resolve_weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
    state = {k.removeprefix("module."): v for k, v in state.items()}
    if "layers.0.weight" not in state:
        raise ValueError(f"{file} is not an aesthetic-predictor state dict (no 'layers.0.weight'; keys: "
                         f"{sorted(state)[:8]})")
    mlp = build_aesthetic_mlp(int(state["layers.0.weight"].shape[1]))
    mlp.load_state_dict(state)
    return mlp.eval().requires_grad_(False)


@register_reward("aesthetic")
class AestheticScorer(_CLIPScorer):
    """LAION aesthetic score (1-10 scale) from CLIP ViT-L/14 image embeddings; prompts are ignored.

    Args:
        mlp_path: the MLP head's weights (``sac+logos+ava1-l14-linearMSE.pth`` from LAION's
            improved-aesthetic-predictor, or any state dict with the same keys): a local file or
            ``"owner/repo/filename"`` on the hub.
        model_id: the CLIP model (``CLIPModel.from_pretrained``); must match the MLP's training embeddings.
        processor_id: where the ``CLIPProcessor`` comes from (default: ``model_id``).
        device / reward_device, dtype, batch_size: placement and chunking of the CLIP forward passes.
    """

    differentiable = True

    def __init__(
        self,
        mlp_path: str | Path | None = None,
        model_id: str = DEFAULT_CLIP_L14,
        processor_id: str | None = None,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: str | None = None,
    ):
        if mlp_path is None:
            raise ValueError(
                "the 'aesthetic' reward needs the LAION aesthetic MLP weights: pass "
                "reward_kwargs={'aesthetic': {'mlp_path': '/path/to/sac+logos+ava1-l14-linearMSE.pth'}} "
                "(from github.com/christophschuhmann/improved-aesthetic-predictor) or an 'owner/repo/file' hub path"
            )
        super().__init__(model_id, processor_id, device, dtype, batch_size, reward_device)
        self.mlp_path = mlp_path
        self._mlp: Any = None

    def _prepare(self) -> None:
        import torch

        model, _ = self.load()
        with torch.inference_mode(False):
            if self._mlp is None:
                self._mlp = load_aesthetic_mlp(self.mlp_path)
            self._mlp.to(model.device)

    def _score_embeddings(self, prompts: list[str], image_embeddings: Any) -> Any:
        if self._mlp.input_dim != image_embeddings.shape[-1]:
            raise ValueError(f"aesthetic MLP expects {self._mlp.input_dim}-d embeddings but {self.model_id!r} gives "
                             f"{image_embeddings.shape[-1]}-d ones; use the CLIP model the MLP was trained on")
        return self._mlp(image_embeddings.to(self._mlp.layers[0].weight.device)).squeeze(-1)


# ---- clipscore -------------------------------------------------------------------------------------


@register_reward("clipscore")
class CLIPScore(_CLIPScorer):
    """``scale * max(cos(image, prompt), 0)`` with CLIP (see the module docstring).

    Args:
        model_id: the CLIP model (``CLIPModel.from_pretrained``).
        processor_id: where the ``CLIPProcessor`` comes from (default: ``model_id``).
        scale: 100 (default, torchmetrics' CLIPScore) or 2.5 (Hessel et al.'s CLIP-S).
        device / reward_device, dtype, batch_size: placement and chunking of the CLIP forward passes.
    """

    differentiable = True

    def __init__(
        self,
        model_id: str = DEFAULT_CLIP_L14,
        processor_id: str | None = None,
        scale: float = 100.0,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: str | None = None,
    ):
        super().__init__(model_id, processor_id, device, dtype, batch_size, reward_device)
        self.scale = float(scale)

    def _score_embeddings(self, prompts: list[str], image_embeddings: Any) -> Any:
        cos = (image_embeddings * self._text(prompts)).sum(-1)
        return self.scale * cos.clamp(min=0.0)


# ---- pickscore -------------------------------------------------------------------------------------


@register_reward("pickscore")
class PickScore(_CLIPScorer):
    """PickScore: ``logit_scale.exp() * cos(image, prompt) / divide_by`` (see the module docstring).

    Args:
        model_id: the PickScore model (default ``yuvalkirstain/PickScore_v1``).
        processor_id: its processor (default ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
        divide_by: divide the score by this (1 = PickScore's own scale; 26 = Flow-GRPO's reference).
        device / reward_device, dtype, batch_size: placement and chunking of the CLIP forward passes.
    """

    differentiable = True

    def __init__(
        self,
        model_id: str = DEFAULT_PICKSCORE_MODEL,
        processor_id: str | None = DEFAULT_PICKSCORE_PROCESSOR,
        divide_by: float = 1.0,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: str | None = None,
    ):
        if divide_by == 0:
            raise ValueError("divide_by must be non-zero")
        super().__init__(model_id, processor_id, device, dtype, batch_size, reward_device)
        self.divide_by = float(divide_by)

    def _score_embeddings(self, prompts: list[str], image_embeddings: Any) -> Any:
        model, _ = self.load()
        cos = (image_embeddings * self._text(prompts)).sum(-1)
        return model.logit_scale.detach().exp().float() * cos / self.divide_by


# ---- pickscore_rank --------------------------------------------------------------------------------


@register_reward("pickscore_rank")
class PickScoreRank(PickScore):
    """Group-wise PickScore ranks (Flow-Factory's ``pickscore_rank``): within each group of ``n`` samples (the
    images of one prompt), the sample whose PickScore is the ``k``-th smallest (``k = 0 .. n - 1``) gets ``k / n``,
    so rewards lie in ``[0, (n - 1) / n]`` whatever the scale of PickScore. Ties keep the samples' order (stable
    sort: the earlier sample ranks lower); unscored samples (``None``) stay ``None`` and the others are ranked among
    themselves, divided by the group's full size.

    A direct call ranks within the groups of the ``group_ids`` column (the whole batch is one group without it); in
    training, `flowgrpo.rewards.RewardSet.finish_groupwise` ranks over complete groups gathered from every process.

    Args: as `PickScore`.
    """

    groupwise = True
    differentiable = False  # a rank has no gradient

    def score_samples(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        """Raw PickScores, one per sample."""
        return PickScore.__call__(self, prompts, images)

    @staticmethod
    def combine_group(scores: Sequence[float | None]) -> list[float | None]:
        """One group's ranks ``k / n`` (see the class docstring)."""
        n = len(scores)
        valid = sorted((i for i, s in enumerate(scores) if s is not None), key=lambda i: scores[i])
        out: list[float | None] = [None] * n
        for rank, i in enumerate(valid):
            out[i] = rank / n
        return out

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        from .composition import GROUP_IDS_COLUMN, combine_in_groups

        return combine_in_groups(self, self.score_samples(prompts, images), columns.get(GROUP_IDS_COLUMN))


# ---- image_similarity ------------------------------------------------------------------------------


def reference_clip_pixels(image: Any, size: int, crop: int, mean: Sequence[float], std: Sequence[float]) -> Any:
    """Flow-GRPO's CLIP preprocessing of a ``[0, 1]`` float image tensor: torchvision's ``Resize(size)`` on a tensor
    (bilinear, antialiased; short side ``size``, long side ``int(size * long / short)``), ``CenterCrop(crop)``
    (offsets ``int(round((s - crop) / 2))``) and ``Normalize(mean, std)``; a float32 tensor ``(3, crop, crop)``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    pil = _as_pil(image)
    x = torch.from_numpy(np.asarray(pil, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    h, w = x.shape[1:]
    new_h, new_w = (int(size * h / w), size) if w <= h else (size, int(size * w / h))
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x[None], size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)[0]
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    x = x[:, top:top + crop, left:left + crop]
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def _size_field(value: Any, key: str) -> int:
    """``value[key]`` of an image processor's size (a dict, a ``SizeDict`` or a plain int)."""
    if isinstance(value, dict):
        return int(value[key])
    if getattr(value, key, None) is not None:
        return int(getattr(value, key))
    return int(value)


def _size_pair(value: Any) -> tuple[int, int] | None:
    """``(height, width)`` of a processor size with both keys, else None."""
    if isinstance(value, dict):
        h, w = value.get("height"), value.get("width")
    else:
        h, w = getattr(value, "height", None), getattr(value, "width", None)
    return (int(h), int(w)) if h is not None and w is not None else None


def clip_pixels_from_tensor(images: Any, image_processor: Any) -> Any:
    """A CLIP image processor's preprocessing (``CLIPImageProcessor``: resize, centre crop, normalise) of float images
    ``(N, 3, H, W)`` in [0, 1], in torch and differentiable: float32 ``(N, 3, crop_h, crop_w)``.

    The processor's settings are read from it: ``size`` (``shortest_edge``: the short side to it and the long side to
    ``int(size * long / short)``; or ``height`` and ``width``), its bicubic ``resample`` as PIL does it on 8-bit
    pixels (`flowgrpo.rewards.differentiable.resize_bicubic_like_pil`), ``crop_size`` with offsets ``(H - h) // 2``,
    ``image_mean`` / ``image_std``. On ``uint8 / 255`` images the pixels agree with the processor's within 1.1 / 255
    (its rounding to 8 bits).

    Raises:
        ValueError: a processor setting the tensor path does not reproduce (another resample filter, no rescaling).
    """
    from .differentiable import center_crop, normalize, resize_bicubic_like_pil, shortest_side_size

    pixels = images.float()
    if getattr(image_processor, "do_rescale", True) is False:
        raise ValueError(f"{type(image_processor).__name__} does not rescale pixels to [0, 1], which the differentiable "
                         f"path assumes; use a processor with do_rescale=True")
    if getattr(image_processor, "do_resize", True):
        resample = int(getattr(image_processor, "resample", 3))
        if resample != 3:  # PIL.Image.BICUBIC
            raise ValueError(f"the differentiable CLIP preprocessing resizes bicubic, as CLIP's processors do; "
                             f"{type(image_processor).__name__} has resample={resample}")
        pair = _size_pair(image_processor.size)
        if pair is None:
            pair = shortest_side_size(pixels.shape[-2], pixels.shape[-1], _size_field(image_processor.size,
                                                                                   "shortest_edge"))
        pixels = resize_bicubic_like_pil(pixels, *pair)
    if getattr(image_processor, "do_center_crop", False):
        crop = _size_pair(image_processor.crop_size)
        if crop is None:
            side = _size_field(image_processor.crop_size, "height")
            crop = (side, side)
        pixels = center_crop(pixels, *crop, offsets="floor")
    if getattr(image_processor, "do_normalize", True):
        pixels = normalize(pixels, image_processor.image_mean, image_processor.image_std)
    return pixels


@register_reward("image_similarity")
class ImageSimilarity(_CLIPScorer):
    """CLIP image-to-image cosine between each generated image and its row's source image (editing), as Flow-GRPO's
    ``image_similarity``: ``cos(e_img(generated), e_img(source))`` with L2-normalised projected CLIP ViT-L/14
    image embeddings, no scale (about 0.5-1 for edits of the same picture). Prompts are ignored.

    Args:
        model_id: the CLIP model (default ``openai/clip-vit-large-patch14``, the reference's).
        processor_id: where the ``CLIPProcessor`` (sizes, mean/std) comes from (default: ``model_id``).
        reference_column: the column of source images (default ``image``, the editing datasets' column).
        preprocessing: ``"reference"`` (default: Flow-GRPO's tensor pipeline, `reference_clip_pixels`, with the
            processor's sizes and mean/std) or ``"processor"`` (the ``CLIPProcessor`` itself: PIL bicubic).
        device / reward_device, dtype, batch_size: placement and chunking of the CLIP forward passes.
    """

    def __init__(
        self,
        model_id: str = DEFAULT_CLIP_L14,
        processor_id: str | None = None,
        reference_column: str = "image",
        preprocessing: str = "reference",
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: str | None = None,
    ):
        if preprocessing not in ("reference", "processor"):
            raise ValueError(f"preprocessing must be 'reference' or 'processor', got {preprocessing!r}")
        super().__init__(model_id, processor_id, device, dtype, batch_size, reward_device)
        self.reference_column = reference_column
        self.preprocessing = preprocessing

    def _pixel_embeddings(self, images: Sequence[Any]) -> Any:
        import torch

        if self.preprocessing == "processor":
            return self.image_embeddings(images)
        model, processor = self.load()
        ip = processor.image_processor
        size, crop = _size_field(ip.size, "shortest_edge"), _size_field(ip.crop_size, "height")
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels = torch.stack([reference_clip_pixels(im, int(size), int(crop), ip.image_mean, ip.image_std)
                                  for im in images[start:start + self.batch_size]])
            feats = model_features(model.get_image_features(pixel_values=pixels.to(model.device, model.dtype))).float()
            chunks.append(feats / feats.norm(dim=-1, keepdim=True))
        return torch.cat(chunks)

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        sources = columns.get(self.reference_column)
        if sources is None:
            raise ValueError(f"image_similarity compares each image with its source image in the "
                             f"{self.reference_column!r} column, which this batch lacks (columns: {sorted(columns)}); "
                             f"use an editing dataset or set reference_column")
        sources = list(sources)
        if len(sources) != len(images):
            raise ValueError(f"{len(images)} images but {len(sources)} source images")
        keep = [i for i, s in enumerate(sources) if s is not None]
        out: list[float | None] = [None] * len(images)
        if not keep:
            return out
        import torch

        with self._lock:
            self._prepare()  # outside inference mode, as the other scorers (the CLIP model may be shared)
            with torch.inference_mode():
                generated = self._pixel_embeddings([images[i] for i in keep])
                reference = self._pixel_embeddings([sources[i] for i in keep])
                cos = (generated * reference).sum(-1).cpu().tolist()
        for i, c in zip(keep, cos):
            out[i] = float(c)
        return out
