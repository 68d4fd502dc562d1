"""The small interface every model family implements.

A family adapter hides what differs between flow-matching pipelines (prompt encoding, latent layout,
how the transformer is called, how latents are decoded) behind five methods, so the trainer is written
once. Adding a family (Qwen-Image, SANA, a video model) means one new file with one new adapter class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DiffusionPipeline


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts: a dict of tensors whose first dimension is the batch."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def index_select(self, index: torch.Tensor) -> PromptEmbeds:
        """Rows ``index`` (used to expand unique-prompt embeddings to the G samples of each group)."""
        return PromptEmbeds({k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()})

    def __getitem__(self, item: slice) -> PromptEmbeds:
        return PromptEmbeds({k: v[item] for k, v in self.tensors.items()})

    def to(self, *args: Any, **kwargs: Any) -> PromptEmbeds:
        return PromptEmbeds({k: v.to(*args, **kwargs) for k, v in self.tensors.items()})

    def expand_to(self, batch_size: int) -> PromptEmbeds:
        """Repeat a single-row embedding (e.g. the negative prompt) to ``batch_size`` rows."""
        return PromptEmbeds({k: v.expand(batch_size, *v.shape[1:]) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        keys = parts[0].tensors.keys()
        return PromptEmbeds({k: torch.cat([p.tensors[k] for p in parts], dim=0) for k in keys})


class ModelFamilyAdapter(ABC):
    """What the trainer needs from a text-to-image flow-matching pipeline.

    Latents handed around by the trainer are exactly what the family's transformer consumes (packed
    sequences for FLUX, 4-D maps for SD3); every SDE/log-prob computation reduces over all non-batch
    dimensions, so the layout does not matter to the algorithm.
    """

    family: str = ""
    pipeline_class_names: tuple[str, ...] = ()

    def __init__(self, pipeline: DiffusionPipeline):
        self.pipeline = pipeline

    @classmethod
    def supports(cls, pipeline: DiffusionPipeline) -> bool:
        return type(pipeline).__name__ in cls.pipeline_class_names

    # --- text -------------------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device) -> PromptEmbeds:
        """Encode each prompt once (no CFG duplication)."""

    # --- latents ----------------------------------------------------------------------------------
    @abstractmethod
    def prepare_latents(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | list[torch.Generator] | None,
        device: torch.device, dtype: torch.dtype,
    ) -> torch.Tensor:
        """Initial noise x_1 ~ N(0, I) in the transformer's latent layout."""

    @abstractmethod
    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        """Configure ``scheduler`` exactly as the family's pipeline does (shift / dynamic shift)."""

    # --- the transformer call ---------------------------------------------------------------------
    @abstractmethod
    def predict_velocity(
        self, transformer: Callable[..., Any], latents: torch.Tensor, timestep: torch.Tensor,
        embeds: PromptEmbeds, guidance_scale: float, negative_embeds: PromptEmbeds | None, height: int, width: int,
    ) -> torch.Tensor:
        """Velocity v (after classifier-free guidance or with the guidance embedding) for ``latents``.

        ``timestep`` is a 1-D tensor of per-sample timesteps on the scheduler's 0..1000 scale.
        """

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether ``guidance_scale`` means two transformer passes (true CFG) for this family."""
        return guidance_scale > 1.0

    # --- pixels -----------------------------------------------------------------------------------
    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Decode latents to images in [0, 1], shape (B, 3, H, W), float32."""

    # --- helpers shared by families ---------------------------------------------------------------
    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        latents = latents / vae.config.scaling_factor + shift
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
