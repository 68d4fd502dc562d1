"""Z-Image (Turbo and base): a single-stream DiT over one sequence of image and text tokens, conditioned on Qwen3.

* Text: the prompt in Qwen3's chat template (thinking enabled: no empty thinking block) is encoded by the Qwen3
  model; the second-to-last hidden state of the valid tokens is the caption. The pipeline hands the transformer one
  variable-length tensor per prompt; here prompts are kept padded to ``max_sequence_length`` with their mask
  (``prompt_embeds_mask``) and cut back to their valid tokens for each call, so rows from any batch stack.
* Latents: plain 4-D VAE latents ``(B, 16, H/8, W/8)`` (the transformer patchifies 2x2 itself); each call sees a list
  of ``(16, 1, h, w)`` tensors.
* Time: the transformer is trained on the reversed clock, ``t' = (1000 - t) / 1000`` (0 = noise), and predicts
  ``x_0 - x_1``, the negative of the velocity the scheduler integrates: ``v = -output``.
* Guidance: ``guidance_scale > 0`` means CFG in Z-Image's form ``v = v_c + w (v_c - v_u)`` (``w = 0``: one pass, as
  Z-Image Turbo is sampled); both passes run as one batch, as in the pipeline. The pipeline's optional
  ``cfg_normalization`` and ``cfg_truncation`` are off by default and not used here.
* Schedule: ``sigmas = linspace(1, 1/N, N)`` with the scheduler's own shift (Turbo: static ``shift = 3``; a dynamic
  shift takes ``mu`` from the token count as FLUX.1).
* Decode: ``x / scaling_factor + shift_factor``, ``vae.decode`` (the FLUX.1 VAE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, TextRule, encoder_positions

#: Z-Image's attention projections (``attention.to_q/k/v``, ``attention.to_out.0``) and its SwiGLU feed-forward
#: (``feed_forward.w1/w2/w3``), in the main, noise-refiner and context-refiner blocks alike.
ZIMAGE_LORA_TARGET_MODULES = (
    "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)


class ZImageAdapter(ModelFamilyAdapter):
    family = "zimage"
    pipeline_class_names = ("ZImagePipeline",)
    default_lora_target_modules = ZIMAGE_LORA_TARGET_MODULES
    sequence_parallel_refusal = (
        "Z-Image's transformer (ZImageTransformer2DModel) has no context-parallel plan in diffusers 0.42.1: it pads "
        "its text and image tokens into one unified sequence inside the forward, which no split of its inputs can "
        "follow; a Z-Image image fits on one GPU: train it data-parallel.")

    cfg_off_value = 0.0

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Z-Image's pipeline guides whenever ``guidance_scale > 0`` (``v_c + w (v_c - v_u)``)."""
        return guidance_scale > 0.0

    # --- generation settings from the component configs -------------------------------------------
    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        return 1024, 1024, "ZImagePipeline's call default (1024 x 1024)"

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        limit = encoder_positions(configs.config("text_encoder"))
        return TextRule(min(512, limit or 512), "ZImagePipeline's call default", limit,
                        "the Qwen3 encoder's max_position_embeddings" if limit else "")

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        if configs.name_has("turbo"):
            return Published(8, 0.0, "Z-Image-Turbo model card and ZImagePipeline's example (8 transformer passes, "
                                     "guidance 0)", distilled=True)
        return Published(50, 5.0, "ZImagePipeline's call defaults (50 steps, guidance 5.0)")

    @classmethod
    def _guidance_kind(cls, configs: ModelConfigs) -> tuple[str, str]:
        return "cfg", "classifier-free guidance v_c + w (v_c - v_u) whenever guidance_scale > 0"

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        # The pipeline's encoder rewrites the list it is given in place: hand it a copy.
        captions = self.pipeline._encode_prompt(prompt=list(prompts), device=device,
                                                max_sequence_length=max_sequence_length)
        dim = captions[0].shape[-1]
        embeds = captions[0].new_zeros(len(captions), max_sequence_length, dim)
        mask = torch.zeros(len(captions), max_sequence_length, dtype=torch.long, device=embeds.device)
        for i, caption in enumerate(captions):
            embeds[i, : caption.shape[0]] = caption
            mask[i, : caption.shape[0]] = 1
        return PromptEmbeds({"prompt_embeds": embeds, "prompt_embeds_mask": mask})

    @staticmethod
    def _captions(text: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [e[m.bool()] for e, m in zip(text["prompt_embeds"], text["prompt_embeds_mask"])]

    # --- latents ----------------------------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        scale = self.pipeline.vae_scale_factor
        return 2 * (height // (scale * 2)), 2 * (width // (scale * 2))

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        channels = self.pipeline.transformer.config.in_channels
        return randn_tensor((batch_size, channels, h, w), generator=generator, device=device, dtype=dtype)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        h, w = self._latent_hw(height, width)
        config = scheduler.config
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        sigmas = torch.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()
        scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)

    # --- the transformer call ---------------------------------------------------------------------
    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        batch = latents.shape[0]
        captions = self._captions(embeds.tensors)
        model_latents, t = latents, timestep
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            if negative_embeds is None:
                raise ValueError("guidance_scale > 0 (CFG) needs negative prompt embeddings for Z-Image")
            captions = captions + self._captions(negative_embeds.tensors)
            model_latents, t = latents.repeat(2, 1, 1, 1), timestep.repeat(2)
        out = transformer(list(model_latents.unsqueeze(2).unbind(0)), (1000 - t) / 1000, captions,
                          return_dict=False)[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if cfg:
            pos, neg = out[:batch], out[batch:]
            out = pos + guidance_scale * (pos - neg)
        return -out  # float32, as the pipeline hands it to the scheduler

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        text = int(embeds.tensors["prompt_embeds_mask"].sum(dim=1).max())
        return int(latents.shape[2] // 2 * latents.shape[3] // 2), text

    # --- pixels -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self._vae_decode(latents)
