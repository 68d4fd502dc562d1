"""Loading the pipeline a trainer trains, with the family checks that can run before anything is loaded: reading
``model_index.json`` (`read_pipeline_index`), checking the family's settings against it (`check_family_settings`),
loading the pipeline (`load_pipeline`, with a quantized transformer on request)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ...models import family_adapter_class
from ..data.condition_images import IMAGE_COLUMN, load_condition_images
from ..online_config import OnlineRLConfig

TWO_EXPERTS_FULL_FINETUNE = (
    "This Wan 2.2 pipeline has two experts (transformer and transformer_2); training it is supported with LoRA (one "
    "adapter on each expert, each used on its own steps), not as full fine-tuning. Pass a peft_config (a "
    "peft.LoraConfig, e.g. LoraConfig(r=32, lora_alpha=64)) or use_peft: true in a recipe."
)


def import_own_components(index: dict | None) -> None:
    """Import the flowgrpo modules that ``model_index.json`` names for components (the tiny Qwen-Image-Edit pipeline's
    processor): diffusers loads a component of a custom class only once its module has been imported."""
    import importlib

    for value in (index or {}).values():
        if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) \
                and value[0].startswith("flowgrpo."):
            importlib.import_module(value[0])


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a configuration's ``dtype`` (``"auto"``: bfloat16 on a GPU, float32 on the CPU)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def read_pipeline_index(model: Any, pipeline_kwargs: dict) -> dict | None:
    """The pipeline's ``model_index.json`` (class name and components) without loading it; ``None`` if unknown."""
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        index = {**dict(model.config), "_class_name": type(model).__name__}
        if getattr(model, "vae", None) is not None:
            index["_vae_config"] = dict(model.vae.config)
        return index
    if not isinstance(model, (str, os.PathLike)):
        return None
    hub = {k: v for k, v in pipeline_kwargs.items() if k in ("revision", "cache_dir", "token")}
    try:
        index = dict(DiffusionPipeline.load_config(str(model), **hub))
    except Exception:  # unreadable here (e.g. offline): the same checks run right after loading
        return None
    try:  # video families check frames and sizes against their VAE's compression before loading
        if family_adapter_class(index.get("_class_name", "")).is_video and "vae" in index:
            from diffusers import AutoencoderKL  # any model class: reads the subfolder's config.json as is

            index["_vae_config"] = dict(AutoencoderKL.load_config(str(model), subfolder="vae", **hub))
    except Exception:  # no known family or no readable VAE config: checked again after loading
        pass
    return index


def check_sequence_parallel_family(adapter_cls: type, args: OnlineRLConfig) -> None:
    """Refuse ``sequence_parallel_size > 1`` for a family whose tokens cannot be split (its adapter's
    ``sequence_parallel_refusal`` says why)."""
    size = getattr(args, "sequence_parallel_size", 1)
    if size > 1 and adapter_cls.sequence_parallel_refusal:
        raise ValueError(f"sequence_parallel_size={size} with {adapter_cls.family} "
                         f"({', '.join(adapter_cls.pipeline_class_names)}): {adapter_cls.sequence_parallel_refusal} "
                         "Use sequence_parallel_size 1.")


def check_vae_tiling(vae_class: Any, name: str) -> None:
    """Refuse ``vae_tiling`` for a VAE class that cannot decode in tiles."""
    if vae_class is not None and not hasattr(vae_class, "enable_tiling"):
        raise ValueError(f"vae_tiling=True, but this pipeline's VAE ({name}) cannot decode in tiles (no enable_tiling); "
                         "set vae_tiling: false.")


def enable_vae_tiling(pipeline: Any) -> None:
    """``pipeline.vae.enable_tiling()`` (``vae_tiling``), refused with the reason for a VAE without it."""
    vae = getattr(pipeline, "vae", None)
    check_vae_tiling(type(vae) if vae is not None else None, type(vae).__name__)
    vae.enable_tiling()


