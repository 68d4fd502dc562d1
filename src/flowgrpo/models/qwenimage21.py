"""Qwen-Image 2.1 (text-to-image): a single-stream, block-causal transformer over one sequence of text and latent
tokens, conditioned on Qwen3-VL.

* Text: the prompt in the pipeline's raw template is encoded by Qwen3-VL (the last decoder layer's output, before the
  final norm); the system turn's tokens are dropped. Prompts of a batch are padded to the longest, with a mask
  (``prompt_embeds_mask``, ones when nothing is padded) and ``image_pad_mask`` (no image slots in text-to-image).
  The embedding is not truncated to ``max_sequence_length``, as in the stock pipeline.
* Latents: ``(B, 1, C, h, w)`` noise at 1/16 of the image size (the VAE compresses 16x; no 2x2 packing), flattened to
  ``(B, h * w, C)``. The transformer sees ``[text, target]`` with ``img_mask`` marking one slot per 2x2 group of
  target tokens; text and target attend causally block by block, and with ``causal_condition`` the text is
  modulated from ``t = 0``. The velocity is the output's last ``h * w`` tokens.
* Schedule: ``sample_sigmas`` from the pipeline's config (the model author's grid; the stock pipeline samples exactly
  it, whatever ``num_inference_steps``) when set: the same grid for as many steps, resampled along its index for
  another step count; else ``linspace(1, 1/N, N)``; the dynamic shift ``mu`` of the ``h * w`` tokens (exponential).
* Guidance: true CFG with the negative prompt, ``v = v_u + w (v_c - v_u)`` for ``w > 1`` (two passes; no norm
  rescaling, unlike Qwen-Image).
* Decode: ``x * std + mean`` per channel, ``vae.decode`` of ``(B, C, 1, h, w)``. The released VAE decodes RGBA; the
  rewards get the RGB channels.

The stock pipeline caches the text's keys and values after the first step (``use_kv_cache``); the adapter
recomputes them at every call, which gives the same velocity (the text does not depend on the timestep) and keeps
every call independent, as training needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, SizeRule, TextRule

#: The attention projections of Qwen-Image 2.1's single-stream blocks.
QWENIMAGE21_LORA_TARGET_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")

#: Latent tokens behind one image slot of the vision-language sequence (a 2x2 group).
_TOKENS_PER_SLOT = 4

#: QwenImage21Pipeline's fixed VAE factor and its side when called without a size (``output_resolution``).
QWENIMAGE21_VAE_FACTOR, QWENIMAGE21_OUTPUT_RESOLUTION = 16, 1024


class QwenImage21Adapter(ModelFamilyAdapter):
    family = "qwenimage21"
    pipeline_class_names = ("QwenImage21Pipeline",)
    default_lora_target_modules = QWENIMAGE21_LORA_TARGET_MODULES
    sequence_parallel_refusal = (
        "Qwen-Image 2.1's transformer (QwenImage21Transformer2DModel) has no context-parallel plan in diffusers "
        "0.42.1, and its block-causal attention masks (text and image blocks in one sequence) are not split with "
        "the tokens; train it data-parallel.")

    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        side = QWENIMAGE21_OUTPUT_RESOLUTION
        return side, side, f"QwenImage21Pipeline's output_resolution {side}"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        factor = QWENIMAGE21_VAE_FACTOR
        return SizeRule(factor * 2, f"VAE factor {factor} x 2, one image slot per 2x2 latent tokens")

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        return TextRule(512, "not read by Qwen-Image 2.1 (its prompts are encoded whole, as in the stock pipeline); "
                             "the length the planner assumes", used=False)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        grid = configs.pipeline_config.get("sample_sigmas")
        if grid:
            return Published(len(grid), 1.0, f"the pipeline's sample_sigmas ({len(grid)} steps, the author's grid) "
                                             "and QwenImage21Pipeline's call default true_cfg_scale 1.0 (no guidance)")
        return Published(40, 1.0, "QwenImage21Pipeline's call defaults (40 steps, true_cfg_scale 1.0: no guidance)")

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        prompt_embeds, mask, image_pad_mask = self.pipeline.encode_prompt(prompt=list(prompts), device=device,
                                                                          num_images_per_prompt=1)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "prompt_embeds_mask": mask.long(),
                             "image_pad_mask": image_pad_mask.long()})

    # --- latents ----------------------------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        scale = self.pipeline.vae_scale_factor
        return 2 * (height // (scale * 2)), 2 * (width // (scale * 2))

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        channels = self.pipeline.transformer.config.in_channels
        noise = randn_tensor((batch_size, 1, channels, h, w), generator=generator, device=device, dtype=dtype)
        return self.pipeline._pack_latents(noise, batch_size, channels, h, w)

    def sample_sigmas(self, num_inference_steps: int) -> list[float]:
        """The sampling grid of ``num_inference_steps`` steps.

        With the pipeline's ``sample_sigmas`` (the model author's grid of K values, K steps): exactly that grid when
        ``num_inference_steps == K``, as the stock pipeline samples; otherwise the same curve resampled to N points,
        ``sigma(i) = interp(i (K - 1) / (N - 1))`` along the grid's index (a few-step training grid and a longer
        evaluation grid of the same shape; the stock pipeline itself ignores ``num_inference_steps`` then). Without
        them: ``linspace(1, 1/N, N)``, as the pipeline.
        """
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps}; Qwen-Image 2.1 needs at least one step.")
        configured = self.pipeline.config.get("sample_sigmas", None)
        if configured is None:
            return np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()
        configured = [float(s) for s in configured]
        if len(configured) == num_inference_steps:
            return configured
        positions = np.linspace(0, len(configured) - 1, num_inference_steps)
        return np.interp(positions, np.arange(len(configured)), configured).tolist()

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        h, w = self._latent_hw(height, width)
        config = scheduler.config
        mu = calculate_shift(h * w, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler.set_timesteps(device=device, sigmas=self.sample_sigmas(num_inference_steps), mu=mu)

    # --- the transformer call ---------------------------------------------------------------------
    @staticmethod
    def _mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
        """The mask as the pipeline passes it: ``None`` when every text token is valid."""
        return None if bool(mask.all()) else mask

    def _pass(self, transformer, latents, timestep, text: dict[str, torch.Tensor], height: int, width: int):
        h, w = self._latent_hw(height, width)
        batch, n = latents.shape[:2]
        img_mask = torch.cat([text["image_pad_mask"].bool(),
                              torch.ones(batch, n // _TOKENS_PER_SLOT, dtype=torch.bool, device=latents.device)], dim=1)
        mask = text["prompt_embeds_mask"]
        out = transformer(hidden_states=latents, timestep=timestep / 1000, encoder_hidden_states=text["prompt_embeds"],
                          encoder_hidden_states_mask=self._mask_or_none(mask),
                          img_shapes=[[(1, h // 1, w // 1)]] * batch, img_mask=img_mask, return_dict=False)[0]
        return out[:, -n:]

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        v_cond = self._pass(transformer, latents, timestep, embeds.tensors, height, width)
        if not self.uses_cfg(guidance_scale):
            return v_cond
        if negative_embeds is None:
            raise ValueError("guidance_scale > 1 (true CFG) needs negative prompt embeddings for Qwen-Image 2.1")
        v_uncond = self._pass(transformer, latents, timestep, negative_embeds.tensors, height, width)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        return int(latents.shape[1]), int(embeds.tensors["prompt_embeds"].shape[1])

    # --- pixels -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        unpacked = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(unpacked.device, unpacked.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(unpacked.device, unpacked.dtype)
        image = vae.decode((unpacked * std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]
        return (image[:, :3].float() / 2 + 0.5).clamp(0, 1)
