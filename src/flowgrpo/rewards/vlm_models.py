"""Loading and prompting in-process vision-language models for the VLM rewards (``vqascore``, ``deqa``, the
in-process ``unifiedreward``; ``hpsv3`` uses the processor loading, prompting and the base class).

* `VLMReward` is `flowgrpo.rewards.placement.ModelReward` for a model that comes with a processor: ``load()``
  gives ``(model, processor)``; the placement (``device`` / ``reward_device``, ``to()`` / ``offload()`` for
  ``reward_offload``), the lock and the chunking are `ModelReward`'s; the ``dtype`` defaults to bfloat16 on CUDA
  and float32 on the CPU.
* `cached_vlm` builds a ``(model, processor)`` pair once per process and key, so rewards with the same model,
  device and dtype share one copy of its weights.
* `load_vlm` loads ``AutoModelForImageTextToText`` and its processor that way, in eval mode without gradients.
* `load_vlm_processor` is ``AutoProcessor.from_pretrained`` with one fallback: transformers builds the video
  processor of Qwen2-VL-family processors only when torchvision is installed, and CPU-only installs often lack it.
  The fallback builds the same processor class without its video processor (image processor, tokenizer and chat
  template from the same folder); images are processed exactly as with the full processor.
* `chat_text` renders one user turn holding an image and a question with the processor's chat template, plus the
  generation prompt, so the next token the model predicts is the first token of its answer.
* `vlm_batch` tokenises a batch of rendered texts with their images, left-padded by default, so that position -1
  of every row is that row's answer position.
* `resize_like_processor` resizes an image as a Qwen2-VL-family image processor with a given backend does (torchvision:
  torch's uint8 bicubic kernel; PIL: PIL's bicubic), before the processor sees it: the processor then keeps its size,
  so the pixels are that backend's whether transformers has torchvision here or falls back to PIL (the two bicubics
  differ by up to a few 8-bit levels per pixel). `vlm_batch` does it with the backend the official code ran
  (`official_resize_backend`: torchvision for Qwen3-VL, PIL for Qwen2-VL and Qwen2.5-VL; docs/rewards.md, "Image
  preprocessing of the VLM rewards").
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .placement import ModelReward

__all__ = ["VLMReward", "as_rgb", "cached_vlm", "chat_content_text", "chat_text", "load_vlm", "load_vlm_processor",
           "official_resize_backend", "processor_pixel_bounds", "qwen_vl_processor_size", "resize_like_processor",
           "resize_like_torchvision_processor", "vlm_batch"]

_MODELS: dict[tuple, tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()


def cached_vlm(key: tuple, build: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``build()``'s ``(model, processor)``, built once per process for ``key`` (which names what ``build`` loads,
    its device and dtype)."""
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = build()
        return _MODELS[key]


class VLMReward(ModelReward):
    """`ModelReward` of a model with a processor: subclasses implement ``_load_vlm(device, dtype)`` (the
    ``(model, processor)`` pair, usually from `cached_vlm`) and ``_score``. ``load()`` returns ``(model,
    processor)``; ``to()`` / ``offload()`` move the model. Inputs always follow the model's current device, so a
    model shared by two rewards scores correctly wherever it is."""

    _processor: Any = None

    def default_dtype(self, device: Any) -> Any:
        """bfloat16 on CUDA, float32 on the CPU."""
        return "bfloat16" if device.type == "cuda" else "float32"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:  # pragma: no cover - every subclass has one
        raise NotImplementedError

    def _load(self, device: Any, dtype: Any) -> Any:
        model, self._processor = self._load_vlm(device, dtype)
        return model

    def load(self) -> tuple[Any, Any]:  # type: ignore[override]
        """Load (once; the weights cached per process and settings) and return ``(model, processor)``."""
        model = self._loaded_module()
        return model, self._processor


def as_rgb(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image or an HxWxC uint8 array."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    import numpy as np

    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    raise TypeError(f"VLM rewards need PIL images (or HxWxC uint8 arrays), got {type(image).__name__}")


def _processor_class_name(path: str) -> str | None:
    """The ``processor_class`` a local folder names in its processor or image-processor config, if any."""
    folder = Path(path)
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = folder / name
        if file.is_file():
            value = json.loads(file.read_text()).get("processor_class")
            if value:
                return str(value)
    return None


def _template_file(path: str, name: str) -> Path | None:
    """``name`` in the local folder ``path``, or downloaded from the hub repository ``path``; ``None`` if absent."""
    local = Path(path) / name
    if local.is_file():
        return local
    if Path(path).is_dir():
        return None
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(path, name))
    except Exception:  # noqa: BLE001 - the repository simply may not have this file
        return None


