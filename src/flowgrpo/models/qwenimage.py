"""Qwen-Image (text-to-image): an MMDiT on packed 2x2 latents, conditioned on a Qwen2.5-VL language model.

* Text: the prompt is wrapped in the pipeline's chat template, encoded by Qwen2.5-VL, and the template's system part
  (``prompt_template_encode_start_idx`` tokens) is dropped; prompts of one batch are padded to the longest, with a
  mask (``prompt_embeds_mask``, kept here as a tensor of ones when nothing is padded).
* Latents: ``(B, 1, C, h, w)`` noise packed 2x2 into ``(B, h/2 * w/2, 4C)``, as FLUX; the transformer also gets
  ``img_shapes = [[(1, h/2, w/2)]] * B`` and ``timestep / 1000``.
* Schedule: ``sigmas = linspace(1, 1/N, N)`` with the dynamic shift ``mu`` of the packed sequence length (the real
  checkpoints: exponential time shift, ``base_shift 0.5, max_shift 0.9, max_image_seq_len 8192,
  shift_terminal 0.02``).
* Guidance: "true CFG" with a negative prompt, two passes, then the result is rescaled to the conditional norm:
  ``v = c * ||v_c|| / ||c||`` with ``c = v_u + w (v_c - v_u)``, norms over the channel (last) dimension.
* Decode: unpack to ``(B, C, 1, H, W)``, ``x * std + mean`` per channel, ``vae.decode(...)[:, :, 0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds, packed_latent_size
from .profile import ModelConfigs, Published, TextRule, encoder_positions, smallest, vae_scale_factor_from_temporal

#: Longest prompt embedding the Qwen-Image pipelines accept.
QWEN_MAX_SEQUENCE_LENGTH = 1024
#: The length the Qwen-Image pipelines encode prompts to when called without one.
QWEN_DEFAULT_SEQUENCE_LENGTH = 512


class QwenImageAdapter(ModelFamilyAdapter):
    family = "qwenimage"
    pipeline_class_names = ("QwenImagePipeline",)
    # The last block's text-stream output is discarded: its weights (and LoRAs there) get no gradient.
    may_leave_weights_unused = True

    def __init__(self, pipeline, num_frames: int = 1):
        super().__init__(pipeline, num_frames)
        if pipeline.transformer.config.get("guidance_embeds", False):
            raise ValueError("This Qwen-Image transformer is guidance-distilled (guidance_embeds=True), which the Qwen-"
                             "Image pipelines of this diffusers version cannot run; use a checkpoint without it (the "
                             "released Qwen-Image models have guidance_embeds=False and use true CFG).")

    @classmethod
    def _vae_scale_factor(cls, configs: ModelConfigs) -> int:
        return vae_scale_factor_from_temporal(configs.config("vae"))

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        limit, why = smallest(
            (QWEN_MAX_SEQUENCE_LENGTH, "the longest prompt the Qwen-Image pipelines accept"),
            (encoder_positions(configs.config("text_encoder")), "the text encoder's max_position_embeddings"))
        return TextRule(min(QWEN_DEFAULT_SEQUENCE_LENGTH, limit or QWEN_DEFAULT_SEQUENCE_LENGTH),
                        f"{configs.pipeline_class}'s call default", limit, why)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(50, 4.0, "Qwen-Image model card (50 steps, true_cfg_scale 4.0)")

    @classmethod
    def _guidance_kind(cls, configs: ModelConfigs) -> tuple[str, str]:
        return "cfg", "true classifier-free guidance with the negative prompt (true_cfg_scale)"

    # --- conditioning -----------------------------------------------------------------------------
    @staticmethod
    def _check_length(max_sequence_length: int) -> None:
        if max_sequence_length > QWEN_MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length} is more than the Qwen-Image pipelines accept "
                             f"({QWEN_MAX_SEQUENCE_LENGTH}); lower it.")

    @staticmethod
    def _with_mask(prompt_embeds: torch.Tensor, mask: torch.Tensor | None) -> PromptEmbeds:
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "prompt_embeds_mask": mask})

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        self._check_length(max_sequence_length)
        prompt_embeds, mask = self.pipeline.encode_prompt(prompt=list(prompts), device=device, num_images_per_prompt=1,
                                                          max_sequence_length=max_sequence_length)
        return self._with_mask(prompt_embeds, mask)

    # --- latents ----------------------------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return packed_latent_size(self.pipeline.vae_scale_factor, height, width)

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        channels = self.pipeline.transformer.config.in_channels // 4
        noise = randn_tensor((batch_size, 1, channels, h, w), generator=generator, device=device, dtype=dtype)
        return self.pipeline._pack_latents(noise, batch_size, channels, h, w)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        h, w = self._latent_hw(height, width)
        config = scheduler.config
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)

    # --- the transformer call ---------------------------------------------------------------------
    def _img_shapes(self, batch_size: int, height: int, width: int, sources: int = 0) -> list:
        """Token grids of each sample's sequence: the target, then ``sources`` source images of the working size."""
        h, w = self._latent_hw(height, width)
        return [[(1, h // 2, w // 2)] * (1 + sources)] * batch_size

    def _hidden_states(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return latents

    @staticmethod
    def _mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
        """The mask as the pipeline passes it: ``None`` when every text token is valid."""
        return None if bool(mask.all()) else mask

    def _pass(self, transformer, hidden, timestep, text: dict[str, torch.Tensor], img_shapes, n_target: int):
        out = transformer(hidden_states=hidden, timestep=timestep / 1000, guidance=None,
                          encoder_hidden_states_mask=self._mask_or_none(text["prompt_embeds_mask"]),
                          encoder_hidden_states=text["prompt_embeds"], img_shapes=img_shapes, return_dict=False)[0]
        return out[:, :n_target]

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        hidden = self._hidden_states(latents, cond)
        n = latents.shape[1]
        img_shapes = self._img_shapes(latents.shape[0], height, width, sources=(hidden.shape[1] - n) // n)
        v_cond = self._pass(transformer, hidden, timestep, cond, img_shapes, n)
        if not self.uses_cfg(guidance_scale):
            return v_cond
        if negative_embeds is None:
            raise ValueError("guidance_scale > 1 (true CFG) needs negative prompt embeddings for Qwen-Image")
        v_uncond = self._pass(transformer, hidden, timestep, negative_embeds.tensors, img_shapes, n)
        combined = v_uncond + guidance_scale * (v_cond - v_uncond)
        cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        return int(self._hidden_states(latents, embeds.tensors).shape[1]), int(embeds.tensors["prompt_embeds"].shape[1])

    # --- pixels -----------------------------------------------------------------------------------
    def _denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """``x * std + mean`` per latent channel (latents ``(B, C, F, h, w)``)."""
        vae = self.pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        unpacked = self._denormalize(unpacked.to(vae.dtype))
        image = vae.decode(unpacked, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
