"""Stable Diffusion 3 / 3.5 (MMDiT with CLIP-L, CLIP-G and T5 text encoders)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, SizeRule, TextRule, sane_length, smallest

#: The longest T5 prompt StableDiffusion3Pipeline accepts (its ``check_inputs``), and its default.
SD3_MAX_SEQUENCE_LENGTH, SD3_DEFAULT_SEQUENCE_LENGTH = 512, 256

#: Published steps and guidance by checkpoint name (the first fragment found in the hub id or folder name wins).
SD3_PUBLISHED = (
    (("3.5-large-turbo", "3-5-large-turbo"), Published(4, 0.0, "SD3.5 Large Turbo model card (4 steps, guidance 0: "
                                                            "distilled)", distilled=True)),
    (("3.5-large", "3-5-large"), Published(28, 3.5, "SD3.5 Large model card (28 steps, guidance 3.5)")),
    (("3.5-medium", "3-5-medium"), Published(40, 4.5, "SD3.5 Medium model card (40 steps, guidance 4.5)")),
)


class SD3Adapter(ModelFamilyAdapter):
    """SD3/SD3.5: 4-D latents, true classifier-free guidance v = v_u + w (v_c - v_u) with a negative prompt."""

    family = "sd3"
    pipeline_class_names = ("StableDiffusion3Pipeline",)
    encodes_images = True
    sequence_parallel_refusal = (
        "SD3's transformer (SD3Transformer2DModel) has no context-parallel plan in diffusers 0.42.1 and its joint "
        "attention (JointAttnProcessor2_0) calls the attention kernel itself, so its tokens cannot be split over "
        "processes; an SD3 image (4,096 tokens at 1024 px) fits on one GPU: train it data-parallel.")

    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        """The pipeline's ``default_sample_size`` is the transformer's ``sample_size`` (128 for SD3 and SD3.5)."""
        factor = cls._vae_scale_factor(configs)
        sample = int(configs.config("transformer").get("sample_size", 128))
        return sample * factor, sample * factor, f"transformer sample_size {sample} x VAE factor {factor}"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        """Multiples of the VAE factor times the patch size, up to ``pos_embed_max_size`` patches a side: the
        transformer crops its positional table to the image and cannot place more patches than it holds."""
        factor = cls._vae_scale_factor(configs)
        transformer = configs.config("transformer")
        patch = int(transformer.get("patch_size", 2))
        rule = SizeRule(factor * patch, f"VAE factor {factor} x patch size {patch}")
        table = transformer.get("pos_embed_max_size")
        if table:
            rule = SizeRule(rule.multiple, rule.multiple_why, int(table) * patch * factor,
                            f"the transformer's positional table holds pos_embed_max_size={table} patches a side "
                            f"(patch size {patch}, VAE factor {factor})")
        return rule

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        limit, why = smallest(
            (SD3_MAX_SEQUENCE_LENGTH, "the longest T5 prompt StableDiffusion3Pipeline accepts"),
            (sane_length(configs.config("tokenizer_3").get("model_max_length")), "the T5 tokenizer's model_max_length"))
        return TextRule(min(SD3_DEFAULT_SEQUENCE_LENGTH, limit or SD3_DEFAULT_SEQUENCE_LENGTH),
                        "StableDiffusion3Pipeline's T5 length", limit, why)

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        for fragments, published in SD3_PUBLISHED:
            if configs.name_has(*fragments):
                return published
        return Published(28, 7.0, "StableDiffusion3Pipeline's call defaults (SD3 Medium's model card: 28 steps, "
                                  "guidance 7)")

    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        prompt_embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
        )
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled})

    def latent_shape(self, batch_size: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        channels = self.pipeline.transformer.config.in_channels
        return (batch_size, channels, height // scale, width // scale)

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        return randn_tensor(self.latent_shape(batch_size, height, width), generator=generator, device=device,
                            dtype=dtype)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            scale = self.pipeline.vae_scale_factor
            patch = self.pipeline.transformer.config.patch_size
            seq_len = (height // scale // patch) * (width // scale // patch)
            kwargs["mu"] = calculate_shift(
                seq_len, scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        if self.uses_cfg(guidance_scale):
            if negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative prompt embeddings for SD3")
            neg = negative_embeds.tensors
            model_input = torch.cat([latents, latents])
            t = torch.cat([timestep, timestep])
            prompt_embeds = torch.cat([neg["prompt_embeds"], cond["prompt_embeds"]])
            pooled = torch.cat([neg["pooled_prompt_embeds"], cond["pooled_prompt_embeds"]])
        else:
            model_input, t = latents, timestep
            prompt_embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        out = transformer(hidden_states=model_input, timestep=t, encoder_hidden_states=prompt_embeds,
                          pooled_projections=pooled, return_dict=False)[0]
        if self.uses_cfg(guidance_scale):
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        return out

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        patch = int(self.pipeline.transformer.config.patch_size)
        image_tokens = int(latents.shape[-2] // patch) * int(latents.shape[-1] // patch)
        return image_tokens, int(embeds.tensors["prompt_embeds"].shape[1])

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self._vae_decode(latents)