def _read_chat_template(path: str, tokenizer: Any) -> str | None:
    """The chat template from ``chat_template.jinja``, ``chat_template.json`` or the tokenizer, in that order."""
    jinja = _template_file(path, "chat_template.jinja")
    if jinja is not None:
        return jinja.read_text()
    js = _template_file(path, "chat_template.json")
    if js is not None:
        return json.loads(js.read_text()).get("chat_template")
    return getattr(tokenizer, "chat_template", None)


def _image_only_processor(path: str, class_name: str, **kwargs: Any) -> Any:
    """The processor class ``class_name`` built without a video processor, from the files in ``path``."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    base = getattr(transformers, class_name, None)
    if base is None:
        raise ValueError(f"{path} names processor class {class_name!r}, which this transformers does not have")

    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **extra: Any):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **extra)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{class_name}"
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=_read_chat_template(path, tokenizer))


def load_vlm_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The processor of a VLM: ``AutoProcessor.from_pretrained``, else the image-only fallback (module docstring).

    Raises:
        ValueError: neither gives a processor with an image processor and a tokenizer.
    """
    from transformers import AutoProcessor

    error: Exception | None = None
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
        if getattr(processor, "image_processor", None) is not None and getattr(processor, "tokenizer", None) is not None:
            return processor
    except (ImportError, AttributeError, ValueError, OSError) as exc:  # the video processor needs torchvision
        error = exc
    class_name = _processor_class_name(str(name_or_path))
    if class_name is None and not Path(str(name_or_path)).is_dir():
        from huggingface_hub import hf_hub_download

        try:
            config = hf_hub_download(str(name_or_path), "preprocessor_config.json")
            class_name = json.loads(Path(config).read_text()).get("processor_class")
        except Exception:  # noqa: BLE001 - reported below with the first error
            class_name = None
    if class_name is None:
        raise ValueError(f"could not load a multimodal processor from {name_or_path!r}"
                         + (f" ({type(error).__name__}: {error})" if error else "")
                         + "; pass processor_name_or_path=<a folder or hub id with the model's processor>")
    return _image_only_processor(str(name_or_path), class_name, **kwargs)


def load_vlm(model_name_or_path: str, processor_name_or_path: str | None, device: Any, dtype: Any) -> tuple[Any, Any]:
    """``(AutoModelForImageTextToText, processor)`` in eval mode on ``device`` in ``dtype``; cached per process."""

    def build() -> tuple[Any, Any]:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_name_or_path, dtype=dtype)
        model.to(device).eval().requires_grad_(False)
        return model, load_vlm_processor(processor_name_or_path or model_name_or_path)

    processor = processor_name_or_path or model_name_or_path
    return cached_vlm(("vlm", str(model_name_or_path), str(processor), str(device), str(dtype)), build)


def chat_text(processor: Any, question: str, system_prompt: str | None = None) -> str:
    """One user turn ``[image, question]`` rendered with the processor's chat template, ending with the generation
    prompt (the assistant turn's opening)."""
    return chat_content_text(processor, [{"type": "image"}, {"type": "text", "text": question}], system_prompt)


