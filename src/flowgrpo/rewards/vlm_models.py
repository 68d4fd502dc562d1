"""Loading, placing and prompting in-process vision-language models for the VLM rewards (``vqascore``, ``deqa``,
the in-process ``unifiedreward``; ``hpsv3`` uses the processor loading, prompting and placement).

* `load_vlm` loads ``AutoModelForImageTextToText`` and its processor once per process and per (model, processor,
  device, dtype), in eval mode without gradients.
* `load_vlm_processor` is ``AutoProcessor.from_pretrained`` with one fallback: transformers builds the video
  processor of Qwen2-VL-family processors only when torchvision is installed, and CPU-only installs often lack it.
  The fallback builds the same processor class without its video processor (image processor, tokenizer and chat
  template from the same folder); images are processed exactly as with the full processor.
* `chat_text` renders one user turn holding an image and a question with the processor's chat template, plus the
  generation prompt, so the next token the model predicts is the first token of its answer.
* `vlm_batch` tokenises a batch of rendered texts with their images, left-padded by default, so that position -1
  of every row is that row's answer position.
* `OffloadableModelReward` gives a reward ``to()`` / ``offload()`` for ``reward_offload``; `pick_device` reconciles
  the ``device`` and ``reward_device`` spellings of the placement option.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

__all__ = ["OffloadableModelReward", "as_rgb", "chat_text", "load_vlm", "load_vlm_processor", "pick_device",
           "resolve_device", "resolve_dtype", "vlm_batch"]

_MODELS: dict[tuple, tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()


def resolve_device(device: Any) -> Any:
    """``torch.device``: the given one, else CUDA when available, else the CPU."""
    from .clip_scorers import _resolve_device

    return _resolve_device(None if device is None else str(device))


def resolve_dtype(dtype: Any, default: str = "float32") -> Any:
    """``torch.dtype`` from a dtype or its name (``"bf16"``, ``"float16"``, ...); ``None`` gives ``default``."""
    from .clip_scorers import _resolve_dtype

    return _resolve_dtype(default if dtype is None else dtype)


def pick_device(device: Any, reward_device: Any) -> Any:
    """The one device of the ``device`` / ``reward_device`` pair of options (two names for the same option)."""
    if device is not None and reward_device is not None and str(device) != str(reward_device):
        raise ValueError(f"device={device!r} and reward_device={reward_device!r} disagree; give only one of them")
    return reward_device if reward_device is not None else device


class OffloadableModelReward:
    """Placement methods of a reward whose ``load()`` returns ``(model, processor)``: ``to(device=None)`` moves the
    weights to ``device`` (default: the reward's own device) and returns the reward; ``offload()`` moves them to the
    CPU (nothing before the first load). ``reward_offload`` calls them around each scoring. Inputs always follow the
    model's current device, so a model shared by two rewards scores correctly wherever it is."""

    device_name: Any = None
    _loaded_model: Any = None

    def _load(self) -> tuple[Any, Any]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def load(self) -> tuple[Any, Any]:
        """Load (once; cached per process and settings) and return ``(model, processor)``."""
        model, processor = self._load()
        self._loaded_model = model
        return model, processor

    def to(self, device: Any = None) -> OffloadableModelReward:
        model, _ = self.load()
        model.to(resolve_device(device if device is not None else self.device_name))
        return self

    def offload(self) -> None:
        if self._loaded_model is not None:
            self._loaded_model.to("cpu")


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
    key = (str(model_name_or_path), str(processor_name_or_path or model_name_or_path), str(device), str(dtype))
    with _MODELS_LOCK:
        cached = _MODELS.get(key)
        if cached is not None:
            return cached
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_name_or_path, dtype=dtype)
        model.to(device).eval().requires_grad_(False)
        processor = load_vlm_processor(processor_name_or_path or model_name_or_path)
        _MODELS[key] = (model, processor)
        return model, processor


def chat_text(processor: Any, question: str, system_prompt: str | None = None) -> str:
    """One user turn ``[image, question]`` rendered with the processor's chat template, ending with the generation
    prompt (the assistant turn's opening)."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{type(processor).__name__} has no chat template; give a processor folder that has one "
                         f"(chat_template.jinja / chat_template.json or the tokenizer's chat_template)")
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    return processor.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def vlm_batch(processor: Any, texts: Sequence[str], images: Sequence[Image.Image], device: Any,
              padding_side: str = "left") -> dict[str, Any]:
    """Processor outputs for ``texts`` (each with one image placeholder) and ``images``, padded on
    ``padding_side`` (per call: the shared processor is not modified), moved to ``device`` (pixel values stay
    float32; the model casts them)."""
    batch = processor(text=list(texts), images=[as_rgb(im) for im in images], padding=True,
                      padding_side=padding_side, return_tensors="pt")
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