def check_family_settings(index: dict | None, args: OnlineRLConfig, peft_config: Any, datasets: tuple) -> None:
    """Family-specific settings, checked from the pipeline's class name (``index``: its model_index.json) before
    anything is loaded: the frame count, the source-image column of editing families, what Wan 2.2's two experts
    support, and whether the family's tokens can be split over processes (``sequence_parallel_size``)."""
    if not index or "_class_name" not in index:
        return
    adapter_cls = family_adapter_class(index["_class_name"])
    check_sequence_parallel_family(adapter_cls, args)
    vae = index.get("vae")
    if getattr(args, "vae_tiling", False) and isinstance(vae, (list, tuple)) and len(vae) == 2 and vae[0] == "diffusers":
        import diffusers

        check_vae_tiling(getattr(diffusers, vae[1], None), vae[1])
    adapter_cls.check_num_frames(args.num_frames)
    adapter_cls.check_video_settings(args.num_frames, *args.image_size, index.get("_vae_config"))
    if adapter_cls.accepts_images:
        with_images = False
        for name, dataset in zip(("train_dataset", "eval_dataset"), datasets):
            if dataset is None:
                continue
            first = dataset[0]
            if IMAGE_COLUMN not in first and adapter_cls.images_optional:
                continue  # optional reference images (FLUX.2): this dataset trains text-to-image
            if IMAGE_COLUMN not in first:
                raise ValueError(
                    f"{index['_class_name']} edits a source image, but {name} has no '{IMAGE_COLUMN}' column "
                    f"(columns: {[k for k in first if not k.startswith('_')]}); add one holding each prompt's "
                    "source image (a path, a PIL image or a datasets.Image feature).")
            load_condition_images(first[IMAGE_COLUMN])
            with_images = True
        if with_images and args.cache_prompt_embeddings and args.precompute_prompt_embeddings:
            raise ValueError(f"precompute_prompt_embeddings encodes the datasets' prompts alone, but "
                             f"{index['_class_name']} encodes each (prompt, source image) pair; set "
                             "precompute_prompt_embeddings: false (the cache then keeps each pair on first use).")
    second = index.get("transformer_2")
    if isinstance(second, (list, tuple)) and second and second[0] is not None and index.get("boundary_ratio"):
        if peft_config is None:
            raise ValueError(TWO_EXPERTS_FULL_FINETUNE)
        if args.quantization:
            raise ValueError("quantization loads one quantized transformer, but this Wan 2.2 pipeline has two "
                             "experts; train its LoRAs without quantization.")


def load_pipeline(model: Any, args: OnlineRLConfig, pipeline_kwargs: dict, dtype: torch.dtype):
    """The pipeline ``model`` names (a hub id or folder, loaded in ``dtype``), or ``model`` itself when it is one."""
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        if args.quantization:
            raise ValueError("quantization applies when loading from a hub id or folder; pass the model id, or "
                             "quantize the pipeline's transformer yourself.")
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a hub id, a local folder or a DiffusionPipeline, got {type(model)}")
    kwargs = dict(pipeline_kwargs)
    if "torch_dtype" not in kwargs:  # diffusers' older name, still accepted when a caller passes it
        kwargs.setdefault("dtype", dtype)
    if args.quantization:
        kwargs["transformer"] = load_quantized_transformer(str(model), args, pipeline_kwargs, dtype)
    return DiffusionPipeline.from_pretrained(str(model), **kwargs)


def load_quantized_transformer(model: str, args: OnlineRLConfig, pipeline_kwargs: dict, dtype: torch.dtype):
    """The pipeline's transformer loaded with bitsandbytes quantization (``args.quantization``)."""
    from diffusers import DiffusionPipeline

    from .quantization import build_quantization_config

    config = DiffusionPipeline.load_config(model, **{k: v for k, v in pipeline_kwargs.items()
                                                      if k in ("revision", "cache_dir", "token")})
    library, class_name = config["transformer"]
    import diffusers

    cls = getattr(diffusers, class_name)
    return cls.from_pretrained(model, subfolder="transformer", dtype=dtype,
                               quantization_config=build_quantization_config(args.quantization, dtype),
                               **pipeline_kwargs)


__all__ = ["TWO_EXPERTS_FULL_FINETUNE", "check_family_settings", "check_sequence_parallel_family", "check_vae_tiling",
           "enable_vae_tiling", "import_own_components", "load_pipeline", "load_quantized_transformer",
           "read_pipeline_index", "torch_dtype"]