def chat_content_text(processor: Any, content: Sequence[dict], system_prompt: str | None = None) -> str:
    """One user turn with the content parts ``content`` (``{"type": "image"}`` and ``{"type": "text", "text": ...}``,
    in order; several images allowed) rendered with the processor's chat template, plus the generation prompt."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{type(processor).__name__} has no chat template; give a processor folder that has one "
                         f"(chat_template.jinja / chat_template.json or the tokenizer's chat_template)")
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": [dict(part) for part in content]})
    return processor.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def vlm_batch(processor: Any, texts: Sequence[str], images: Sequence[Image.Image], device: Any,
              padding_side: str = "left") -> dict[str, Any]:
    """Processor outputs for ``texts`` (each with one image placeholder) and ``images``, padded on
    ``padding_side`` (per call: the shared processor is not modified), moved to ``device`` (pixel values stay
    float32; the model casts them). A Qwen-VL processor's images are resized first as the official code's backend
    resizes them (`official_resize_backend`, `resize_like_processor`)."""
    backend = official_resize_backend(processor)
    if backend is not None:  # the official resize, whichever backend transformers has here
        images = [resize_like_processor(im, processor.image_processor, backend) for im in images]
    batch = processor(text=list(texts), images=[as_rgb(im) for im in images], padding=True,
                      padding_side=padding_side, return_tensors="pt")
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


# ---- resizing as the torchvision image processors do ------------------------------------------------------------


def processor_pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a Qwen2-VL-family image processor (its ``size`` or its older attributes)."""
    size = getattr(image_processor, "size", None)
    if isinstance(size, Mapping):
        low, high = size.get("shortest_edge"), size.get("longest_edge")
    else:  # transformers' SizeDict
        low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    if low is None or high is None:
        low, high = getattr(image_processor, "min_pixels", None), getattr(image_processor, "max_pixels", None)
    if low is None or high is None:
        raise ValueError(f"{type(image_processor).__name__} has no pixel bounds (size['shortest_edge'/'longest_edge'] "
                         f"or min_pixels/max_pixels); it is not a Qwen2-VL-family image processor")
    return int(low), int(high)


def qwen_vl_processor_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The ``(height, width)`` a Qwen2-VL-family image processor resizes to (transformers' ``smart_resize``, the same
    in 4.57 and 5.x): each side rounded to a multiple of ``factor``; when the area leaves ``[min_pixels,
    max_pixels]``, both sides scaled by one factor and floored (at least ``factor``) or ceiled to multiples of it.

    Raises:
        ValueError: an aspect ratio above 200 (the processor refuses it too).
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be at most 200, got {height}x{width}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_like_processor(image: Any, image_processor: Any, backend: str = "torchvision") -> Image.Image:
    """``image`` (RGB) resized as a Qwen2-VL-family image processor with the given ``backend`` resizes it on the CPU.

    The size is `qwen_vl_processor_size` with the processor's ``patch_size * merge_size`` and pixel bounds. The pixels:
    ``backend="torchvision"``: ``torch.nn.functional.interpolate`` on the uint8 tensor (bicubic, antialiased,
    ``align_corners=False``), which is what torchvision's ``resize`` runs for uint8 images on the CPU (transformers'
    torchvision backend keeps images uint8 until it normalises them); ``"pil"``: PIL's bicubic ``Image.resize``, as
    the PIL backend. An image already at that size is returned as it is. Given the result, either backend of the
    processor keeps the size, so the pixels are those of ``backend`` whichever one transformers runs here.
    """
    import numpy as np
    import torch

    if backend not in ("torchvision", "pil"):
        raise ValueError(f"backend must be 'torchvision' or 'pil', got {backend!r}")
    image = as_rgb(image)
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    height, width = qwen_vl_processor_size(image.height, image.width, factor, *processor_pixel_bounds(image_processor))
    if (height, width) == (image.height, image.width):
        return image
    if backend == "pil":
        return image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
    resized = torch.nn.functional.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False,
                                              antialias=True)
    return Image.fromarray(resized[0].permute(1, 2, 0).contiguous().numpy())


def resize_like_torchvision_processor(image: Any, image_processor: Any) -> Image.Image:
    """`resize_like_processor` with the torchvision backend (what every official Qwen3-VL stack runs)."""
    return resize_like_processor(image, image_processor, "torchvision")


def official_resize_backend(processor: Any) -> str | None:
    """The image processor backend the official code of a Qwen-VL reward ran: ``"torchvision"`` for Qwen3-VL (its
    transformers processor cannot be built without torchvision, so every official stack, transformers or vLLM, had
    it), ``"pil"`` for Qwen2-VL and Qwen2.5-VL (qwen-vl-utils' PIL resize, transformers' PIL image processor); None
    for a processor of another family (left to the processor)."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or getattr(image_processor, "merge_size", None) is None \
            or getattr(image_processor, "patch_size", None) is None:
        return None
    try:
        processor_pixel_bounds(image_processor)
    except ValueError:
        return None
    name = type(processor).__name__
    if "Qwen3VL" in name:
        return "torchvision"
    if "Qwen2VL" in name or "Qwen2_5_VL" in name:
        return "pil"
    return None
