"""Full-size architectures of the later image families (public configs of the released checkpoints), built with random
weights for the benchmark presets: FLUX.2 [dev], FLUX.2 [klein] 4B, Z-Image Turbo, Qwen-Image 2.1 and
Qwen-Image-Edit-Plus.

Like the other full-size presets, the tokenizers are the small locally made ones of
:mod:`flowgrpo.testing.tiny_tokenizers` (their ids fit the real vocabularies) and the text encoders keep their real
vocabulary sizes. Each builder takes ``(seed, device)``; ``device="meta"`` builds the structure only (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FULL_SIZE_BUILDERS", "FLUX2_DEV_TRANSFORMER", "FLUX2_KLEIN_4B_TRANSFORMER", "QWENIMAGE21_TRANSFORMER",
           "ZIMAGE_TURBO_TRANSFORMER"]

# FLUX.2 [dev] (black-forest-labs/FLUX.2-dev): 8 double- and 48 single-stream blocks, 48 heads of 128, guidance
# embedding; Mistral Small 3.1 (24 B) reads the prompt, its hidden states after layers 10, 20, 30 stacked (3 x 5120).
FLUX2_DEV_TRANSFORMER = {"patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48,
                         "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
                         "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32],
                         "rope_theta": 2000, "guidance_embeds": True}
MISTRAL_SMALL_31_TEXT = {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                         "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "vocab_size": 131072,
                         "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}}
PIXTRAL_VISION = {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14}
# FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B and -base-4B): 5 double- and 20 single-stream blocks, 24 heads
# of 128, no guidance embedding; Qwen3-4B reads the prompt (layers 9, 18, 27 stacked: 3 x 2560).
FLUX2_KLEIN_4B_TRANSFORMER = {**FLUX2_DEV_TRANSFORMER, "num_layers": 5, "num_single_layers": 20,
                              "num_attention_heads": 24, "joint_attention_dim": 7680, "guidance_embeds": False}
FLUX2_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 32,
             "norm_num_groups": 32}
FLUX2_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                   "time_shift_type": "exponential"}
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "vocab_size": 151936, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
# Z-Image Turbo (Tongyi-MAI/Z-Image-Turbo): the 6 B single-stream DiT (30 blocks of width 3840, 2 refiner blocks per
# stream), Qwen3-4B's second-to-last hidden state, the FLUX.1 VAE, a static shift of 3.
ZIMAGE_TURBO_TRANSFORMER = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840,
                            "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5,
                            "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0,
                            "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512]}
ZIMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
FLUX1_VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
             "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
             "layers_per_block": 2, "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024,
             "use_quant_conv": False, "use_post_quant_conv": False, "scaling_factor": 0.3611, "shift_factor": 0.1159}

# Qwen-Image 2.1 (Qwen/Qwen-Image-2.1): the single-stream block-causal transformer as diffusers' class defaults give it
# (32 blocks of 32 heads of 128, 7.1 B), the Qwen3-VL-8B encoder (with its vision tower) and the 16x, 64-channel VAE.
QWENIMAGE21_TRANSFORMER = {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32,
                           "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096,
                           "mlp_ratio": 3, "axes_dims_rope": [16, 56, 56], "causal_condition": True}
QWEN3_VL_8B_TEXT = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "vocab_size": 151936,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True,
                                        "rope_theta": 5000000.0}}
QWEN3_VL_8B_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
QWENIMAGE21_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                         "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
                         "time_shift_type": "exponential"}


def _qwen3_config(tokenizer):
    from transformers import Qwen3Config

    arch = dict(QWEN3_4B, rope_parameters=dict(QWEN3_4B["rope_parameters"]))
    arch["vocab_size"] = max(int(arch["vocab_size"]), len(tokenizer))
    return Qwen3Config(**arch, pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None)


def _build_flux2_klein(seed: int, device: str):
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3ForCausalLM

    from ..testing.tiny_tokenizers import build_qwen3_tokenizer
    from .full_size_components import building

    tokenizer = build_qwen3_tokenizer()
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Qwen3ForCausalLM(_qwen3_config(tokenizer)),
                 "transformer": Flux2Transformer2DModel(**FLUX2_KLEIN_4B_TRANSFORMER),
                 "vae": AutoencoderKLFlux2(**FLUX2_VAE)}
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), tokenizer=tokenizer,
                              is_distilled=False, **{k: v.eval() for k, v in parts.items()})


def _build_flux2_dev(seed: int, device: str):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from ..testing.tiny_tokenizers import build_mistral_tokenizer
    from .full_size_components import building

    tokenizer = build_mistral_tokenizer()
    text = dict(MISTRAL_SMALL_31_TEXT, rope_parameters=dict(MISTRAL_SMALL_31_TEXT["rope_parameters"]),
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    config = Mistral3Config(text_config=text, vision_config=dict(PIXTRAL_VISION), spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Mistral3ForConditionalGeneration(config),
                 "transformer": Flux2Transformer2DModel(**FLUX2_DEV_TRANSFORMER),
                 "vae": AutoencoderKLFlux2(**FLUX2_VAE)}
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), tokenizer=tokenizer,
                         **{k: v.eval() for k, v in parts.items()})


def _build_zimage_turbo(seed: int, device: str):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from ..testing.tiny_tokenizers import build_qwen3_tokenizer
    from .full_size_components import building

    tokenizer = build_qwen3_tokenizer()
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Qwen3Model(_qwen3_config(tokenizer)),
                 "transformer": ZImageTransformer2DModel(**ZIMAGE_TURBO_TRANSFORMER),
                 "vae": AutoencoderKL(**FLUX1_VAE)}
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), tokenizer=tokenizer,
                          **{k: v.eval() for k, v in parts.items()})


def qwenimage21_processor():
    """Qwen-Image 2.1's processor: the locally made Qwen tokenizer with Qwen3-VL's chat template and an image-only
    Qwen3-VL processor (16-pixel patches, 2 x 2 merge)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..testing.tiny_qwenimage21 import QWEN3_VL_CHAT_TEMPLATE, ImageOnlyQwen3VLProcessor
    from ..testing.tiny_tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return ImageOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2),
        tokenizer=tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE)


