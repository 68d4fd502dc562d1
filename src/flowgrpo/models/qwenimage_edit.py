"""Qwen-Image-Edit (image editing): Qwen-Image with the source image in the prompt encoder and in the sequence.

* The source image is resized to the working resolution ``height`` x ``width`` (the stock pipeline resizes it to
  about 1024^2 whatever the output size, which dominates a small run's cost on a CPU and changes nothing a
  reward sees).
* Text: the edit template holds the image (``<|vision_start|><|image_pad|><|vision_end|>``); Qwen2.5-VL sees
  the prompt together with the image through the pipeline's ``Qwen2VLProcessor``, and the template's system part
  (64 tokens) is dropped. The embedding depends on the image, so the negative prompt is encoded once per source
  image too (``negative_depends_on_image``).
* The source image's VAE latents (posterior mode, ``(z - mean) / std``) are packed like the target and appended
  to it; ``img_shapes`` lists the target and the source grid; the velocity is the output's target part.
* Schedule, true CFG with norm rescaling, and decoding as Qwen-Image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

from .base import PromptEmbeds
from .profile import ModelConfigs, Published
from .qwenimage import QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwenimage_edit"
    pipeline_class_names = ("QwenImageEditPipeline",)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(50, 4.0, "Qwen-Image-Edit model card (50 steps, true_cfg_scale 4.0)")
    accepts_images = True
    negative_depends_on_image = True

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """Prompt embeddings computed with the source images, plus the packed source latents ``image_latents``.

        Like the stock edit pipeline, the embedding is not truncated to ``max_sequence_length`` (its image tokens
        are part of it); the limit is still checked.
        """
        self._check_length(max_sequence_length)
        images = self._require_images(prompts, images, height, width)
        pipe = self.pipeline
        resized = self._resize_images(images, height, width)
        prompt_embeds, mask = pipe.encode_prompt(prompt=list(prompts), image=resized, device=device,
                                                 num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        embeds = self._with_mask(prompt_embeds, mask)
        embeds.tensors["image_latents"] = self._source_latents(resized, height, width, device, prompt_embeds.dtype)
        return embeds

    def _source_latents(self, resized: list[Any], height: int, width: int, device: torch.device,
                        dtype: torch.dtype) -> torch.Tensor:
        """Source images (already at the working size) as packed, normalised VAE latents ``(B, h/2 * w/2, 4C)``:
        the posterior mode, ``(z - mean) / std`` per channel."""
        pipe = self.pipeline
        vae = pipe.vae
        pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2).to(device=device, dtype=dtype)
        latents = retrieve_latents(vae.encode(pixels.to(vae.dtype)), sample_mode="argmax")
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) / std
        b, c, _, h, w = latents.shape
        return pipe._pack_latents(latents, b, c, h, w).to(dtype)

    def _hidden_states(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        if "image_latents" not in cond:
            raise ValueError("Qwen-Image-Edit samples need their source image: encode the prompts with images=.")
        return torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
