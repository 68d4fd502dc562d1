"""Model-family adapters: one file per family, looked up from the pipeline class."""

from __future__ import annotations

from diffusers import DiffusionPipeline

from .base import MMDIT_LORA_TARGET_MODULES, ModelFamilyAdapter, PromptEmbeds
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .flux_kontext import FluxKontextAdapter
from .hunyuanvideo15 import HunyuanVideo15Adapter
from .ltx2 import LTX2Adapter
from .qwenimage import QwenImageAdapter
from .qwenimage21 import QwenImage21Adapter
from .qwenimage_edit import QwenImageEditAdapter
from .qwenimage_edit_plus import QwenImageEditPlusAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter, WanExperts
from .wan_i2v import WanImageToVideoAdapter
from .zimage import ZImageAdapter

ADAPTERS: list[type[ModelFamilyAdapter]] = [
    SD3Adapter, FluxAdapter, FluxKontextAdapter, QwenImageAdapter, QwenImageEditAdapter, WanAdapter,
    Flux2Adapter, Flux2KleinAdapter, ZImageAdapter, QwenImageEditPlusAdapter, QwenImage21Adapter,
    WanImageToVideoAdapter, LTX2Adapter, HunyuanVideo15Adapter,
]


def family_adapter_class(pipeline: DiffusionPipeline | str) -> type[ModelFamilyAdapter]:
    """The adapter class for a pipeline or a pipeline class name (``model_index.json``'s ``_class_name``).

    Knowing the family from the class name lets family-specific settings be checked before anything is loaded.
    """
    for adapter_cls in ADAPTERS:
        if adapter_cls.supports(pipeline):
            return adapter_cls
    name = pipeline if isinstance(pipeline, str) else type(pipeline).__name__
    supported = ", ".join(name for cls in ADAPTERS for name in cls.pipeline_class_names)
    raise ValueError(
        f"{name} is not a supported pipeline; supported: {supported}. "
        "Add a family by writing a ModelFamilyAdapter subclass in flowgrpo/models/ and listing it in ADAPTERS."
    )


def get_family_adapter(pipeline: DiffusionPipeline, num_frames: int = 1) -> ModelFamilyAdapter:
    """The adapter for ``pipeline``'s family (``num_frames`` for video families); a clear error for unsupported
    pipelines or a frame count the family cannot generate."""
    return family_adapter_class(pipeline)(pipeline, num_frames=num_frames)


__all__ = [
    "ADAPTERS", "Flux2Adapter", "Flux2KleinAdapter", "FluxAdapter", "FluxKontextAdapter", "HunyuanVideo15Adapter", "LTX2Adapter", "MMDIT_LORA_TARGET_MODULES", "ModelFamilyAdapter", "PromptEmbeds",
    "QwenImage21Adapter", "QwenImageAdapter", "QwenImageEditAdapter", "QwenImageEditPlusAdapter", "SD3Adapter", "WanAdapter", "WanExperts", "WanImageToVideoAdapter", "ZImageAdapter", "family_adapter_class",
    "get_family_adapter",
]