def _build_qwenimage21(seed: int, device: str):
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .full_size_components import building

    processor = qwenimage21_processor()
    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    text = dict(QWEN3_VL_8B_TEXT, rope_parameters=dict(QWEN3_VL_8B_TEXT["rope_parameters"]), bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = Qwen3VLConfig(text_config=text, vision_config=dict(QWEN3_VL_8B_VISION),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    with building(device, torch.bfloat16, seed):
        parts = {"text_encoder": Qwen3VLForConditionalGeneration(config),
                 "transformer": QwenImage21Transformer2DModel(**QWENIMAGE21_TRANSFORMER),
                 "vae": AutoencoderKLQwenImage21()}
    return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE21_SCHEDULER), processor=processor,
                               **{k: v.eval() for k, v in parts.items()})


def _build_qwenimage_edit_plus(seed: int, device: str):
    """Qwen-Image-Edit-2509 / 2511: the Qwen-Image components with an image-only Qwen2-VL processor."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..testing.tiny_qwenimage import ImageOnlyQwen2VLProcessor
    from .full_size_components import build_qwen_image

    components = dict(build_qwen_image(seed, device).components)
    components["processor"] = ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=components["tokenizer"])
    return QwenImageEditPlusPipeline(**components)


#: Preset architecture name -> builder ``(seed, device) -> pipeline``.
FULL_SIZE_BUILDERS: dict[str, Callable[[int, str], Any]] = {
    "flux2-dev": _build_flux2_dev,
    "flux2-klein-4b": _build_flux2_klein,
    "zimage-turbo": _build_zimage_turbo,
    "qwen-image-2.1": _build_qwenimage21,
    "qwen-image-edit-plus": _build_qwenimage_edit_plus,
}

# The video families' full-size builders (flowgrpo.benchmarking.full_size_video) share the presets' lookup.
from .full_size_video import VIDEO_FULL_SIZE_BUILDERS  # noqa: E402

FULL_SIZE_BUILDERS.update(VIDEO_FULL_SIZE_BUILDERS)
