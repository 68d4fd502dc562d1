"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``), text-to-video: an MMDiT-style video transformer with two text
encoders and the pipeline's own guider.

* Text: Qwen2.5-VL's text model reads the prompt inside a chat template (system message describing a video) padded to
  ``1000 + 108`` tokens, its third-from-last hidden state is kept after the template's first 108 tokens, with a mask;
  ByT5 reads the prompt's quoted glyph text (zeros and a zero mask when there is none). Both come from the pipeline's
  ``encode_prompt``; ``max_sequence_length`` is not used (the lengths are the pipeline's).
* Latents: ``(B, C, F', H / 16, W / 16)`` (released VAE: 32 channels, 16x in space, 4x in time); the transformer reads
  ``cat([x_t, zeros(C), zeros(1)])`` (the image-to-video condition latents and mask, empty in text-to-video) and
  zero SigLIP image embeddings (729 tokens), as the pipeline does; ``timestep`` is the raw 0..1000 value.
* Schedule: ``sigmas = linspace(1, 0, N + 1)[:-1]`` with the scheduler's fixed ``shift`` (7 in the released 480p
  model), as the pipeline passes them.
* Guidance: the pipeline combines its passes with its ``guider`` component (``ClassifierFreeGuidance``, whose own
  ``guidance_scale`` sets the stock call's guidance). Here the trainer's ``guidance_scale`` is used in the same form,
  ``v_u + w (v_c - v_u)``, two passes when ``w > 1``; a guider with ``guidance_rescale`` or the original formulation
  is refused (clear error) because the trainer's SDE needs the plain combination.
* Decode: ``x / scaling_factor``, decoded one video at a time (this diffusers version's VAE attention breaks on a
  batch of several), frames ``(B, F, 3, H, W)``. The VAE's attention blocks build their frame-causal mask with one
  operation per frame instead of one per token (`frame_causal_attention_mask`, installed on each block by the
  adapter).
* LoRA: the MMDiT names (``attn.to_q/k/v/out.0``, ``attn.add_q/k/v_proj``; not ``attn.to_add_out``, unused in the
  last block) of the double-stream blocks and the text refiner's attention; both text encoders and the VAE are frozen. The pipeline class has no
  ``load_lora_weights`` in diffusers 0.42.1: the export is written in the diffusers transformer format and loads with
  ``pipeline.transformer.load_lora_adapter(folder, prefix="transformer")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, SizeRule, TextRule

#: The joint attention's projections of both streams (and the text refiner's ``attn.to_*``); not ``attn.to_add_out``:
#: the last block's text output is discarded, so its adapter would never get a gradient.
HUNYUANVIDEO15_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
)


class HunyuanVideo15Adapter(ModelFamilyAdapter):
    family = "hunyuanvideo15"
    pipeline_class_names = ("HunyuanVideo15Pipeline",)
    is_video = True
    default_lora_target_modules = HUNYUANVIDEO15_LORA_TARGET_MODULES

    def __init__(self, pipeline, num_frames: int = 1):
        super().__init__(pipeline, num_frames)
        if getattr(pipeline, "vae", None) is not None:
            use_frame_causal_masks(pipeline.vae)
        guider = getattr(pipeline, "guider", None)
        if guider is not None and (getattr(guider, "guidance_rescale", 0.0) or
                                   getattr(guider, "use_original_formulation", False)):
            raise ValueError("This HunyuanVideo 1.5 guider rescales the guided prediction or uses the original "
                             "formulation; RL sampling uses plain CFG v_u + w (v_c - v_u). Give the pipeline "
                             "ClassifierFreeGuidance(guidance_rescale=0.0, use_original_formulation=False).")

    @classmethod
    def check_num_frames(cls, num_frames: int | None) -> None:
        if num_frames is not None and num_frames < 1:
            raise ValueError(f"num_frames={num_frames}: HunyuanVideo 1.5 videos have 4k + 1 frames (e.g. 121).")

    @classmethod
    def check_video_settings(cls, num_frames: int | None, height: int | None, width: int | None,
                             vae_config: dict | None = None) -> None:
        """``temporal k + 1`` frames and sides divisible by the VAE's spatial compression (4x and 16x in the released
        VAE, the config's ``temporal_compression_ratio`` / ``spatial_compression_ratio``). Values not resolved yet
        (``None``) are not checked."""
        if vae_config is not None and None not in (num_frames, height, width):
            cls._check_shape(num_frames, height, width, int(vae_config.get("temporal_compression_ratio", 4)),
                             int(vae_config.get("spatial_compression_ratio", 16)))

    @staticmethod
    def _check_shape(num_frames: int, height: int, width: int, temporal: int, spatial: int) -> None:
        if (num_frames - 1) % temporal:
            lower = (num_frames - 1) // temporal * temporal + 1
            raise ValueError(f"num_frames={num_frames}: this HunyuanVideo 1.5 VAE compresses time {temporal}x, so "
                             f"videos have {temporal}k + 1 frames; use {lower} or {lower + temporal}.")
        if height % spatial or width % spatial:
            raise ValueError(f"{height} x {width}: HunyuanVideo 1.5 needs sides divisible by {spatial}; use e.g. "
                             f"{height // spatial * spatial or spatial} x {width // spatial * spatial or spatial}.")

    # --- generation settings from the component configs -------------------------------------------
    @staticmethod
    def _spatial(configs: ModelConfigs) -> int:
        return int(configs.config("vae").get("spatial_compression_ratio") or 16)

    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        """The pipeline's size without one: the 16:9 bucket nearest its transformer's ``target_size``."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        target = int(configs.config("transformer").get("target_size", 640))
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=cls._spatial(configs))
        height, width = processor.calculate_default_height_width(9, 16, target)
        return int(height), int(width), f"the 16:9 size of the transformer's target_size {target}, as the pipeline"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        spatial = cls._spatial(configs)
        return SizeRule(spatial, f"the VAE's spatial compression {spatial}")

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        return TextRule(1000, "not read by HunyuanVideo 1.5 (the pipeline's own 1000 Qwen2.5-VL tokens and 256 ByT5 "
                              "tokens)", used=False)

    @classmethod
    def _default_frames(cls, configs: ModelConfigs) -> tuple[int, str]:
        return 121, "HunyuanVideo15Pipeline's call default (121 frames)"

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        guider = configs.config("guider")
        if "guidance_scale" in guider:
            return Published(50, float(guider["guidance_scale"]), "HunyuanVideo15Pipeline's call default (50 steps) "
                                                                  "and its guider's guidance_scale")
        return Published(50, 6.0, "HunyuanVideo 1.5's release settings (50 steps, guidance 6; the pipeline folder's "
                                  "guider_config.json, when present, is read instead)")

    def _latent_dims(self, height: int, width: int) -> tuple[int, int, int]:
        pipe = self.pipeline
        temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        self._check_shape(self.num_frames, height, width, temporal, spatial)
        return (self.num_frames - 1) // temporal + 1, height // spatial, width // spatial

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        pipe = self.pipeline
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=list(prompts), device=device,
                                                            dtype=pipe.transformer.dtype, batch_size=len(prompts))
        return PromptEmbeds({"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": embeds_2,
                             "prompt_embeds_mask_2": mask_2})

    # --- latents ----------------------------------------------------------------------------------
    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        frames, h, w = self._latent_dims(height, width)
        shape = (batch_size, self.pipeline.vae.config.latent_channels, frames, h, w)
        return randn_tensor(shape, generator=generator, device=device, dtype=dtype)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        sigmas = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas)

    # --- the transformer call ---------------------------------------------------------------------
    def _call(self, transformer, latents, timestep, cond: dict[str, torch.Tensor]):
        pipe = self.pipeline
        batch = latents.shape[0]
        condition = latents.new_zeros(latents.shape)
        mask = latents.new_zeros(batch, 1, *latents.shape[2:])
        image_embeds = latents.new_zeros(batch, pipe.vision_num_semantic_tokens, pipe.vision_states_dim)
        return transformer(hidden_states=torch.cat([latents, condition, mask], dim=1), image_embeds=image_embeds,
                           timestep=timestep.to(latents.dtype), encoder_hidden_states=cond["prompt_embeds"],
                           encoder_attention_mask=cond["prompt_embeds_mask"],
                           encoder_hidden_states_2=cond["prompt_embeds_2"],
                           encoder_attention_mask_2=cond["prompt_embeds_mask_2"], return_dict=False)[0]

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        if not self.uses_cfg(guidance_scale):
            return self._call(transformer, latents, timestep, cond)
        if negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative prompt embeddings for HunyuanVideo 1.5")
        both = {k: torch.cat([negative_embeds.tensors[k], v]) for k, v in cond.items()}
        out = self._call(transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), both)
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict[str, Any]:
        """diffusers 0.42.1 has no plan for this transformer; this one splits both streams of the joint attention.

        The video tokens and the text context (after the transformer has reordered it: valid image, ByT5 and
        Qwen2.5-VL tokens first, padding last) are split along the sequence as they enter the first block; the text
        mask is split with them at every block, the video's rotary table as the ``rope`` module returns it; the
        output projection's tokens are gathered. Each process then attends with its video and text tokens as
        queries over every process's video and text tokens (`prepare_sequence_parallel`'s processor)."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        tokens = ContextParallelInput(split_dim=1, expected_dims=3)
        return {
            "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
            "transformer_blocks.*": {"attention_mask": ContextParallelInput(split_dim=1, expected_dims=2)},
            "rope": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
                     1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def prepare_sequence_parallel(self, transformer: torch.nn.Module) -> None:
        """Give every joint-attention block `SplitJointAttnProcessor` (see there why the stock one cannot be split)."""
        for block in transformer.transformer_blocks:
            block.attn.set_processor(SplitJointAttnProcessor())

    def lora_writer(self) -> Any:
        """``HunyuanVideo15Pipeline`` has no LoRA loader in this diffusers version; HunyuanVideo's mixin writes the
        same transformer-only format (``transformer.<module>.lora_A/B.weight``), which
        ``pipeline.transformer.load_lora_adapter(folder, prefix="transformer")`` loads."""
        from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        """``(video tokens, context tokens)``: the latent patches, and the joint attention's whole context, the
        pipeline's SigLIP image tokens (zeros in text-to-video, still attended over), the ByT5 tokens and the
        Qwen2.5-VL tokens."""
        config = self.pipeline.transformer.config
        tokens = (latents.shape[2] // config.patch_size_t) * (latents.shape[3] // config.patch_size) \
            * (latents.shape[4] // config.patch_size)
        context = self.pipeline.vision_num_semantic_tokens + embeds.tensors["prompt_embeds_2"].shape[1] \
            + embeds.tensors["prompt_embeds"].shape[1]
        return int(tokens), int(context)

    # --- pixels -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor
        # One video at a time: the VAE's causal attention mask does not broadcast over a batch in this version.
        video = torch.cat([vae.decode(latents[i:i + 1], return_dict=False)[0] for i in range(latents.shape[0])])
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)


def frame_causal_attention_mask(n_frame: int, n_hw: int, dtype: torch.dtype, device: torch.device | str | None,
                                batch_size: int | None = None) -> torch.Tensor:
    """The causal attention mask of HunyuanVideo 1.5's VAE attention (``HunyuanVideo15AttnBlock.
    prepare_causal_attention_mask``), built with one operation per frame instead of one per token.

    Over ``L = n_frame * n_hw`` tokens ordered frame by frame, token ``i`` attends to token ``j`` exactly when ``j``'s
    frame is not after ``i``'s: ``mask[i, j] = 0`` if ``j // n_hw <= i // n_hw``, else ``-inf``. So frame ``f``'s
    rows ``f n_hw .. (f + 1) n_hw - 1`` are 0 on columns ``0 .. (f + 1) n_hw - 1`` and ``-inf`` after them. The
    ``(L, L)`` tensor has ``dtype`` on ``device``, expanded (a view) to ``(batch_size, L, L)`` when ``batch_size`` is
    given; as diffusers' own, it is the only ``L x L`` tensor made (filled with ``-inf``, then zeroed in place)."""
    seq_len = n_frame * n_hw
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    for frame in range(n_frame):
        mask[frame * n_hw:(frame + 1) * n_hw, :(frame + 1) * n_hw] = 0
    if batch_size is not None:
        mask = mask.unsqueeze(0).expand(batch_size, -1, -1)
    return mask


def use_frame_causal_masks(vae: torch.nn.Module) -> int:
    """Give each attention block of a HunyuanVideo 1.5 VAE `frame_causal_attention_mask` (an attribute of the
    instance: the diffusers class is left as it is), and return how many blocks got it. diffusers' own builds the
    same mask with a Python loop over every token, which dominated decoding under fake tensors (the planner) and
    costs one small operation per token on a real video."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    blocks = [m for m in vae.modules() if isinstance(m, HunyuanVideo15AttnBlock)]
    for block in blocks:
        block.prepare_causal_attention_mask = frame_causal_attention_mask
    return len(blocks)


def _joint_processor_base() -> type:
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    return HunyuanVideo15AttnProcessor2_0


class SplitJointAttnProcessor(_joint_processor_base()):
    """HunyuanVideo 1.5's joint attention (video and text tokens in one softmax) with a mask on the keys only.

    The stock processor masks with ``valid_q AND valid_k``, an ``(L, L)`` mask built from the tokens it holds; once
    the tokens are split, a process holds a slice of the queries and the attention runs over every process's keys,
    which that square mask cannot describe. Masking the keys only (every video token and the valid text tokens, a
    ``(B, L_s)`` mask that the Ulysses attention gathers with the keys) gives every valid token the stock output:
    what differs is the output of padded text tokens, which no valid token ever attends to (they are masked as keys
    in every block) and which the output projection does not read. Used only with ``sequence_parallel_size > 1``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query = attn.norm_q(split_heads(attn.to_q(hidden_states)))
        key = attn.norm_k(split_heads(attn.to_k(hidden_states)))
        value = split_heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query = split_heads(attn.add_q_proj(encoder_hidden_states))
        text_key = split_heads(attn.add_k_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        query = torch.cat([query, text_query], dim=1)
        key = torch.cat([key, text_key], dim=1)
        value = torch.cat([value, split_heads(attn.add_v_proj(encoder_hidden_states))], dim=1)
        # keys: every video token, then the text tokens the mask marks valid
        valid_keys = torch.nn.functional.pad(attention_mask.bool(), (hidden_states.shape[1], 0), value=True)
        out = dispatch_attention_fn(query, key, value, attn_mask=valid_keys, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        video, text = out[:, :hidden_states.shape[1]], out[:, hidden_states.shape[1]:]
        video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return video, text
