"""Model-family adapters: one file per family, looked up from the pipeline class.

`FAMILIES` is the one table of families: each family's name and its adapter class (which declares the diffusers
pipeline classes it serves, ``pipeline_class_names``). The tiny pipelines of ``flowgrpo.testing``, the command line's
``build_tiny_pipeline_if_missing`` choices and the planner's pipeline-to-family mapping all derive from it. This
package imports its adapters (and diffusers) only when one is used, so reading the table is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: family name -> its adapter class as ``"module:Class"``, in the order tests and docs list them
FAMILIES: dict[str, str] = {
    "sd3": "flowgrpo.models.sd3:SD3Adapter",
    "flux": "flowgrpo.models.flux:FluxAdapter",
    "qwenimage": "flowgrpo.models.qwenimage:QwenImageAdapter",
    "wan": "flowgrpo.models.wan:WanAdapter",
    "flux_kontext": "flowgrpo.models.flux_kontext:FluxKontextAdapter",
    "qwenimage_edit": "flowgrpo.models.qwenimage_edit:QwenImageEditAdapter",
    "flux2_klein": "flowgrpo.models.flux2:Flux2KleinAdapter",
    "zimage": "flowgrpo.models.zimage:ZImageAdapter",
    "flux2": "flowgrpo.models.flux2:Flux2Adapter",
    "qwenimage_edit_plus": "flowgrpo.models.qwenimage_edit_plus:QwenImageEditPlusAdapter",
    "qwenimage21": "flowgrpo.models.qwenimage21:QwenImage21Adapter",
    "wan_i2v": "flowgrpo.models.wan_i2v:WanImageToVideoAdapter",
    "ltx2": "flowgrpo.models.ltx2:LTX2Adapter",
    "hunyuanvideo15": "flowgrpo.models.hunyuanvideo15:HunyuanVideo15Adapter",
}

#: names this package exports lazily -> their module
_LAZY = {
    "MMDIT_LORA_TARGET_MODULES": "flowgrpo.models.base", "ModelFamilyAdapter": "flowgrpo.models.base",
    "PromptEmbeds": "flowgrpo.models.base", "WanExperts": "flowgrpo.models.wan",
    **{path.partition(":")[2]: path.partition(":")[0] for path in FAMILIES.values()},
}

if TYPE_CHECKING:  # pragma: no cover
    from diffusers import DiffusionPipeline

    from .base import ModelFamilyAdapter


def adapter_classes() -> list[type[ModelFamilyAdapter]]:
    """Every family's adapter class, in `FAMILIES` order (imports them)."""
    out = []
    for path in FAMILIES.values():
        module, _, name = path.partition(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def family_adapter_class(pipeline: DiffusionPipeline | str) -> type[ModelFamilyAdapter]:
    """The adapter class for a pipeline or a pipeline class name (``model_index.json``'s ``_class_name``).

    Knowing the family from the class name lets family-specific settings be checked before anything is loaded.
    """
    classes = adapter_classes()
    for adapter_cls in classes:
        if adapter_cls.supports(pipeline):
            return adapter_cls
    name = pipeline if isinstance(pipeline, str) else type(pipeline).__name__
    supported = ", ".join(name for cls in classes for name in cls.pipeline_class_names)
    raise ValueError(
        f"{name} is not a supported pipeline; supported: {supported}. "
        "Add a family by writing a ModelFamilyAdapter subclass in flowgrpo/models/ and adding it to "
        "flowgrpo.models.FAMILIES."
    )


def get_family_adapter(pipeline: DiffusionPipeline, num_frames: int = 1) -> ModelFamilyAdapter:
    """The adapter for ``pipeline``'s family (``num_frames`` for video families); a clear error for unsupported
    pipelines or a frame count the family cannot generate."""
    return family_adapter_class(pipeline)(pipeline, num_frames=num_frames)


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":
        return adapter_classes()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowgrpo.models' has no attribute {name!r}")


__all__ = sorted(["ADAPTERS", "FAMILIES", "adapter_classes", "family_adapter_class", "get_family_adapter", *_LAZY])
