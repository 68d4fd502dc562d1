"""FLUX.2 [dev] and FLUX.2 [klein]: packed latent sequences with 4-D position ids, one language model's hidden states
as the text conditioning, and optional reference images appended to the sequence.

* Text: FLUX.2 [dev] reads Mistral Small 3.1 (``Mistral3ForConditionalGeneration``, the hidden states after layers
  10, 20 and 30), [klein] Qwen3 (after layers 9, 18 and 27); the three are stacked along the channels. Prompts are
  padded to ``max_sequence_length`` and the transformer attends over the padding (no mask), as in the pipelines. Text
  position ids are ``(0, 0, 0, l)``.
* Latents: the VAE's latents are patchified 2x2 (``4C`` channels at half the latent size) and normalised by the
  VAE's batch-norm statistics; noise ``(B, 4C, h/2, w/2)`` is packed to ``(B, h/2 * w/2, 4C)`` (no further 2x2 packing
  as in FLUX.1). Image position ids are ``(0, y, x, 0)``.
* Schedule: ``sigmas = linspace(1, 1/N, N)`` with ``mu = compute_empirical_mu(tokens, N)``: the shift depends on the
  number of steps too.
* Guidance: [dev] is guidance-distilled: ``guidance_scale`` goes to the guidance embedding, one pass. [klein] has no
  guidance embedding: the base models use CFG with the empty prompt, ``v = v_u + w (v_c - v_u)`` for ``w > 1``
  (two passes); the step-distilled models (``is_distilled`` in the pipeline's config) take one pass whatever ``w``.
* Reference images (the ``image`` column, optional: one image or a list per row): each is resized to the working
  resolution, encoded like the latents (posterior mode, patchified, normalised), packed and appended to the sequence
  with position ids ``(10 (k + 1), y, x, 0)`` for the k-th reference; the velocity is the target part of the output.
  The stock pipelines use the same references for every prompt of a call and keep each at its own size (capped to
  1024^2): pass images of the working size to make them encode the same pixels.
* Decode: unpack, ``x * std + mean`` with the batch-norm statistics, unpatchify, ``vae.decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, TextRule, encoder_positions

#: LoRA targets of FLUX.2: the attention projections of the double-stream blocks (as FLUX.1) and the fused
#: query/key/value/MLP input projection of the single-stream blocks (``attn.to_qkv_mlp_proj``), which hold most of the
#: model (FLUX.2 [dev]: 8 double- and 48 single-stream blocks; [klein] 4B: 5 and 20).
FLUX2_LORA_TARGET_MODULES = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v", "attn.to_qkv_mlp_proj",
)


class Flux2Adapter(ModelFamilyAdapter):
    family = "flux2"
    pipeline_class_names = ("Flux2Pipeline",)
    accepts_images = True
    images_optional = True
    default_lora_target_modules = FLUX2_LORA_TARGET_MODULES

    @property
    def _guidance_embeds(self) -> bool:
        return bool(self.pipeline.transformer.config.get("guidance_embeds", False))

    @property
    def is_distilled(self) -> bool:
        """A step-distilled FLUX.2 [klein] (the pipeline's ``is_distilled``): sampled without CFG."""
        return bool(self.pipeline.config.get("is_distilled", False))

    def uses_cfg(self, guidance_scale: float) -> bool:
        return (not self._guidance_embeds) and (not self.is_distilled) and guidance_scale > 1.0

    # --- generation settings from the component configs -------------------------------------------
    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        """512 tokens, the pipelines' default; no longer than the language model's positions (which also hold the
        chat template's system turn)."""
        limit = encoder_positions(configs.config("text_encoder"))
        return TextRule(min(512, limit or 512), f"{configs.pipeline_class}'s default", limit,
                        "the text encoder's max_position_embeddings" if limit else "")

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(50, 4.0, "FLUX.2 [dev] model card (50 steps, guidance 4)")

    @classmethod
    def _guidance_kind(cls, configs: ModelConfigs) -> tuple[str, str]:
        if configs.config("transformer").get("guidance_embeds", False):
            return "embedded", "a guidance embedding (guidance-distilled: one pass, no negative prompt)"
        if _klein_distilled(configs):
            return "ignored", "a step-distilled FLUX.2 [klein] (is_distilled): one pass at any guidance, as its pipeline"
        return "cfg", "classifier-free guidance against the negative prompt"

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """``prompt_embeds`` (padded to ``max_sequence_length``), plus ``image_latents`` (the packed reference images,
        every row the same number of them) when ``images`` are given."""
        prompt_embeds, _text_ids = self.pipeline.encode_prompt(
            prompt=list(prompts), device=device, num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        embeds = PromptEmbeds({"prompt_embeds": prompt_embeds})
        if images is not None:
            references = [list(im) if isinstance(im, (list, tuple)) else [im]
                          for im in self._require_images(prompts, images, height, width)]
            counts = {len(r) for r in references}
            if len(counts) != 1 or 0 in counts:
                raise ValueError(f"FLUX.2 samples of one batch need the same number of reference images, got "
                                 f"{sorted(len(r) for r in references)}; give every row of the 'image' column as many.")
            embeds.tensors["image_latents"] = torch.stack(
                [self._encode_references(refs, height, width, device) for refs in references]).to(prompt_embeds.dtype)
        return embeds

    def _encode_references(self, references: list[Any], height: int, width: int,
                           device: torch.device) -> torch.Tensor:
        """One row's reference images, encoded and packed: ``(n * h/2 * w/2, 4C)``."""
        vae = self.pipeline.vae
        pixels = self._preprocess_images(references, height, width, device, vae.dtype)
        latents = self.pipeline._encode_vae_image(pixels, generator=None)  # (n, 4C, h/2, w/2), normalised
        return self.pipeline._pack_latents(latents).flatten(0, 1)

    # --- latents ----------------------------------------------------------------------------------
    def _token_grid(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of image tokens: the latent size halved (one token per 2x2 latent patch)."""
        scale = self.pipeline.vae_scale_factor
        return height // (scale * 2), width // (scale * 2)

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        rows, cols = self._token_grid(height, width)
        channels = self.pipeline.transformer.config.in_channels
        noise = randn_tensor((batch_size, channels, rows, cols), generator=generator, device=device, dtype=dtype)
        return self.pipeline._pack_latents(noise)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        rows, cols = self._token_grid(height, width)
        sigmas = None
        if not scheduler.config.get("use_flow_sigmas", False):
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        mu = compute_empirical_mu(image_seq_len=rows * cols, num_steps=num_inference_steps)
        scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)

    # --- the transformer call ---------------------------------------------------------------------
    def _position_ids(self, batch_size: int, text_tokens: int, height: int, width: int, references: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Text ids ``(B, L, 4)`` and image ids ``(B, N, 4)``: the target grid, then each reference's grid."""
        rows, cols = self._token_grid(height, width)
        grid = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.arange(1))
        parts = [grid]
        for k in range(references):
            ref = grid.clone()
            ref[:, 0] = 10 + 10 * k
            parts.append(ref)
        img_ids = torch.cat(parts).to(device).unsqueeze(0).expand(batch_size, -1, -1)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text_tokens))
        return txt_ids.to(device).unsqueeze(0).expand(batch_size, -1, -1), img_ids

    def _pass(self, transformer, hidden, timestep, prompt_embeds, guidance, txt_ids, img_ids, n_target: int):
        out = transformer(hidden_states=hidden, timestep=timestep / 1000, guidance=guidance,
                          encoder_hidden_states=prompt_embeds, txt_ids=txt_ids, img_ids=img_ids,
                          return_dict=False)[0]
        return out[:, :n_target]

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        batch, n_target = latents.shape[:2]
        hidden = latents
        references = 0
        if "image_latents" in cond:
            hidden = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
            references = cond["image_latents"].shape[1] // n_target
        txt_ids, img_ids = self._position_ids(batch, cond["prompt_embeds"].shape[1], height, width, references,
                                              latents.device)
        guidance = None
        if self._guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=latents.device, dtype=torch.float32)
        v_cond = self._pass(transformer, hidden, timestep, cond["prompt_embeds"], guidance, txt_ids, img_ids,
                            n_target)
        if not self.uses_cfg(guidance_scale):
            return v_cond
        if negative_embeds is None:
            raise ValueError("guidance_scale > 1 (CFG) needs negative prompt embeddings for a FLUX.2 [klein] base model")
        neg = negative_embeds.tensors["prompt_embeds"]
        txt_ids_neg, _ = self._position_ids(batch, neg.shape[1], height, width, references, latents.device)
        v_uncond = self._pass(transformer, hidden, timestep, neg, guidance, txt_ids_neg, img_ids, n_target)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        references = int(embeds.tensors["image_latents"].shape[1]) if "image_latents" in embeds.tensors else 0
        return int(latents.shape[1]) + references, int(embeds.tensors["prompt_embeds"].shape[1])

    # --- pixels -----------------------------------------------------------------------------------
    def unpack_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed, normalised latents ``(B, N, 4C)`` -> the VAE's latents ``(B, C, h, w)``."""
        rows, cols = self._token_grid(height, width)
        vae = self.pipeline.vae
        patched = latents.reshape(latents.shape[0], rows, cols, -1).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patched.device, patched.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patched.device,
                                                                                              patched.dtype)
        return self.pipeline._unpatchify_latents(patched * std + mean)

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        image = vae.decode(self.unpack_latents(latents, height, width).to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def _klein_distilled(configs: ModelConfigs) -> bool:
    """A step-distilled FLUX.2 [klein]: its pipeline's ``is_distilled``; without ``model_index.json`` (a packaged
    planner config), a [klein] checkpoint whose name does not say "base" (``FLUX.2-klein-4B`` is distilled,
    ``FLUX.2-klein-base-4B`` is not)."""
    if "is_distilled" in configs.pipeline_config:
        return bool(configs.pipeline_config["is_distilled"])
    return configs.pipeline_class == "Flux2KleinPipeline" and configs.name_has("klein") and not configs.name_has("base")


class Flux2KleinAdapter(Flux2Adapter):
    family = "flux2_klein"
    pipeline_class_names = ("Flux2KleinPipeline",)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        if _klein_distilled(configs):
            return Published(4, 1.0, "FLUX.2 [klein] 4B / 9B model cards (step-distilled: 4 steps, guidance 1.0)",
                             distilled=True)
        return Published(50, 4.0, "FLUX.2 [klein] base model cards and Flux2KleinPipeline's example (50 steps, "
                                  "guidance 4.0)")
