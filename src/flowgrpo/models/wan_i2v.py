"""Wan image-to-video: Wan 2.1 I2V-14B, Wan 2.2 I2V-A14B (two experts) and Wan 2.2 TI2V-5B's image conditioning,
all through ``WanImageToVideoPipeline``. The first frame is each row's source image (the ``image`` column).

Everything of :mod:`flowgrpo.models.wan` holds (UMT5 text, raw 0..1000 timesteps, ordinary CFG, the UniPC
``flow_shift`` mapping, the two experts and their boundary, decoding); what the image adds:

* Wan 2.1 I2V and Wan 2.2 I2V-A14B (``expand_timesteps`` off): the source image, resized to the working size by the
  pipeline's video processor, is followed by ``num_frames - 1`` black frames and encoded by the VAE (the posterior's
  mode), normalised ``(z - mean) / std``. A mask marks the known frame: 1 on the ``4`` sub-frames of the first latent
  frame, 0 elsewhere, shaped ``(B, 4, F', h, w)``. The transformer reads ``cat([x_t, mask, z_cond], dim=1)``
  (16 + 4 + 16 = 36 channels) and predicts the 16-channel velocity of ``x_t``.
* Wan 2.1 I2V only (``transformer.config.image_dim`` set): the CLIP vision encoder's second-to-last hidden state of
  the source image (``encoder_hidden_states_image``, 257 tokens at full size) joins the text in every cross-attention
  through ``attn2.add_k_proj`` / ``add_v_proj``. Its attention splits image from text by assuming exactly 512 text
  tokens, so ``max_sequence_length`` must be 512 here (anything else silently mis-splits; it is an error).
* Wan 2.2 TI2V-5B (``expand_timesteps``): the source image alone is encoded; the transformer's input is ``x_t`` with
  its first latent frame replaced by the image's latents, and that frame's tokens get timestep 0 (the others ``t``).
  The pipeline's output replaces the first frame the same way (:meth:`final_latents`). The velocity of the first
  frame is never used, so it is returned as 0: those coordinates then follow the same transition under every policy
  and add nothing to the log-probability ratio.
* CFG: the unconditional pass swaps only the text for the negative prompt; the image conditioning is the sample's
  own in both passes (as in the stock pipeline).

Released Wan 2.2 TI2V-5B folders name ``WanPipeline`` in ``model_index.json`` (text-to-video, :class:`WanAdapter`);
for image conditioning load them as ``WanImageToVideoPipeline.from_pretrained(...)`` and pass the pipeline object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

from .base import PromptEmbeds
from .profile import ModelConfigs, TextRule
from .wan import WAN_LORA_TARGET_MODULES, WanAdapter

#: Wan's attention projections plus Wan 2.1 I2V's image-token keys and values in the cross-attention (diffusers'
#: I2V LoRAs carry them too; on Wan 2.2 I2V-A14B and TI2V, which have no image tokens, peft skips them).
WAN_I2V_LORA_TARGET_MODULES = WAN_LORA_TARGET_MODULES + ("attn2.add_k_proj", "attn2.add_v_proj")

#: The text length Wan 2.1 I2V's cross-attention assumes when it splits image tokens from text tokens.
WAN_I2V_TEXT_TOKENS = 512


class WanImageToVideoAdapter(WanAdapter):
    family = "wan_i2v"
    pipeline_class_names = ("WanImageToVideoPipeline",)
    accepts_images = True
    default_lora_target_modules = WAN_I2V_LORA_TARGET_MODULES

    def __init__(self, pipeline, num_frames: int = 1):
        super().__init__(pipeline, num_frames)
        self.uses_image_encoder = pipeline.transformer.config.get("image_dim") is not None
        if self.uses_image_encoder and getattr(pipeline, "image_encoder", None) is None:
            raise ValueError("This Wan image-to-video transformer reads CLIP image embeddings (image_dim is set), but "
                             "the pipeline has no image_encoder; load the full Wan 2.1 I2V pipeline.")

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        rule = super()._text_rule(configs)
        if configs.config("transformer").get("image_dim") is None:
            return rule
        return TextRule(WAN_I2V_TEXT_TOKENS, rule.default_why, rule.limit, rule.limit_why, exact=WAN_I2V_TEXT_TOKENS,
                        exact_why="Wan 2.1 image-to-video's cross-attention splits the CLIP image tokens from the text "
                                  f"assuming {WAN_I2V_TEXT_TOKENS} text tokens")

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """Text as Wan T2V, plus per row ``condition`` (mask and VAE latents of the first frame; TI2V: the first
        frame's latents) and, for Wan 2.1, ``image_embeds``. Without images (the negative prompt) only the text."""
        if self.uses_image_encoder and max_sequence_length != WAN_I2V_TEXT_TOKENS:
            raise ValueError(f"max_sequence_length={max_sequence_length}, but Wan 2.1 image-to-video splits image from "
                             f"text tokens assuming {WAN_I2V_TEXT_TOKENS} text tokens; set max_sequence_length: "
                             f"{WAN_I2V_TEXT_TOKENS}.")
        embeds = super().encode_prompts(prompts, max_sequence_length, device)
        if images is None:
            return embeds
        images = [self._single_image(im) for im in self._require_images(prompts, images, height, width)]
        dtype = embeds.tensors["prompt_embeds"].dtype
        embeds.tensors["condition"] = self._condition(images, height, width, device).to(dtype)
        if self.uses_image_encoder:
            embeds.tensors["image_embeds"] = self.pipeline.encode_image(images, device).to(dtype)
        return embeds

    @staticmethod
    def _single_image(image: Any) -> Any:
        if isinstance(image, (list, tuple)):
            if len(image) != 1:
                raise ValueError(f"A row of the 'image' column holds {len(image)} images, but image-to-video starts "
                                 "from one first frame; give one image per row.")
            return image[0]
        return image

    @torch.no_grad()
    def _condition(self, images: list[Any], height: int, width: int, device: torch.device) -> torch.Tensor:
        pipe, vae = self.pipeline, self.pipeline.vae
        pixels = pipe.video_processor.preprocess([im.convert("RGB") for im in images], height=height,
                                                 width=width).to(device=device, dtype=torch.float32)
        first = pixels.unsqueeze(2)  # (B, 3, 1, H, W)
        if self.expand_timesteps:
            video = first
        else:
            video = torch.cat([first, first.new_zeros(first.shape[0], 3, self.num_frames - 1, height, width)], dim=2)
        latents = retrieve_latents(vae.encode(video.to(vae.dtype)), sample_mode="argmax").to(torch.float32)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) * inv_std
        if self.expand_timesteps:
            return latents  # (B, C, 1, h, w)
        batch, _, frames, h, w = latents.shape
        factor = pipe.vae_scale_factor_temporal
        # Pixel-frame mask (1 on the first frame), the first frame repeated to a full group of `factor`, then
        # grouped per latent frame: (B, factor, F', h, w).
        mask = torch.zeros(batch, 1, factor * frames, h, w, dtype=latents.dtype, device=latents.device)
        mask[:, :, :factor] = 1
        mask = mask.view(batch, frames, factor, h, w).transpose(1, 2)
        return torch.cat([mask, latents], dim=1)

    # --- latents ----------------------------------------------------------------------------------
    def latent_shape(self, batch_size: int, height: int, width: int) -> tuple[int, ...]:
        pipe = self.pipeline
        frames = (self.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        spatial = pipe.vae_scale_factor_spatial
        return (batch_size, pipe.vae.config.z_dim, frames, height // spatial, width // spatial)

    @staticmethod
    def _frame_mask(latents: torch.Tensor) -> torch.Tensor:
        """``(1, 1, F', h, w)``: 0 on the first latent frame (the source image's), 1 elsewhere."""
        mask = torch.ones(1, 1, *latents.shape[2:], dtype=latents.dtype, device=latents.device)
        mask[:, :, 0] = 0
        return mask

    def final_latents(self, latents: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        if not self.expand_timesteps:
            return latents
        mask = self._frame_mask(latents)
        return (1 - mask) * embeds.tensors["condition"].to(latents.dtype) + mask * latents

    # --- the transformer call ---------------------------------------------------------------------
    def _call(self, transformer, latents, timestep, cond: dict[str, torch.Tensor], expert: int | None):
        if "condition" not in cond:
            raise ValueError("Wan image-to-video samples need their first frame: encode the prompts with images=.")
        condition = cond["condition"].to(latents.dtype)
        if self.expand_timesteps:
            mask = self._frame_mask(latents)
            hidden = (1 - mask) * condition + mask * latents
            _, patch_h, patch_w = self.pipeline.transformer.config.patch_size
            token_mask = mask[0, 0][:, ::patch_h, ::patch_w].flatten()
            timestep = timestep[:, None] * token_mask[None]  # the first frame's tokens at t = 0
        else:
            hidden = torch.cat([latents, condition], dim=1)
        kwargs = dict(hidden_states=hidden, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
                      return_dict=False)
        if "image_embeds" in cond:
            kwargs["encoder_hidden_states_image"] = cond["image_embeds"]
        if expert is not None:
            kwargs["expert"] = expert
        return transformer(**kwargs)[0]

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale, negative_embeds, height,
                         width) -> torch.Tensor:
        v = super().predict_velocity(transformer, latents, timestep, embeds, guidance_scale, negative_embeds, height,
                                     width)
        if self.expand_timesteps:  # the first frame is the source image's: its velocity is not the model's to choose
            v = v * self._frame_mask(latents)
        return v

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        tokens, text = super().sequence_lengths(embeds, latents)
        image = int(embeds.tensors["image_embeds"].shape[1]) if "image_embeds" in embeds.tensors else 0
        return tokens, text + image
