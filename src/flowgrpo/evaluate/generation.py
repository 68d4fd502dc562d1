"""Benchmark images from any supported pipeline, with the project's own family adapters and ODE solvers.

The sampler is the one the trainers evaluate with: the family adapter (``flowgrpo.models``) encodes the prompts,
draws the initial noise, calls the transformer (with classifier-free guidance as the family does it) and decodes;
the flow ODE is solved from the pipeline's own noise schedule (``FlowMatchSDEScheduler`` built from its scheduler
config, shifted as the family's pipeline shifts it) with Euler steps, x' = x + (sigma' - sigma) v, or DPM-Solver++
2M. So every text-to-image family the trainers support (SD3 / SD3.5, FLUX.1, Qwen-Image) is evaluated the way it
was trained, and a LoRA is loaded with the pipeline's own ``load_lora_weights`` (what users of the trained LoRA
run), from a Hub id or a folder holding ``pytorch_lora_weights.safetensors``.

Every image is drawn from its own seed (:func:`flowgrpo.evaluate.benchmarks.image_seed`), so its initial noise does
not depend on the batch size, the number of processes, or which run of a resumed evaluation drew it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .benchmarks import SamplingProtocol

#: The LoRA file diffusers' ``load_lora_weights`` reads (and the trainers write), and the second expert's.
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
SECOND_EXPERT_LORA_WEIGHTS_NAME = "pytorch_lora_weights_transformer_2.safetensors"
PEFT_ADAPTER_NAME = "adapter_model.safetensors"


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on a CPU; else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def looks_like_local_path(name: str) -> bool:
    """True when ``name`` can only be a local path (a Hub id is ``namespace/name``)."""
    return name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1 or os.path.exists(name)


def load_pipeline(model: str, dtype: torch.dtype, revision: str | None = None) -> Any:
    """``DiffusionPipeline.from_pretrained(model)`` in ``dtype``; a local path that does not exist is named."""
    from diffusers import DiffusionPipeline

    from ..cli.notices import quiet_library_notices

    quiet_library_notices()
    check_model(model, revision)
    kwargs = {"revision": revision} if revision else {}
    pipeline = DiffusionPipeline.from_pretrained(str(Path(model).expanduser()) if looks_like_local_path(model)
                                                 else model, dtype=dtype, **kwargs)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _lora_layer_count(module: torch.nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(1 for name, _ in module.named_modules() if name.endswith(".lora_A"))


def load_lora(pipeline: Any, lora: str) -> int:
    """Load a LoRA into ``pipeline`` with its own ``load_lora_weights``; returns the number of LoRA layers loaded.

    ``lora`` is a Hub id, a folder holding ``pytorch_lora_weights.safetensors`` (what the trainers write in their
    output folder and every checkpoint; a two-expert pipeline's second LoRA, ``pytorch_lora_weights_transformer_2
    .safetensors``, is loaded into ``transformer_2`` when present), or the ``.safetensors`` file itself. Raises
    ``ValueError`` when the folder holds no such file (peft's ``adapter_model.safetensors`` alone is named as such)
    or when nothing was loaded.
    """
    path = Path(lora).expanduser()
    if path.is_file():
        pipeline.load_lora_weights(str(path.parent), weight_name=path.name)
    elif path.is_dir():
        if not (path / LORA_WEIGHTS_NAME).is_file() and (path / "transformer" / "config.json").is_file():
            raise ValueError(f"--lora {lora!r} holds a fully fine-tuned transformer (transformer/), not a LoRA: pass "
                             "it with --transformer instead.")
        if not (path / LORA_WEIGHTS_NAME).is_file():
            found = sorted(p.name for p in path.glob("*.safetensors"))
            extra = (f" It holds {PEFT_ADAPTER_NAME}, peft's format, which diffusers does not read: give the run's "
                     f"output folder or a checkpoint folder (both hold {LORA_WEIGHTS_NAME}).") \
                if PEFT_ADAPTER_NAME in found else f" It holds {found or 'no .safetensors file'}."
            raise ValueError(f"--lora {lora!r} has no {LORA_WEIGHTS_NAME}.{extra}")
        pipeline.load_lora_weights(str(path))
        second = path / SECOND_EXPERT_LORA_WEIGHTS_NAME
        if second.is_file() and getattr(pipeline, "transformer_2", None) is not None:
            pipeline.load_lora_weights(str(path), weight_name=second.name, load_into_transformer_2=True)
    elif looks_like_local_path(lora):
        raise ValueError(f"--lora {lora!r} does not exist (relative paths are read from {Path.cwd()}); give a Hub "
                         f"id or a folder holding {LORA_WEIGHTS_NAME}.")
    else:
        pipeline.load_lora_weights(lora)
    layers = _lora_layer_count(getattr(pipeline, "transformer", None)) + \
        _lora_layer_count(getattr(pipeline, "transformer_2", None))
    if layers == 0:
        raise ValueError(f"--lora {lora!r} loaded no LoRA layer into {type(pipeline).__name__}'s transformer: its "
                         "keys do not name this model's modules (a LoRA of another model family?).")
    return layers


def check_text_to_image_family(adapter_cls: type, pipeline_name: str) -> None:
    """Raise ``ValueError`` for a family the image benchmarks cannot evaluate (video, editing)."""
    if adapter_cls.is_video:
        raise ValueError(f"{pipeline_name} generates videos; the benchmarks of flowgrpo evaluate score images. "
                         "Evaluate a text-to-image pipeline (SD3 / SD3.5, FLUX.1, Qwen-Image).")
    if adapter_cls.accepts_images and not adapter_cls.images_optional:  # FLUX.2's references are optional
        raise ValueError(f"{pipeline_name} edits source images; the benchmarks of flowgrpo evaluate are text-to-image "
                         "prompts without source images. Evaluate a text-to-image pipeline.")


def check_model(model: str, revision: str | None = None) -> None:
    """Before loading: a local folder must exist, and its pipeline class (``model_index.json``) must be a supported
    text-to-image family. A Hub id whose index cannot be read here is checked after loading instead."""
    from diffusers import DiffusionPipeline

    from ..models import family_adapter_class

    if looks_like_local_path(model) and not Path(model).expanduser().exists():
        raise ValueError(f"--model {model!r} does not exist (relative paths are read from {Path.cwd()}); give a Hub "
                         "id such as stabilityai/stable-diffusion-3.5-medium or a folder written by save_pretrained.")
    try:
        index = DiffusionPipeline.load_config(str(Path(model).expanduser()) if looks_like_local_path(model) else model,
                                              **({"revision": revision} if revision else {}))
    except Exception:  # offline or no index yet: from_pretrained reports it with its own words
        return
    name = index.get("_class_name")
    if name:
        check_text_to_image_family(family_adapter_class(name), name)


def load_transformer(pipeline: Any, path: str) -> None:
    """Replace ``pipeline.transformer`` by a fully fine-tuned one: a folder written by ``save_pretrained`` (what the
    trainers write to ``<output_dir>/transformer`` without LoRA), or the run's output folder holding it."""
    folder = Path(path).expanduser()
    if (folder / "transformer" / "config.json").is_file():
        folder = folder / "transformer"
    if not (folder / "config.json").is_file():
        raise ValueError(f"--transformer {path!r} holds no transformer (no config.json, nor transformer/config.json): "
                         "give the folder a full fine-tuning run wrote (<output_dir>/transformer).")
    current = pipeline.transformer
    dtype = next(current.parameters()).dtype
    pipeline.transformer = type(current).from_pretrained(str(folder), dtype=dtype)


class ImageGenerator:
    """Deterministic sampling of a loaded pipeline under a :class:`SamplingProtocol`.

    ``generate(prompts, seeds)`` returns one PIL image per prompt, image ``k`` drawn from
    ``torch.Generator().manual_seed(seeds[k])``.
    """

    def __init__(self, pipeline: Any, protocol: SamplingProtocol, device: torch.device | str):
        from ..models import get_family_adapter
        from ..schedulers import FlowMatchSDEScheduler

        protocol.check()
        self.protocol = protocol
        self.device = torch.device(device)
        self.adapter = get_family_adapter(pipeline)
        check_text_to_image_family(type(self.adapter), type(pipeline).__name__)
        self.pipeline = pipeline
        self.dtype = next(pipeline.transformer.parameters()).dtype
        pipeline.to(self.device)
        self.scheduler = FlowMatchSDEScheduler.from_config(self.adapter.sde_scheduler_config())
        self.transformer = self.adapter.trainable_module()
        self._negative = None
        if self.adapter.uses_cfg(protocol.guidance_scale):
            with torch.no_grad():
                self._negative = self.adapter.encode_prompts([protocol.negative_prompt],
                                                             protocol.max_sequence_length, self.device)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], seeds: Sequence[int]) -> list[Any]:
        from PIL import Image

        from ..schedulers import FlowODESolver, rollout_steps

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds.")
        p = self.protocol
        height, width = p.height, p.width
        unique = list(dict.fromkeys(prompts))
        rows = torch.tensor([unique.index(prompt) for prompt in prompts], dtype=torch.long)
        embeds = self.adapter.encode_prompts(unique, p.max_sequence_length, self.device).index_select(rows)
        negative = self._negative.expand_to(len(prompts)) if self._negative is not None else None
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        latents = self.adapter.prepare_latents(len(prompts), height, width, generators, self.device, torch.float32)

        self.adapter.set_timesteps(self.scheduler, p.num_inference_steps, height, width, self.device)
        sigmas = self.scheduler.sigmas.to(device=self.device, dtype=torch.float32)
        timesteps = self.scheduler.timesteps.to(self.device)
        solver = FlowODESolver(p.ode_solver)
        for step in rollout_steps(sigmas, timesteps, (0, 0), 1.0, self.scheduler.config.num_train_timesteps):
            t = step.timestep.expand(len(prompts))
            velocity = self.adapter.predict_velocity(self.transformer, latents.to(self.dtype), t, embeds,
                                                     p.guidance_scale, negative, height, width).float()
            latents = solver.step(latents, velocity, step.sigma, step.sigma_next, final=step.final)
        pixels = self.adapter.decode(latents.to(self.dtype), height, width)
        array = (pixels.float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
        return [Image.fromarray(a) for a in array]


__all__ = [
    "LORA_WEIGHTS_NAME", "ImageGenerator", "check_model", "check_text_to_image_family", "load_lora", "load_pipeline",
    "load_transformer",
    "looks_like_local_path", "torch_dtype",
]
