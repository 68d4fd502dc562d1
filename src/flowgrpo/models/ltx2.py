"""LTX-2 (``LTX2Pipeline``): a joint audio-video DiT. One transformer denoises a video stream and an audio stream
together; each stream attends to its own text context and to the other stream (audio-to-video and video-to-audio
cross-attention).

* Text: Gemma 3 reads the prompt (left-padded to ``max_sequence_length``), all its hidden states are stacked, and the
  pipeline's ``connectors`` (a small frozen transformer per stream) turn them into a video context, an audio context
  and a mask. The connectors run once per distinct prompt; their outputs are the conditioning here.
* State: the trainer's latents are one flat vector per sample, ``[video tokens, audio tokens]``: the video latents
  packed as the pipeline packs them, ``(F' h w, C)``, then the audio latents ``(L, C_a M)`` (``L`` audio latent frames
  for the clip's duration ``num_frames / frame_rate``). The SDE and the log-probabilities treat both streams as one
  sample, because the video velocity depends on the audio state (the transformer's cross-modal attention): the
  stock sampler's video is only reproduced with its audio denoised alongside.
* Noise: video noise then audio noise from the same generator, as the pipeline draws them.
* Schedule: ``sigmas = linspace(1, 1/N, N)`` shifted with the dynamic ``mu`` of the video token count (the audio
  stream uses the same sigmas).
* Call: ``timestep`` and ``sigma`` the scheduler's 0..1000 value, rotary coordinates of both streams, the clip's
  frame rate. Guidance: CFG ``v_u + w (v_c - v_u)`` with the negative prompt on both streams (the pipeline forms it on
  the x0 prediction, the same linear combination). The pipeline's other guidance terms, spatio-temporal guidance
  (``stg_scale``), modality-isolation guidance (``modality_scale``) and the CFG rescale (``guidance_rescale``), cost
  extra transformer passes per step and are not used in RL sampling (call the stock pipeline with ``stg_scale=0,
  modality_scale=1, guidance_rescale=0`` and equal audio settings to compare).
* What is trained: the LoRA targets are the video stream's attention (``attn1``, ``attn2`` and the audio-to-video
  cross-attention ``audio_to_video_attn``) and feed-forward; the audio stream, the connectors, Gemma 3, both VAEs,
  the vocoder and the duration head are frozen. The duration head is not used: ``num_frames`` is always given.
* Decode: the video latents are unpacked, de-normalised with the VAE's mean / std and decoded to frames; the audio
  latents are decoded (audio VAE, vocoder) by :meth:`decode_audio` only when a reward scores sound
  (``accepts_audio``: it receives the ``audio`` and ``audio_sampling_rate`` columns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .base import ModelFamilyAdapter, PromptEmbeds
from .profile import ModelConfigs, Published, SizeRule, TextRule, encoder_positions, sane_length, smallest

#: The video stream's attention and feed-forward (the audio stream's modules are ``audio_*`` and stay frozen).
LTX2_LORA_TARGET_MODULES = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "audio_to_video_attn.to_q", "audio_to_video_attn.to_k", "audio_to_video_attn.to_v", "audio_to_video_attn.to_out.0",
    "ff.net.0.proj", "ff.net.2",
)

#: The frame rate the clips are generated (and conditioned) at, as the pipeline's default.
LTX2_FRAME_RATE = 24.0


def _calculate_shift(tokens: int, base_len: int, max_len: int, base_shift: float, max_shift: float) -> float:
    """The pipeline's dynamic shift: linear in the video token count between (base_len, base_shift) and
    (max_len, max_shift)."""
    slope = (max_shift - base_shift) / (max_len - base_len)
    return tokens * slope + base_shift - slope * base_len


class LTX2Adapter(ModelFamilyAdapter):
    family = "ltx2"
    pipeline_class_names = ("LTX2Pipeline",)
    is_video = True
    makes_audio = True
    default_lora_target_modules = LTX2_LORA_TARGET_MODULES

    def __init__(self, pipeline, num_frames: int = 1, frame_rate: float = LTX2_FRAME_RATE):
        super().__init__(pipeline, num_frames)
        self.frame_rate = float(frame_rate)
        if self.pipeline.transformer.config.patch_size != 1 or self.pipeline.transformer.config.patch_size_t != 1:
            raise ValueError("Only LTX-2 transformers with patch_size 1 (the released models) are supported.")

    @classmethod
    def check_num_frames(cls, num_frames: int | None) -> None:
        # The released VAE compresses time 8x (the tiny one 2x): 8k + 1 frames suit both; the rule of the model's own
        # VAE is checked by check_video_settings (before loading, from its config) and again in _latent_dims.
        if num_frames is not None and num_frames < 1:
            raise ValueError(f"num_frames={num_frames}: LTX-2 videos have at least one frame (e.g. 121 = 8 * 15 + 1).")

    @classmethod
    def check_video_settings(cls, num_frames: int | None, height: int | None, width: int | None,
                             vae_config: dict | None = None) -> None:
        """Sides divisible by 32 (the pipeline's rule) and ``temporal k + 1`` frames for the VAE's time compression
        (8x in the released VAE; from its config: ``temporal_compression_ratio``, else ``patch_size_t`` x 2 per
        spatio-temporal scaling level, as the VAE computes it). Values not resolved yet (``None``) are not checked."""
        if height is not None and width is not None and (height % 32 or width % 32):
            raise ValueError(f"LTX-2 needs a height and width divisible by 32, got {height} x {width}; use e.g. "
                             f"{height // 32 * 32 or 32} x {width // 32 * 32 or 32}.")
        if vae_config is None or num_frames is None:
            return
        temporal = vae_config.get("temporal_compression_ratio") or int(vae_config.get("patch_size_t", 1)) * 2 ** sum(
            bool(s) for s in vae_config.get("spatio_temporal_scaling", (True, True, True, True)))
        cls._check_frames(num_frames, int(temporal))

    @staticmethod
    def _check_frames(num_frames: int, temporal: int) -> None:
        if (num_frames - 1) % temporal:
            lower = (num_frames - 1) // temporal * temporal + 1
            raise ValueError(f"num_frames={num_frames}: this LTX-2 VAE compresses time {temporal}x, so videos have "
                             f"{temporal}k + 1 frames; use {lower} or {lower + temporal}.")

    # --- generation settings from the component configs -------------------------------------------
    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        return 512, 768, "LTX2Pipeline's call defaults (512 x 768)"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        return SizeRule(32, "LTX2Pipeline's rule: sides divisible by 32")

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        """1024 tokens, the pipeline's default (it caps them at the tokenizer's ``model_max_length``), no more than
        Gemma 3's positions."""
        limit, why = smallest(
            (encoder_positions(configs.config("text_encoder")), "Gemma 3's max_position_embeddings"),
            (sane_length(configs.config("tokenizer").get("model_max_length")), "the tokenizer's model_max_length"))
        default = min(1024, limit or 1024)
        return TextRule(default, "LTX2Pipeline's call default" + (f", capped by {why}" if default < 1024 else ""),
                        limit, why)

    @classmethod
    def _default_frames(cls, configs: ModelConfigs) -> tuple[int, str]:
        return 121, "LTX2Pipeline's default without a duration head (121 frames)"

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        return Published(30, 3.0, "LTX2Pipeline's call defaults and documented example (30 steps, guidance 3.0)")

    # --- shapes -----------------------------------------------------------------------------------
    def _latent_dims(self, height: int, width: int) -> tuple[int, int, int, int, int, int, int]:
        """(latent frames, latent height, latent width, video channels, audio frames, audio channels, mel bins)."""
        pipe = self.pipeline
        self.check_video_settings(self.num_frames, height, width)
        temporal = pipe.vae_temporal_compression_ratio
        self._check_frames(self.num_frames, temporal)
        frames = (self.num_frames - 1) // temporal + 1
        spatial = pipe.vae_spatial_compression_ratio
        return (frames, height // spatial, width // spatial, pipe.transformer.config.in_channels,
                *self._audio_dims())

    def _audio_dims(self) -> tuple[int, int, int]:
        """(audio latent frames, audio latent channels, mel bins) of a clip of ``num_frames / frame_rate`` seconds."""
        pipe = self.pipeline
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames = round(self.num_frames / self.frame_rate * per_second)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return audio_frames, pipe.audio_vae.config.latent_channels, mel

    def _split(self, latents: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat state as packed video ``(B, F' h w, C)`` and audio ``(B, L, C_a M)`` tokens."""
        frames, h, w, channels, audio_frames, audio_channels, mel = self._latent_dims(height, width)
        video_size = frames * h * w * channels
        video = latents[:, :video_size].reshape(latents.shape[0], frames * h * w, channels)
        audio = latents[:, video_size:].reshape(latents.shape[0], audio_frames, audio_channels * mel)
        return video, audio

    # --- conditioning -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        pipe = self.pipeline
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                num_videos_per_prompt=1, max_sequence_length=max_sequence_length,
                                                device=device)
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        video_ctx, audio_ctx, ctx_mask = pipe.connectors(embeds, mask, padding_side=padding_side)
        return PromptEmbeds({"video_context": video_ctx, "audio_context": audio_ctx, "context_mask": ctx_mask})

    # --- latents ----------------------------------------------------------------------------------
    def prepare_latents(self, batch_size, height, width, generator, device, dtype) -> torch.Tensor:
        frames, h, w, channels, audio_frames, audio_channels, mel = self._latent_dims(height, width)
        video = randn_tensor((batch_size, channels, frames, h, w), generator=generator, device=device, dtype=dtype)
        audio = randn_tensor((batch_size, audio_channels, audio_frames, mel), generator=generator, device=device,
                             dtype=dtype)
        video = video.permute(0, 2, 3, 4, 1).reshape(batch_size, -1)  # packed (F' h w, C), patch size 1
        audio = audio.transpose(1, 2).reshape(batch_size, -1)  # packed (L, C_a M)
        return torch.cat([video, audio], dim=1)

    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        frames, h, w, *_ = self._latent_dims(height, width)
        config = self.scheduler_config
        mu = _calculate_shift(frames * h * w, config.get("base_image_seq_len", 1024),
                              config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                              config.get("max_shift", 2.05))
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        scheduler.set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu)

    # --- the transformer call ---------------------------------------------------------------------
    def _call(self, transformer, video, audio, timestep, cond: dict[str, torch.Tensor], height: int, width: int):
        frames, h, w, _, audio_frames, _, _ = self._latent_dims(height, width)
        base = self.pipeline.transformer
        batch = video.shape[0]
        video_coords = base.rope.prepare_video_coords(batch, frames, h, w, video.device, fps=self.frame_rate)
        audio_coords = base.audio_rope.prepare_audio_coords(batch, audio_frames, audio.device)
        return transformer(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=cond["video_context"],
            audio_encoder_hidden_states=cond["audio_context"], timestep=timestep, sigma=timestep,
            encoder_attention_mask=cond["context_mask"], audio_encoder_attention_mask=cond["context_mask"],
            num_frames=frames, height=h, width=w, fps=self.frame_rate, audio_num_frames=audio_frames,
            video_coords=video_coords, audio_coords=audio_coords, isolate_modalities=False,
            spatio_temporal_guidance_blocks=None, perturbation_mask=None, use_cross_timestep=True, return_dict=False)

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict[str, Any]:
        """Both streams split over the SP group, each token's output owned by one process.

        diffusers' own LTX-2 plan splits the video stream and its text but leaves the sound stream whole on every
        process, with its rotary tables split along dim 1, which holds the heads for the ``"split"`` rotary layout
        of the released model (``(B, H, N, d)``). A whole sound stream would be computed, and back-propagated, by
        every process of the group, so its gradient (and that of every video weight it reaches through the
        cross-modal attention) would count S times. Here the video tokens, the sound tokens, both text contexts and
        their mask are split along the sequence; the rotary tables of both streams (self- and cross-modal) along
        their token dimension (2 in the ``"split"`` layout, 1 in ``"interleaved"``); both outputs are gathered."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        split_layout = getattr(transformer.config, "rope_type", "interleaved") == "split"
        tokens_dim, dims = (2, 4) if split_layout else (1, 3)
        rotary = {0: ContextParallelInput(split_dim=tokens_dim, expected_dims=dims, split_output=True),
                  1: ContextParallelInput(split_dim=tokens_dim, expected_dims=dims, split_output=True)}
        return {
            "": {name: ContextParallelInput(split_dim=1, expected_dims=3)
                 for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states",
                              "audio_encoder_hidden_states")}
            | {name: ContextParallelInput(split_dim=1, expected_dims=2)
               for name in ("encoder_attention_mask", "audio_encoder_attention_mask")},
            "rope": rotary, "audio_rope": rotary, "cross_attn_rope": rotary, "cross_attn_audio_rope": rotary,
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
            "audio_proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def predict_velocity(self, transformer: Callable[..., Any], latents, timestep, embeds, guidance_scale,
                         negative_embeds, height, width) -> torch.Tensor:
        video, audio = self._split(latents, height, width)
        cond = embeds.tensors
        if not self.uses_cfg(guidance_scale):
            v_video, v_audio = self._call(transformer, video, audio, timestep, cond, height, width)
        else:
            if negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative prompt embeddings for LTX-2")
            both = {k: torch.cat([negative_embeds.tensors[k], v]) for k, v in cond.items()}
            out_video, out_audio = self._call(transformer, torch.cat([video, video]), torch.cat([audio, audio]),
                                              torch.cat([timestep, timestep]), both, height, width)
            (u_video, c_video), (u_audio, c_audio) = out_video.chunk(2), out_audio.chunk(2)
            v_video = u_video + guidance_scale * (c_video - u_video)
            v_audio = u_audio + guidance_scale * (c_audio - u_audio)
        return torch.cat([v_video.reshape(latents.shape[0], -1), v_audio.reshape(latents.shape[0], -1)], dim=1)

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        """``(video tokens, context tokens)``: the flat state minus its audio part, over the video channels; the
        connectors' context length (both streams' contexts have it). The audio tokens:
        :meth:`audio_sequence_length`."""
        audio_frames, audio_channels, mel = self._audio_dims()
        video_size = int(latents.shape[1]) - audio_frames * audio_channels * mel
        return video_size // int(self.pipeline.transformer.config.in_channels), \
            int(embeds.tensors["video_context"].shape[1])

    def audio_sequence_length(self, latents: torch.Tensor) -> int:
        """The audio latent frames of one call (the audio stream's tokens, patch size 1)."""
        return self._audio_dims()[0]

    # --- pixels and sound -------------------------------------------------------------------------
    def unpack_video_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The video part of the state as the VAE's de-normalised latents ``(B, C, F', h, w)``."""
        pipe = self.pipeline
        frames, h, w, channels, *_ = self._latent_dims(height, width)
        video, _ = self._split(latents, height, width)
        video = video.reshape(video.shape[0], frames, h, w, channels).permute(0, 4, 1, 2, 3)
        shape = (1, -1, 1, 1, 1)
        mean = pipe.vae.latents_mean.view(shape).to(video.device, video.dtype)
        std = pipe.vae.latents_std.view(shape).to(video.device, video.dtype)
        return video * std / pipe.vae.config.scaling_factor + mean

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipeline.vae
        video = self.unpack_video_latents(latents, height, width).to(vae.dtype)
        if vae.config.timestep_conditioning:  # decode at timestep 0 with no added noise, the pipeline's default
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        else:
            timestep = None
        frames = vae.decode(video, timestep, return_dict=False)[0]  # (B, 3, F, H, W)
        return (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

    def decode_audio(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The audio part of the state as waveforms ``(B, channels, samples)`` at the vocoder's rate (audio VAE, then
        the vocoder), for rewards that score sound."""
        pipe = self.pipeline
        _, _, _, _, audio_frames, audio_channels, mel = self._latent_dims(height, width)
        _, audio = self._split(latents, height, width)
        audio = audio * pipe.audio_vae.latents_std.to(audio) + pipe.audio_vae.latents_mean.to(audio)
        audio = audio.reshape(audio.shape[0], audio_frames, audio_channels, mel).transpose(1, 2)
        mel_spectrogram = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel_spectrogram).float()

    def audio_sampling_rate(self) -> int:
        """The vocoder's output rate (what ``LTX2Pipeline`` hands to its video export as the audio's rate)."""
        return int(self.pipeline.vocoder.config.output_sampling_rate)
