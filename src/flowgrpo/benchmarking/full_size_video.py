"""Full-size architectures of the video families added with image-to-video, LTX-2 and HunyuanVideo 1.5 (public configs
of the released checkpoints), built with random weights for the benchmark presets: Wan 2.1 I2V-14B (480p), LTX-2
(19B, with its audio stream) and HunyuanVideo 1.5 480p text-to-video.

As for the other full-size presets, the tokenizer is the small locally made one of
:mod:`flowgrpo.testing.tiny_tokenizers` and the text encoder keeps its real vocabulary size. Each builder takes
``(seed, device)``; ``device="meta"`` builds the structure only (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .full_size_components import UMT5_XXL, WAN_14B_TRANSFORMER, WAN_UNIPC_SCHEDULER, WAN_VAE

__all__ = ["BYT5_SMALL", "CLIP_VIT_H_14_VISION", "GEMMA3_12B_TEXT", "HUNYUANVIDEO15_480P_T2V_TRANSFORMER", "LTX2_AUDIO_VAE",
           "LTX2_CONNECTORS", "LTX2_SCHEDULER", "LTX2_TRANSFORMER", "LTX2_VAE", "LTX2_VOCODER", "SIGLIP_SO400M_VISION",
           "VIDEO_FULL_SIZE_BUILDERS", "WAN_I2V_14B_TRANSFORMER"]

# Wan 2.1 I2V-14B (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): the 14B T2V blocks with 36 input channels (noise, first-frame
# mask, condition latents), CLIP image tokens of width 1280 projected to the model width (5120) and attended through
# their own keys / values in every cross-attention.
WAN_I2V_14B_TRANSFORMER = {**WAN_14B_TRANSFORMER, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# LTX-2 (Lightricks/LTX-2, the 19B audio-video transformer): diffusers' own conversion of the released checkpoint
# (scripts/convert_ltx2_to_diffusers.py, get_ltx2_transformer_config) writes the class defaults of
# LTX2VideoTransformer3DModel with split RoPE: 48 blocks, video 32 heads of 128 (4096 wide), audio 32 heads of 64
# (2048 wide), 128 latent channels in both streams, Gemma 3 captions of width 3840.
LTX2_TRANSFORMER = {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
                    "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096,
                    "audio_in_channels": 128, "audio_out_channels": 128, "audio_num_attention_heads": 32,
                    "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048, "num_layers": 48,
                    "caption_channels": 3840, "norm_elementwise_affine": False, "rope_type": "split"}
# HunyuanVideo 1.5 480p text-to-video (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v,
# transformer/config.json): 54 double-stream blocks, 16 heads of 128 (2048 wide), 65 input channels (32 noise + 32
# condition latents + a mask), Qwen2.5-VL-7B text of width 3584, ByT5 glyph text of width 1472, SigLIP image tokens
# of width 1152 (the class defaults, with task_type "t2v").
HUNYUANVIDEO15_480P_T2V_TRANSFORMER = {
    "in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54,
    "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm",
    "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_theta": 256.0,
    "rope_axes_dim": (16, 56, 56), "target_size": 640, "task_type": "t2v", "use_meanflow": False}
# The rest of LTX-2's pipeline, as diffusers' conversion script writes it: the text connectors (2 layers of 30 heads of
# 128 per stream, 128 learnable registers, 49 stacked Gemma hidden states), the video VAE (32x in space, 8x in time,
# 128 latent channels), the audio VAE (64 mel bins, 8 latent channels) and the vocoder (24 kHz).
LTX2_CONNECTORS = {"caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
                   "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
                   "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
                   "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
                   "audio_connector_num_learnable_registers": 128, "connector_rope_base_seq_len": 4096,
                   "rope_theta": 10000.0, "rope_double_precision": True, "causal_temporal_positioning": False,
                   "rope_type": "split"}
LTX2_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": (256, 512, 1024, 2048),
            "down_block_types": ("LTX2VideoDownBlock3D",) * 4, "decoder_block_out_channels": (256, 512, 1024),
            "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5),
            "spatio_temporal_scaling": (True, True, True, True), "decoder_spatio_temporal_scaling": (True, True, True),
            "decoder_inject_noise": (False, False, False, False),
            "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            "upsample_residual": (True, True, True), "upsample_factor": (2, 2, 2), "timestep_conditioning": False,
            "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "encoder_causal": True,
            "decoder_causal": False, "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "reflect",
            "spatial_compression_ratio": 32, "temporal_compression_ratio": 8}
LTX2_AUDIO_VAE = {"base_channels": 128, "output_channels": 2, "ch_mult": (1, 2, 4), "num_res_blocks": 2,
                  "attn_resolutions": None, "in_channels": 2, "resolution": 256, "latent_channels": 8,
                  "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0, "mid_block_add_attention": False,
                  "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True, "mel_bins": 64, "double_z": True}
LTX2_VOCODER = {"in_channels": 128, "hidden_channels": 1024, "out_channels": 2,
                "upsample_kernel_sizes": [16, 15, 8, 4, 4], "upsample_factors": [6, 5, 2, 2, 2],
                "resnet_kernel_sizes": [3, 7, 11], "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                "leaky_relu_negative_slope": 0.1, "output_sampling_rate": 24000}
#: LTX-2's dynamic shift: linear in the video token count from 0.95 (1024 tokens) to 2.05 (4096 tokens).
LTX2_SCHEDULER = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
                  "max_image_seq_len": 4096}
# Its text encoder, Gemma 3 12B (google/gemma-3-12b-it): 48 layers of width 3840, 16 query / 8 key-value heads of 256,
# five sliding-window layers (1024) to one global; the SigLIP-So400m vision tower (27 layers of 1152, 896 px).
GEMMA3_12B_TEXT = {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                   "max_position_embeddings": 131072, "vocab_size": 262208}
SIGLIP_SO400M_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                        "num_attention_heads": 16, "image_size": 896, "patch_size": 14, "vision_use_head": False}

# HunyuanVideo 1.5's text encoders: Qwen2.5-VL-7B's text model (QWEN25_VL_7B_TEXT) and ByT5-small's encoder (Glyph-SDXL
# v2's: 12 layers of width 1472, 6 heads of 64, gated-GELU 3584); its VAE (32 latent channels, 16x in space, 4x in
# time, the class defaults of AutoencoderKLHunyuanVideo15); the 480p scheduler (fixed shift 7).
BYT5_SMALL = {"d_model": 1472, "d_kv": 64, "d_ff": 3584, "num_layers": 12, "num_heads": 6,
              "relative_attention_num_buckets": 32, "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu"}
HUNYUANVIDEO15_SCHEDULER = {"shift": 7.0}
# Its image encoder: open-clip ViT-H/14 (224 px, 16 x 16 patches + class token = 257 tokens), width 1280, 32 layers.
CLIP_VIT_H_14_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                        "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "projection_dim": 1024,
                        "hidden_act": "gelu", "layer_norm_eps": 1e-5}


def _build_wan_i2v_14b(seed: int, device: str):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from ..testing.tiny_tokenizers import build_t5_tokenizer
    from .full_size_components import building

    tokenizer = build_t5_tokenizer()
    umt5 = dict(UMT5_XXL)
    vocab = max(int(umt5.pop("vocab_size")), len(tokenizer))
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": UMT5EncoderModel(UMT5Config(
                     vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     decoder_start_token_id=tokenizer.pad_token_id, **umt5)),
                 "image_encoder": CLIPVisionModel(CLIPVisionConfig(**CLIP_VIT_H_14_VISION)),
                 "transformer": WanTransformer3DModel(**WAN_I2V_14B_TRANSFORMER),
                 "vae": AutoencoderKLWan(**WAN_VAE)}
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    return WanImageToVideoPipeline(tokenizer=tokenizer, scheduler=UniPCMultistepScheduler(**WAN_UNIPC_SCHEDULER),
                                   image_processor=processor, **{k: v.eval() for k, v in parts.items()})


def _build_ltx2(seed: int, device: str):
    """LTX-2 at full size: the 19B transformer, Gemma 3 12B (with its vision tower, never called in text-to-video),
    the connectors, both VAEs and the vocoder."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from ..testing.tiny_ltx2 import build_gemma_tokenizer
    from .full_size_components import building

    tokenizer = build_gemma_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")}
    config = Gemma3Config(text_config=dict(GEMMA3_12B_TEXT, pad_token_id=tokenizer.pad_token_id),
                          vision_config=dict(SIGLIP_SO400M_VISION), mm_tokens_per_image=256,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"])
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Gemma3ForConditionalGeneration(config),
                 "transformer": LTX2VideoTransformer3DModel(**LTX2_TRANSFORMER),
                 "connectors": LTX2TextConnectors(**LTX2_CONNECTORS), "vae": AutoencoderKLLTX2Video(**LTX2_VAE),
                 "audio_vae": AutoencoderKLLTX2Audio(**LTX2_AUDIO_VAE), "vocoder": LTX2Vocoder(**LTX2_VOCODER)}
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER), tokenizer=tokenizer,
                        **{k: v.eval() for k, v in parts.items()})


