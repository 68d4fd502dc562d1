"""Model-family adapters: one file per family, looked up from the pipeline class."""

from __future__ import annotations

from diffusers import DiffusionPipeline

from .base import ModelFamilyAdapter, PromptEmbeds
from .flux import FluxAdapter
from .sd3 import SD3Adapter

ADAPTERS: list[type[ModelFamilyAdapter]] = [SD3Adapter, FluxAdapter]


def get_family_adapter(pipeline: DiffusionPipeline) -> ModelFamilyAdapter:
    """The adapter for ``pipeline``'s family; a clear error for unsupported pipelines."""
    for adapter_cls in ADAPTERS:
        if adapter_cls.supports(pipeline):
            return adapter_cls(pipeline)
    supported = ", ".join(name for cls in ADAPTERS for name in cls.pipeline_class_names)
    raise ValueError(
        f"{type(pipeline).__name__} is not a supported pipeline; supported: {supported}. "
        "Add a family by writing a ModelFamilyAdapter subclass in flowgrpo/models/ and listing it in ADAPTERS."
    )


__all__ = ["ADAPTERS", "FluxAdapter", "ModelFamilyAdapter", "PromptEmbeds", "SD3Adapter", "get_family_adapter"]
