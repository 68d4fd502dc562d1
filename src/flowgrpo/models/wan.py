"""Wan 2.1 / 2.2 text-to-video: a 3-D DiT on video latents ``(B, C, F', H/8, W/8)``, conditioned on UMT5.

* Frames: ``num_frames = 4k + 1`` pixels frames give ``F' = k + 1`` latent frames (the VAE's temporal factor is 4;
  the first frame is encoded alone). The stock pipeline silently rounds other counts; here they are an error.
* Text: UMT5 embeddings of each prompt, cut at its own length and zero-padded to ``max_sequence_length``, no mask.
* Call: ``hidden_states`` the 5-D latents (no packing), ``timestep`` the raw 0..1000 value (Wan 2.2 TI2V-5B,
  ``expand_timesteps``: one timestep per latent token, ``(B, F' * H/16 * W/16)``), ordinary CFG
  ``v = v_u + w (v_c - v_u)`` with the negative prompt.
* Schedule: a ``FlowMatchEulerDiscreteScheduler`` configuration is used as the pipeline uses it
  (``set_timesteps(N)``). The released checkpoints ship ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` and
  ``flow_shift`` (3.0 at 480p, 5.0 at 720p) instead; converting that configuration naively would drop the shift (it
  would silently become 1.0). Here it becomes ``shift = flow_shift`` with UniPC's grid
  ``sigmas = linspace(1, 1/1000, N + 1)[:-1]``, shifted ``s' = shift s / (1 + (shift - 1) s)``, then 0: the same
  noise levels as the stock sampler, stepped with Euler / the SDE.
* Two experts (Wan 2.2 A14B: ``transformer_2`` and ``boundary_ratio``, 0.875): steps with
  ``t >= boundary_ratio * 1000`` use ``transformer`` (high noise), the others ``transformer_2`` (low noise), with
  the same guidance scale. Both are trained: the trainable module is :class:`WanExperts`, which holds the two, so one
  LoRA config puts an adapter on each and every step's gradient reaches the expert that took it.
* Decode: ``x * std + mean`` per channel, ``vae.decode`` to ``(B, 3, F, H, W)``, returned as ``(B, F, 3, H, W)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, SizeRule, TextRule, sane_length, vae_scale_factor_from_temporal

#: Wan's VAE compresses time 4x: videos have 4k + 1 frames.
WAN_TEMPORAL_FACTOR = 4

#: Wan's attention modules: self-attention ``attn1`` and cross-attention ``attn2`` (the MMDiT names would match none).
WAN_LORA_TARGET_MODULES = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
)


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as one trainable module.

    ``forward(expert=0, ...)`` runs ``transformer`` (the high-noise expert), ``expert=1`` runs ``transformer_2``. Both
    stay the pipeline's own modules, so a LoRA injected here is the pipeline's LoRA.
    """

    expert_names = ("transformer", "transformer_2")

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    def forward(self, *, expert: int, **kwargs: Any) -> Any:
        return (self.transformer if expert == 0 else self.transformer_2)(**kwargs)


