"""Full-size architectures of the video families added with image-to-video (public configs of the released
checkpoints), built with random weights for the benchmark presets: Wan 2.1 I2V-14B (480p).

As for the other full-size presets, the tokenizer is the small locally made one of
:mod:`flowgrpo.testing.tiny_tokenizers` and the text encoder keeps its real vocabulary size. Each builder takes
``(seed, device)``; ``device="meta"`` builds the structure only (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .presets import UMT5_XXL, WAN_14B_TRANSFORMER, WAN_UNIPC_SCHEDULER, WAN_VAE

__all__ = ["CLIP_VIT_H_14_VISION", "HUNYUANVIDEO15_480P_T2V_TRANSFORMER", "LTX2_TRANSFORMER", "VIDEO_FULL_SIZE_BUILDERS",
           "WAN_I2V_14B_TRANSFORMER"]

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
# Its image encoder: open-clip ViT-H/14 (224 px, 16 x 16 patches + class token = 257 tokens), width 1280, 32 layers.
CLIP_VIT_H_14_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                        "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "projection_dim": 1024,
                        "hidden_act": "gelu", "layer_norm_eps": 1e-5}


def _build_wan_i2v_14b(seed: int, device: str):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from ..testing.tiny_tokenizers import build_t5_tokenizer
    from .presets import _building

    tokenizer = build_t5_tokenizer()
    umt5 = dict(UMT5_XXL)
    vocab = max(int(umt5.pop("vocab_size")), len(tokenizer))
    with _building(device, torch.bfloat16, seed):
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


#: Preset architecture name -> builder ``(seed, device) -> pipeline``.
VIDEO_FULL_SIZE_BUILDERS: dict[str, Callable[[int, str], Any]] = {
    "wan-i2v-14b": _build_wan_i2v_14b,
}
