"""The full-size architectures of the released checkpoints (their public configs) and the builders of full-size
random-weight pipelines from them, shared by the benchmark presets (`presets`) and the newer families
(`full_size_families`, `full_size_video`). Nothing is downloaded: weights are random, tokenizers made locally."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# ---- full-size architectures (public configs of the released checkpoints) ------------------------------------
CLIP_L_FULL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "projection_dim": 768, "hidden_act": "quick_gelu", "max_position_embeddings": 77, "vocab_size": 49408}
CLIP_G_FULL = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
               "projection_dim": 1280, "hidden_act": "gelu", "max_position_embeddings": 77, "vocab_size": 49408}
T5_XXL_FULL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
               "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
               "relative_attention_max_distance": 128, "dropout_rate": 0.0, "tie_word_embeddings": False,
               "vocab_size": 32128}
VAE_FULL = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
            "layers_per_block": 2, "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024,
            "use_quant_conv": False, "use_post_quant_conv": False}
SD35M_TRANSFORMER = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
                     "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                     "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
                     "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}
FLUX_DEV_TRANSFORMER = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                        "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
FLUX_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}

# Qwen-Image (Qwen/Qwen-Image): the MMDiT, the Qwen2.5-VL-7B-Instruct encoder, the VAE, the released schedule.
QWEN_IMAGE_TRANSFORMER = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                          "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                          "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}
QWEN25_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                     "rms_norm_eps": 1e-6, "vocab_size": 152064,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}}
QWEN25_VL_7B_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}
QWEN_IMAGE_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                  "temperal_downsample": [False, True, True]}   # latents_mean / latents_std: the class defaults
QWEN_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                        "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
                        "shift_terminal": 0.02, "time_shift_type": "exponential"}

# Wan 2.1 text-to-video (Wan-AI/Wan2.1-T2V-1.3B-Diffusers; the 14B model: 40 heads, FFN 13824, 40 blocks).
WAN_1_3B_TRANSFORMER = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
                        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
                        "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
                        "rope_max_seq_len": 1024}
WAN_14B_TRANSFORMER = {**WAN_1_3B_TRANSFORMER, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
UMT5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
            "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128, "dropout_rate": 0.0, "tie_word_embeddings": False,
            "vocab_size": 256384}
WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True]}     # latents_mean / latents_std: the class defaults
#: The released checkpoints' scheduler (480p): UniPC with flow sigmas and flow_shift 3.0.
WAN_UNIPC_SCHEDULER = {"num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                       "flow_shift": 3.0}
WAN_LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                    "attn2.to_v", "attn2.to_out.0")

# ---- the small CPU transformer: SD3.5-Medium's block design, shrunk to ~34 M parameters ------------------------
SMALL_CPU_TRANSFORMER = {"sample_size": 16, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 6,
                         "attention_head_dim": 64, "num_attention_heads": 6, "joint_attention_dim": 96,
                         "caption_projection_dim": 384, "pooled_projection_dim": 80, "pos_embed_max_size": 32,
                         "dual_attention_layers": [0, 1, 2], "qk_norm": "rms_norm"}



@contextlib.contextmanager
def building(device: str, dtype: torch.dtype, seed: int) -> Iterator[None]:
    """Construct modules directly on ``device`` in ``dtype`` (random init happens there), with a fixed seed."""
    default_dtype = torch.get_default_dtype()
    devices = [torch.cuda.current_device()] if device == "cuda" else []  # the CUDA RNG is forked too
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                yield
        finally:
            torch.set_default_dtype(default_dtype)


def clip_config(arch: dict[str, Any], tokenizer):
    from transformers import CLIPTextConfig

    arch = dict(arch)
    vocab = max(int(arch.pop("vocab_size", 0)), len(tokenizer))
    return CLIPTextConfig(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **arch)


def t5_config(arch: dict[str, Any], tokenizer):
    from transformers import T5Config

    arch = dict(arch)
    vocab = max(int(arch.pop("vocab_size", 0)), len(tokenizer))
    return T5Config(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    decoder_start_token_id=tokenizer.pad_token_id, **arch)


def build_sd3_or_flux(architecture: str, seed: int, device: str = "cuda"):
    """SD3.5 Medium (``"sd35m"``) or FLUX.1-dev (``"flux-dev"``) at full size, built on ``device`` in bf16."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from ..testing.tiny_tokenizers import build_clip_tokenizer, build_t5_tokenizer
    dtype = torch.bfloat16
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    parts: dict[str, Any] = {}
    with building(device, dtype, seed):
        if architecture == "sd35m":
            clip_g_tok = build_clip_tokenizer(pad_token="!")
            parts["text_encoder"] = CLIPTextModelWithProjection(clip_config(CLIP_L_FULL, clip_tok))
            parts["text_encoder_2"] = CLIPTextModelWithProjection(clip_config(CLIP_G_FULL, clip_g_tok))
            parts["text_encoder_3"] = T5EncoderModel(t5_config(T5_XXL_FULL, t5_tok))
            parts["transformer"] = SD3Transformer2DModel(**SD35M_TRANSFORMER)
            parts["vae"] = AutoencoderKL(**VAE_FULL, scaling_factor=1.5305, shift_factor=0.0609)
            return StableDiffusion3Pipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER), tokenizer=clip_tok,
                tokenizer_2=clip_g_tok, tokenizer_3=t5_tok, **{k: v.eval() for k, v in parts.items()})
        parts["text_encoder"] = CLIPTextModel(clip_config(CLIP_L_FULL, clip_tok))
        parts["text_encoder_2"] = T5EncoderModel(t5_config(T5_XXL_FULL, t5_tok))
        parts["transformer"] = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER)
        parts["vae"] = AutoencoderKL(**VAE_FULL, scaling_factor=0.3611, shift_factor=0.1159)
        return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), tokenizer=clip_tok,
                            tokenizer_2=t5_tok, **{k: v.eval() for k, v in parts.items()})


def build_qwen_image(seed: int, device: str):
    """Qwen-Image at full size (the locally made Qwen2 tokenizer; its ids fit the real vocabulary)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ..testing.tiny_tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    text = dict(QWEN25_VL_7B_TEXT, rope_parameters=dict(QWEN25_VL_7B_TEXT["rope_parameters"]), bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(QWEN25_VL_7B_VISION),
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Qwen2_5_VLForConditionalGeneration(config),
                 "transformer": QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER),
                 "vae": AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)}
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), tokenizer=tokenizer,
                             **{k: v.eval() for k, v in parts.items()})


def build_wan(seed: int, device: str):
    """Wan 2.1 T2V 1.3B at full size, with the released UniPC scheduler configuration."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ..testing.tiny_tokenizers import build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    umt5 = dict(UMT5_XXL)
    vocab = max(int(umt5.pop("vocab_size")), len(tokenizer))
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": UMT5EncoderModel(UMT5Config(
                     vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     decoder_start_token_id=tokenizer.pad_token_id, **umt5)),
                 "transformer": WanTransformer3DModel(**WAN_1_3B_TRANSFORMER),
                 "vae": AutoencoderKLWan(**WAN_VAE)}
    return WanPipeline(tokenizer=tokenizer, scheduler=UniPCMultistepScheduler(**WAN_UNIPC_SCHEDULER),
                       **{k: v.eval() for k, v in parts.items()})