class WanAdapter(ModelFamilyAdapter):
    family = "wan"
    pipeline_class_names = ("WanPipeline",)
    is_video = True
    default_lora_target_modules = WAN_LORA_TARGET_MODULES

    def __init__(self, pipeline, num_frames: int = 1):
        super().__init__(pipeline, num_frames)
        if pipeline.transformer is None:
            raise ValueError("This WanPipeline has no `transformer` (only `transformer_2`); training needs the "
                             "high-noise expert too. Load the full pipeline.")
        self.two_experts = getattr(pipeline, "transformer_2", None) is not None and \
            pipeline.config.get("boundary_ratio") is not None
        self.boundary_timestep = None
        self._experts = None
        if self.two_experts:
            self.may_leave_weights_unused = True  # a step runs one expert: the other's LoRA gets no gradient
            train_steps = self.scheduler_config.get("num_train_timesteps", 1000)
            self.boundary_timestep = float(pipeline.config.boundary_ratio) * train_steps
            self._experts = WanExperts(pipeline.transformer, pipeline.transformer_2)
        self.expand_timesteps = bool(pipeline.config.get("expand_timesteps", False))
        # The released checkpoints' UniPC configuration (flow sigmas with a fixed flow_shift).
        self._unipc_flow_sigmas = bool(self.scheduler_config.get("use_flow_sigmas", False))

    @classmethod
    def check_num_frames(cls, num_frames: int | None) -> None:
        if num_frames is None:
            return
        if num_frames < 1 or (num_frames - 1) % WAN_TEMPORAL_FACTOR:
            lower = max(1, (num_frames - 1) // WAN_TEMPORAL_FACTOR * WAN_TEMPORAL_FACTOR + 1)
            raise ValueError(f"num_frames={num_frames}: Wan videos have 4k + 1 frames (1, 5, 9, ..., 81: the VAE "
                             f"encodes the first frame alone, then groups of 4); use {lower} or "
                             f"{lower + WAN_TEMPORAL_FACTOR}.")

    # --- generation settings from the component configs -------------------------------------------
    @staticmethod
    def _variant(configs: ModelConfigs) -> str:
        """``"ti2v"`` (Wan 2.2 TI2V-5B: per-token timesteps), ``"a14b"`` (Wan 2.2 A14B: two experts) or ``"2.1"``."""
        if configs.pipeline_config.get("expand_timesteps"):
            return "ti2v"
        if configs.pipeline_config.get("boundary_ratio") is not None or configs.components.get("transformer_2"):
            return "a14b"
        return "2.1"

    @classmethod
    def _vae_scale_factor(cls, configs: ModelConfigs) -> int:
        vae = configs.config("vae")
        return int(vae.get("scale_factor_spatial") or vae_scale_factor_from_temporal(vae))

    @staticmethod
    def _patch(configs: ModelConfigs) -> tuple[int, int, int]:
        patch = configs.config("transformer").get("patch_size") or (1, 2, 2)
        return tuple(int(p) for p in patch)

    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        variant = cls._variant(configs)
        if variant == "ti2v":
            return 704, 1280, "Wan 2.2 TI2V-5B model card (704 x 1280)"
        if variant == "a14b" and cls.family == "wan":
            return 720, 1280, "Wan 2.2 T2V-A14B model card (720 x 1280)"
        return 480, 832, f"{configs.pipeline_class}'s call defaults (480 x 832)"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        """Multiples of the VAE factor times the patch size, up to the rotary table's ``rope_max_seq_len`` patches
        a side (the transformer slices its table to the latent grid and cannot place more)."""
        factor, (_, patch, _) = cls._vae_scale_factor(configs), cls._patch(configs)
        rule = SizeRule(factor * patch, f"VAE factor {factor} x patch size {patch}")
        table = configs.config("transformer").get("rope_max_seq_len")
        if table:
            rule = SizeRule(rule.multiple, rule.multiple_why, int(table) * patch * factor,
                            f"the transformer's rotary table holds rope_max_seq_len={table} patches a side (patch "
                            f"size {patch}, VAE factor {factor})")
        return rule

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        limit = sane_length(configs.config("tokenizer").get("model_max_length"))
        return TextRule(min(512, limit or 512), f"{configs.pipeline_class}'s call default", limit,
                        "the UMT5 tokenizer's model_max_length" if limit else "")

    @classmethod
    def _default_frames(cls, configs: ModelConfigs) -> tuple[int, str]:
        if cls._variant(configs) == "ti2v":
            return 121, "Wan 2.2 TI2V-5B model card (121 frames)"
        return 81, f"{configs.pipeline_class}'s call default (81 frames)"

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        variant = cls._variant(configs)
        if variant == "ti2v":
            return Published(50, 5.0, "Wan 2.2 TI2V-5B model card (50 steps, guidance 5.0)")
        if variant == "a14b" and cls.family == "wan":
            return Published(40, 4.0, "Wan 2.2 T2V-A14B model card (40 steps, guidance 4.0 for the high-noise "
                                      "expert; one scale for both here)")
        return Published(50, 5.0, f"{configs.pipeline_class}'s call defaults (50 steps, guidance 5.0; Wan 2.1's "
                                  "model cards use 5.0)")

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        prompt_embeds, _ = self.pipeline.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                       num_videos_per_prompt=1, max_sequence_length=max_sequence_length,
                                                       device=device)
        return PromptEmbeds({"prompt_embeds": prompt_embeds})

    # --- latents ----------------------------------------------------------------------------------
    def latent_shape(self, batch_size: int, height: int, width: int) -> tuple[int, ...]:
        pipe = self.pipeline
        frames = (self.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        spatial = pipe.vae_scale_factor_spatial
        return (batch_size, pipe.transformer.config.in_channels, frames, height // spatial, width // spatial)

    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        return randn_tensor(self.latent_shape(batch_size, height, width), generator=generator, device=device,
                            dtype=dtype)

    def sde_scheduler_config(self) -> dict[str, Any]:
        config = dict(self.scheduler_config)
        if self._unipc_flow_sigmas:
            # UniPC's flow_shift is FlowMatchEulerDiscreteScheduler's shift; nothing else of UniPC carries over.
            return {"num_train_timesteps": config.get("num_train_timesteps", 1000),
                    "shift": float(config.get("flow_shift", 1.0)), "use_dynamic_shifting": False}
        return config

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        if self._unipc_flow_sigmas:
            train_steps = scheduler.config.get("num_train_timesteps", 1000)
            sigmas = np.linspace(1.0, 1 / train_steps, num_inference_steps + 1)[:-1]
            scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas)
        else:
            scheduler.set_timesteps(num_inference_steps, device=device)

    # --- the transformer call ---------------------------------------------------------------------
    def trainable_module(self) -> torch.nn.Module:
        return self._experts if self.two_experts else self.pipeline.transformer

    def transformers(self) -> list[torch.nn.Module]:
        if self.two_experts:
            return [self.pipeline.transformer, self.pipeline.transformer_2]
        return [self.pipeline.transformer]

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict[str, Any]:
        """diffusers' Wan plan; its split of a per-token ``timestep`` only where there is one (TI2V's
        ``expand_timesteps``): a ``(B,)`` timestep is not split, and diffusers would warn that it was left whole."""
        plan = super().context_parallel_plan(transformer)
        if not self.expand_timesteps:
            plan.pop("", None)
        return plan

    def expert_for(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per sample: 0 for ``transformer`` (``t >= boundary``), 1 for ``transformer_2``; all 0 with one expert."""
        if not self.two_experts:
            return torch.zeros(timestep.shape[0], dtype=torch.long, device=timestep.device)
        return (timestep < self.boundary_timestep).long()

    def _call(self, transformer, latents, timestep, cond: dict[str, torch.Tensor], expert: int | None):
        """One transformer call on ``latents`` with the conditioning ``cond`` of the same rows."""
        if self.expand_timesteps:
            tokens = latents.shape[2] * (latents.shape[3] // 2) * (latents.shape[4] // 2)
            timestep = timestep[:, None].expand(timestep.shape[0], tokens)
        kwargs = dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
                      return_dict=False)
        if expert is not None:
            kwargs["expert"] = expert
        return transformer(**kwargs)[0]

    def _velocity(self, transformer, latents, timestep, cond, neg, guidance_scale, expert: int | None):
        if neg is None:
            return self._call(transformer, latents, timestep, cond, expert)
        # The unconditional pass swaps only the text: every other conditioning (a source image) is the sample's own.
        both = {k: torch.cat([v, v]) for k, v in cond.items()}
        both["prompt_embeds"] = torch.cat([neg["prompt_embeds"], cond["prompt_embeds"]])
        out = self._call(transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), both, expert)
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        cond = embeds.tensors
        neg = None
        if self.uses_cfg(guidance_scale):
            if negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative prompt embeddings for Wan")
            neg = negative_embeds.tensors
        if not self.two_experts:
            return self._velocity(transformer, latents, timestep, cond, neg, guidance_scale, None)
        experts = self.expert_for(timestep)
        used = experts.unique().tolist()
        if len(used) == 1:
            return self._velocity(transformer, latents, timestep, cond, neg, guidance_scale, int(used[0]))
        out = torch.empty_like(latents)
        for expert in used:  # samples on both sides of the boundary: each expert on its own rows
            rows = (experts == expert).nonzero().squeeze(1)
            sub = {k: v.index_select(0, rows) for k, v in cond.items()}
            sub_neg = {k: v.index_select(0, rows) for k, v in neg.items()} if neg is not None else None
            v = self._velocity(transformer, latents.index_select(0, rows), timestep.index_select(0, rows), sub, sub_neg,
                               guidance_scale, int(expert))
            out = out.index_copy(0, rows, v.to(out.dtype))
        return out

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        patch = self.pipeline.transformer.config.patch_size
        tokens = (latents.shape[2] // patch[0]) * (latents.shape[3] // patch[1]) * (latents.shape[4] // patch[2])
        return int(tokens), int(embeds.tensors["prompt_embeds"].shape[1])

    # --- pixels -----------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # (B, 3, F, H, W)
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