def _build_hunyuanvideo15_480p(seed: int, device: str):
    """HunyuanVideo 1.5 480p text-to-video at full size: the 8.3B transformer, Qwen2.5-VL-7B's text model, ByT5-small's
    encoder, the VAE; the guider is plain CFG (the trainer applies its own guidance scale)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from ..testing.tiny_tokenizers import build_qwen3_tokenizer
    from .full_size_components import QWEN25_VL_7B_TEXT, building

    tokenizer, tokenizer_2 = build_qwen3_tokenizer(), ByT5Tokenizer()
    text = dict(QWEN25_VL_7B_TEXT, rope_parameters=dict(QWEN25_VL_7B_TEXT["rope_parameters"]),
                pad_token_id=tokenizer.pad_token_id)
    text["vocab_size"] = max(int(text["vocab_size"]), len(tokenizer))
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**text)),
                 "text_encoder_2": T5EncoderModel(T5Config(vocab_size=len(tokenizer_2),
                                                           pad_token_id=tokenizer_2.pad_token_id,
                                                           eos_token_id=tokenizer_2.eos_token_id, **BYT5_SMALL)),
                 "transformer": HunyuanVideo15Transformer3DModel(**HUNYUANVIDEO15_480P_T2V_TRANSFORMER),
                 "vae": AutoencoderKLHunyuanVideo15()}
    return HunyuanVideo15Pipeline(tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                  scheduler=FlowMatchEulerDiscreteScheduler(**HUNYUANVIDEO15_SCHEDULER),
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0),
                                  **{k: v.eval() for k, v in parts.items()})


#: Preset architecture name -> builder ``(seed, device) -> pipeline``.
VIDEO_FULL_SIZE_BUILDERS: dict[str, Callable[[int, str], Any]] = {
    "wan-i2v-14b": _build_wan_i2v_14b,
    "ltx2-19b": _build_ltx2,
    "hunyuanvideo15-480p-t2v": _build_hunyuanvideo15_480p,
}
