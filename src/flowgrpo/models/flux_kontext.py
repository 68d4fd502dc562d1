"""FLUX.1 Kontext (image editing): FLUX.1 with the source image's latents appended to the token sequence.

The source image is resized to the working resolution (``height`` x ``width``) by the pipeline's image processor and
encoded by the VAE (the mode of its posterior, as the pipeline does), ``(z - shift_factor) * scaling_factor``, then
packed 2x2 like the target. Each call sees ``[target tokens, source tokens]`` with position ids whose first axis is 0
for the target and 1 for the source; the velocity is the output's target part. The dynamic shift ``mu`` is computed
from the target tokens only, and guidance is the FLUX.1-dev embedding (one pass), as in ``FluxKontextPipeline``.

The stock pipeline resizes the source to about 1024^2 (``max_area``) and then to a preferred Kontext size
(``_auto_resize``); ``max_area=H*W, _auto_resize=False`` makes it encode at the working size too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

from .base import PromptEmbeds
from .flux import FluxAdapter
from .profile import ModelConfigs, Published


class FluxKontextAdapter(FluxAdapter):
    family = "flux_kontext"
    pipeline_class_names = ("FluxKontextPipeline",)
    accepts_images = True

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(28, 2.5, "FLUX.1 Kontext [dev] model card and FluxKontextPipeline's example (28 steps, "
                                  "guidance 2.5)")

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """Text conditioning as FLUX.1, plus ``image_latents`` (packed source latents) when ``images`` are given.

        Without images (the negative prompt) only the text is encoded: the source tokens of a CFG pass are the
        conditional sample's.
        """
        embeds = super().encode_prompts(prompts, max_sequence_length, device)
        if images is None:
            return embeds
        images = self._require_images(prompts, images, height, width)
        vae = self.pipeline.vae
        pixels = self._preprocess_images(images, height, width, device, vae.dtype)
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        b, c, h, w = latents.shape
        embeds.tensors["image_latents"] = self.pipeline._pack_latents(latents, b, c, h, w).to(
            embeds.tensors["prompt_embeds"].dtype)
        return embeds

    def _transformer_inputs(self, latents: torch.Tensor, cond: dict[str, torch.Tensor], height: int,
                            width: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, target_ids = self._ids(cond, height, width)
        if "image_latents" not in cond:
            raise ValueError("FLUX.1 Kontext samples need their source image: encode the prompts with images=.")
        source_ids = target_ids.clone()
        source_ids[..., 0] = 1
        hidden = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        return hidden, torch.cat([target_ids, source_ids], dim=0)

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        source = int(embeds.tensors["image_latents"].shape[1]) if "image_latents" in embeds.tensors else 0
        return int(latents.shape[1]) + source, int(embeds.tensors["prompt_embeds"].shape[1])
