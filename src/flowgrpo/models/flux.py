"""FLUX.1 (dev / schnell style): packed 2x2 latent sequences, CLIP pooled + T5 sequence conditioning.

Guidance: a guidance-distilled transformer (``guidance_embeds=True``, FLUX.1-dev) receives ``guidance_scale``
as an embedding and needs one pass; otherwise ``guidance_scale > 1`` means true CFG with the negative prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds, packed_latent_size
from .profile import ModelConfigs, Published, TextRule, sane_length, smallest

#: The longest T5 prompt the FLUX.1 pipelines accept (their ``check_inputs``), also their default.
FLUX_MAX_SEQUENCE_LENGTH = 512


class FluxAdapter(ModelFamilyAdapter):
    family = "flux"
    pipeline_class_names = ("FluxPipeline",)
    encodes_images = True

    def _latents_layout(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return self.pipeline._pack_latents(latents, b, c, h, w)

    @property
    def _guidance_embeds(self) -> bool:
        return bool(self.pipeline.transformer.config.get("guidance_embeds", False))

    def uses_cfg(self, guidance_scale: float) -> bool:
        return (not self._guidance_embeds) and guidance_scale > 1.0

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        limit, why = smallest(
            (FLUX_MAX_SEQUENCE_LENGTH, f"the longest T5 prompt {configs.pipeline_class} accepts"),
            (sane_length(configs.config("tokenizer_2").get("model_max_length")), "the T5 tokenizer's model_max_length"))
        return TextRule(limit or FLUX_MAX_SEQUENCE_LENGTH, f"{configs.pipeline_class}'s T5 length", limit, why)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        if configs.config("transformer").get("guidance_embeds", False):
            return Published(50, 3.5, "FLUX.1 [dev] model card (50 steps, guidance 3.5)")
        return Published(4, 0.0, "FLUX.1 [schnell] model card (4 steps, guidance 0: no guidance embedding, "
                                 "timestep-distilled)", distilled=True)

    @classmethod
    def _guidance_kind(cls, configs: ModelConfigs) -> tuple[str, str]:
        if configs.config("transformer").get("guidance_embeds", False):
            return "embedded", "a guidance embedding (guidance-distilled: one pass, no negative prompt)"
        return super()._guidance_kind(configs)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        prompt_embeds, pooled, _text_ids = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=device, num_images_per_prompt=1,
            max_sequence_length=max_sequence_length,
        )
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled})

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return packed_latent_size(self.pipeline.vae_scale_factor, height, width)

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        channels = self.pipeline.transformer.config.in_channels // 4
        noise = randn_tensor((batch_size, channels, h, w), generator=generator, device=device, dtype=dtype)
        return self.pipeline._pack_latents(noise, batch_size, channels, h, w)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        h, w = self._latent_hw(height, width)
        seq_len = (h // 2) * (w // 2)
        mu = calculate_shift(
            seq_len, scheduler.config.get("base_image_seq_len", 256), scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5), scheduler.config.get("max_shift", 1.15),
        )
        sigmas = None
        if not scheduler.config.get("use_flow_sigmas", False):
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if scheduler.config.get("use_dynamic_shifting", False):
            scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)
        else:
            scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas)

    def _ids(self, embeds: dict[str, torch.Tensor], height: int, width: int):
        h, w = self._latent_hw(height, width)
        device, dtype = embeds["prompt_embeds"].device, embeds["prompt_embeds"].dtype
        img_ids = self.pipeline._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
        txt_ids = torch.zeros(embeds["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        return txt_ids, img_ids

    def _transformer_inputs(self, latents: torch.Tensor, cond: dict[str, torch.Tensor], height: int,
                            width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The image-token sequence the transformer sees and its position ids (FLUX.1: the target latents only)."""
        _, img_ids = self._ids(cond, height, width)
        return latents, img_ids

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        txt_ids, _ = self._ids(cond, height, width)
        hidden, img_ids = self._transformer_inputs(latents, cond, height, width)
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            if negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative prompt embeddings for a FLUX model without "
                                 "guidance embedding")
            neg = negative_embeds.tensors
            model_input = torch.cat([hidden, hidden])
            t = torch.cat([timestep, timestep])
            prompt_embeds = torch.cat([neg["prompt_embeds"], cond["prompt_embeds"]])
            pooled = torch.cat([neg["pooled_prompt_embeds"], cond["pooled_prompt_embeds"]])
        else:
            model_input, t = hidden, timestep
            prompt_embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        guidance = None
        if self._guidance_embeds:
            guidance = torch.full((model_input.shape[0],), float(guidance_scale), device=latents.device,
                                  dtype=torch.float32)
        out = transformer(hidden_states=model_input, timestep=t / 1000, guidance=guidance,
                          pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=txt_ids,
                          img_ids=img_ids, return_dict=False)[0]
        out = out[:, : latents.shape[1]]  # the target tokens (editing families append the source image's)
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        return out

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        return int(latents.shape[1]), int(embeds.tensors["prompt_embeds"].shape[1])

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        return self._vae_decode(unpacked)
