"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 / 2511): Qwen-Image-Edit with several source images per prompt.

* The ``image`` column holds one image or a list of images per row (every row of a batch the same number); each is
  resized to the working resolution ``height`` x ``width`` (the stock pipeline resizes the vision encoder's copy to
  about 384^2 and the VAE's to about 1024^2 whatever the output size, which dominates a small run's cost on a CPU).
* Text: the prompt follows one ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` per source image in the edit
  template; Qwen2.5-VL sees them all, and the template's system part (64 tokens) is dropped. The stock pipeline
  encodes one prompt per call; so does this adapter, then pads the rows to the longest with a mask. The negative
  prompt is encoded with each row's images too (``negative_depends_on_image``).
* Every source image's VAE latents (posterior mode, ``(z - mean) / std``) are packed and appended after the target,
  in order; ``img_shapes`` lists the target grid and one grid per source; the velocity is the target part.
* Schedule, true CFG with norm rescaling, and decoding as Qwen-Image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import PromptEmbeds
from .profile import ModelConfigs, Published
from .qwenimage_edit import QwenImageEditAdapter


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    family = "qwenimage_edit_plus"
    pipeline_class_names = ("QwenImageEditPlusPipeline",)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(40, 4.0, "Qwen-Image-Edit-2509 / -2511 model cards (40 steps, true_cfg_scale 4.0)")

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """Per row: the prompt embedding computed with that row's source images (padded to the batch's longest, with
        ``prompt_embeds_mask``) and ``image_latents``, the row's sources packed one after the other."""
        self._check_length(max_sequence_length)
        rows = [list(im) if isinstance(im, (list, tuple)) else [im]
                for im in self._require_images(prompts, images, height, width)]
        counts = sorted({len(r) for r in rows})
        if len(counts) != 1:
            raise ValueError(f"Qwen-Image-Edit-Plus samples of one batch need the same number of source images, got "
                             f"{[len(r) for r in rows]}; give every row of the 'image' column as many.")
        texts, latents = [], []
        for prompt, row in zip(prompts, rows):
            resized = self._resize_images(row, height, width)
            embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], image=resized, device=device,
                                                    num_images_per_prompt=1, max_sequence_length=max_sequence_length)
            texts.append(embeds[0])
            latents.append(self._source_latents(resized, height, width, device, embeds.dtype).flatten(0, 1))
        longest = max(t.shape[0] for t in texts)
        prompt_embeds = torch.stack([torch.cat([t, t.new_zeros(longest - t.shape[0], t.shape[1])]) for t in texts])
        mask = torch.stack([torch.arange(longest, device=prompt_embeds.device) < t.shape[0] for t in texts]).long()
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "prompt_embeds_mask": mask,
                             "image_latents": torch.stack(latents)})
