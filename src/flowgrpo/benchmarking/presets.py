"""Benchmark presets: a model architecture (random weights, built from config, nothing downloaded) plus a run.

=================  =======  ======================================================================================
preset             device   what it runs
=================  =======  ======================================================================================
``tiny``           CPU      the tiny SD3 test pipeline (:func:`flowgrpo.testing.build_tiny_pipeline`), 64 px,
                            2 prompts x G=2, 4 steps, SDE window 2, OCR reward: a smoke test of the harness.
``small-cpu``      CPU      an SD3-style MMDiT of ~34 M parameters (6 blocks, 6 heads of 64, dual attention in
                            blocks 0-2, RMS q/k norm) with the tiny text encoders and VAE, float32, 128 px,
                            2 prompts x G=4 (micro-batches of 4), 6 steps, SDE window 2, no CFG, LoRA r=32,
                            OCR reward: large enough for the transformer to dominate a step on a CPU.
``sd35m-random``   CUDA     Stable Diffusion 3.5 Medium at full size (24 blocks, 24 heads of 64, joint attention
                            dim 4096, caption projection 1536, pooled projection 2048, dual attention in blocks
                            0-12, RMS q/k norm; CLIP-L, CLIP-G and T5-XXL encoders; the SD3 VAE), bf16, 512 px,
                            8 prompts x G=8, 10 steps, SDE window 3, CFG 4.5, LoRA r=32, KL beta 0.04, gradient
                            checkpointing (as recipes/ocr.yaml), OCR reward.
``flux-random``    CUDA     FLUX.1-dev at full size (19 double + 38 single blocks, 24 heads of 128, guidance
                            embedding; CLIP-L and T5-XXL; the FLUX VAE), bf16, 512 px, 8 prompts x G=8,
                            10 steps, SDE window 3, guidance 3.5 (embedded, one pass), LoRA r=32, OCR reward.
``toy``            CPU      the toy world (:func:`flowgrpo.toy.build.cached_toy_world`, pretrained, built on first
                            use) with the settings of ``recipes/toy.yaml``: 32 px, 4 prompts x G=8 in one
                            micro-batch, 8 steps with CFG 3, SDE window 2 in steps 0-3, LoRA r=32 on every linear
                            layer, ``toy_shape_score`` + 0.5 ``toy_color``.
``qwenimage-random`` CUDA   Qwen-Image at full size (60 MMDiT blocks, 24 heads of 128, 20.4 B parameters; the
                            Qwen2.5-VL-7B text encoder with its vision tower; the Qwen-Image VAE; the released
                            dynamic-shift schedule), bf16, 512 px, 4 prompts x G=8 (micro-batches of 4), 10 steps,
                            SDE window 3, true CFG 4.0 (two passes), LoRA r=32, gradient checkpointing, OCR reward.
``sd35m-nft-random`` CUDA  the ``sd35m-random`` model trained with DiffusionNFT (``recipes/nft_ocr.yaml``): bf16,
                            512 px, 8 prompts x G=8, CFG-free rollouts of 10 DPM-Solver++ 2M steps by the old
                            policy, 9 of the 10 noise levels trained per image (each: policy forward + backward,
                            old-policy forward, reference forward for beta 1e-4), LoRA r=32, gradient
                            checkpointing, OCR reward.
``tiny-nft``       CPU      the ``tiny`` preset trained with DiffusionNFT (3 of 4 noise levels): a smoke test of the
                            DiffusionNFT path of the harness.
``flux2-klein-random`` CUDA FLUX.2 [klein] 4B base at full size (5 double + 20 single blocks, 24 heads of 128;
                            Qwen3-4B; the FLUX.2 VAE), bf16, 512 px, 4 prompts x G=8 (micro-batches of 4), 10 steps,
                            SDE window 3, CFG 4.0 (two passes), LoRA r=32 on the FLUX.2 targets, gradient
                            checkpointing, OCR reward.
``flux2-random``   CUDA     FLUX.2 [dev] at full size (8 double + 48 single blocks, 48 heads of 128, 32 B; Mistral
                            Small 3.1 with its Pixtral tower), bf16, 512 px, 2 prompts x G=8 (micro-batches of 2),
                            10 steps, SDE window 3, guidance 4.0 (embedded, one pass), LoRA r=32, gradient
                            checkpointing, OCR reward.
``zimage-random``  CUDA     Z-Image Turbo at full size (6.2 B single-stream DiT; Qwen3-4B; the FLUX.1 VAE; shift 3),
                            bf16, 512 px, 4 prompts x G=8 (micro-batches of 8), 8 steps, SDE window 2, no CFG (as Turbo
                            samples), LoRA r=32 on attention and feed-forward, gradient checkpointing, OCR reward.
``qwenimage21-random`` CUDA Qwen-Image 2.1 at full size (32 single-stream block-causal blocks, 32 heads of 128, 7.1 B;
                            Qwen3-VL-8B with its vision tower; the 16x VAE), bf16, 512 px, 4 prompts x G=8
                            (micro-batches of 4), 10 steps, SDE window 3, true CFG 4.0, LoRA r=32 on attention,
                            gradient checkpointing, OCR reward.
``qwenimage-edit-plus-random`` CUDA  Qwen-Image-Edit-2509 at full size (the Qwen-Image model and encoder) editing with
                            a source image per prompt at the working size, bf16, 512 px, 2 prompts x G=8
                            (micro-batches of 2), 10 steps, SDE window 3, true CFG 4.0, LoRA r=32, gradient
                            checkpointing, OCR reward.
``wan-random``     CUDA     Wan 2.1 T2V 1.3B at full size (30 blocks, 12 heads of 128, FFN 8960; UMT5-XXL; the Wan
                            VAE; the released UniPC configuration with flow_shift 3.0, converted), bf16, 33 frames
                            of 480x832, 2 prompts x G=4 (micro-batches of 2), 10 steps, SDE window 3, CFG 5.0, LoRA
                            r=32 on attn1 / attn2, gradient checkpointing, JPEG-compressibility reward on frames.
``wan-i2v-random`` CUDA     Wan 2.1 I2V-14B at full size (40 blocks, 40 heads of 128, 36 input channels, CLIP
                            image tokens through attn2's added keys / values; UMT5-XXL; open-clip ViT-H/14; the Wan
                            VAE; UniPC flow_shift 3.0), bf16, 33 frames of 480x832 from a first frame, 1 prompt x G=4
                            (micro-batches of 1), 10 steps, SDE window 2, CFG 5.0, LoRA r=32 on attn1 / attn2 and the
                            image keys / values, gradient checkpointing, JPEG-compressibility reward on frames.
``ltx2-random``    CUDA     LTX-2 at full size (19 B: 48 blocks, video 32 heads of 128, audio 32 heads of 64,
                            audio-video cross-attention; Gemma 3 12B with the text connectors; the video and audio
                            VAEs and the vocoder; the dynamic shift), bf16, 33 frames of 512x768 with their audio,
                            1 prompt x G=4 (micro-batches of 1), 10 steps, SDE window 2, CFG 4.0 on both streams,
                            LoRA r=32 on the video stream's attention and feed-forward, gradient checkpointing,
                            JPEG-compressibility reward on frames.
``hunyuanvideo15-random`` CUDA  HunyuanVideo 1.5 480p text-to-video at full size (8.3 B: 54 double-stream blocks,
                            16 heads of 128, a 2-block token refiner; Qwen2.5-VL-7B's text model and ByT5-small; the
                            16x VAE; shift 7), bf16, 33 frames of 480x832, 1 prompt x G=4 (micro-batches of 1),
                            10 steps, SDE window 2, CFG 6.0, LoRA r=32 on the joint attention, gradient
                            checkpointing, JPEG-compressibility reward on frames.
=================  =======  ======================================================================================

The tokenizers are always the small locally made ones of :mod:`flowgrpo.testing.tiny_tokenizers` (their ids
fit any vocabulary); the full-size text encoders keep their real vocabulary sizes. Full-size models are built
directly on the GPU in bf16 (``torch.device("cuda")`` as the default device), so nothing of their size is ever
allocated on a CPU; on a machine without CUDA, :func:`build_preset_pipeline` raises before building anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.flux2 import FLUX2_LORA_TARGET_MODULES
from ..models.hunyuanvideo15 import HUNYUANVIDEO15_LORA_TARGET_MODULES
from ..models.ltx2 import LTX2_LORA_TARGET_MODULES
from ..models.qwenimage21 import QWENIMAGE21_LORA_TARGET_MODULES
from ..models.wan_i2v import WAN_I2V_LORA_TARGET_MODULES
from ..models.zimage import ZIMAGE_LORA_TARGET_MODULES
from ..toy.learning import TOY_LORA_TARGET_MODULES
from .full_size_components import (  # noqa: F401  (re-exported: the presets' architectures)
    CLIP_G_FULL,
    CLIP_L_FULL,
    FLUX_DEV_TRANSFORMER,
    FLUX_SCHEDULER,
    QWEN25_VL_7B_TEXT,
    QWEN25_VL_7B_VISION,
    QWEN_IMAGE_SCHEDULER,
    QWEN_IMAGE_TRANSFORMER,
    QWEN_IMAGE_VAE,
    SD3_SCHEDULER,
    SD35M_TRANSFORMER,
    SMALL_CPU_TRANSFORMER,
    T5_XXL_FULL,
    UMT5_XXL,
    VAE_FULL,
    WAN_1_3B_TRANSFORMER,
    WAN_14B_TRANSFORMER,
    WAN_LORA_TARGETS,
    WAN_UNIPC_SCHEDULER,
    WAN_VAE,
    build_qwen_image,
    build_sd3_or_flux,
    build_wan,
    building,
)

__all__ = ["BenchmarkPreset", "PRESETS", "get_preset", "build_preset_pipeline", "OCR_PROMPTS"]

# Prompts with quoted text for the OCR reward (each unique prompt is one GRPO group).
OCR_PROMPTS = [
    'a storefront sign that says "OPEN"',
    'a poster with the word "SALE" in bold red letters',
    'a coffee mug printed with "GOOD MORNING"',
    'a street sign reading "MAIN ST"',
    'a chalkboard with "MENU" written at the top',
    'a t-shirt with the slogan "HELLO WORLD"',
    'a book cover titled "FLOW"',
    'a neon sign that reads "BAR"',
    'a birthday cake with "HAPPY 30" in icing',
    'a license plate reading "ABC 123"',
    'a banner saying "WELCOME"',
    'a price tag showing "$19"',
]

@dataclass(frozen=True)
class BenchmarkPreset:
    """One benchmark configuration: which model to build and how to train it."""

    name: str
    description: str
    family: str                      # "sd3" | "flux" | "qwenimage" | "wan" | "flux2" | "flux2_klein" | "zimage" | ...
    architecture: str                # "tiny" | "small-cpu" | "sd35m" | "flux-dev" | "qwen-image" | "wan-1.3b" | "toy"
    device: str                      # "cpu" | "cuda"
    dtype: str                       # the trainer config's dtype
    resolution: int
    num_prompts: int
    num_generations: int
    per_device_train_batch_size: int
    num_inference_steps: int
    sde_window_size: int             # Flow-GRPO's SDE window (trained steps); unused by DiffusionNFT
    guidance_scale: float
    max_sequence_length: int
    reward: str | tuple[str, ...] = "ocr"
    reward_weights: tuple[float, ...] | None = None
    lora_rank: int = 32
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    gradient_checkpointing: bool = False
    beta: float = 0.0
    threads: str | int = "auto"      # the config's cpu_threads: the thread policy (flowgrpo.cpu_threads)
    reward_threads: int | None = None  # onnxruntime threads of the OCR reward; None: the thread policy's
    default_steps: int = 5
    warmup_steps: int = 1
    extra_args: dict[str, Any] = field(default_factory=dict)
    trainer: str = "flow_grpo"       # a name of flowgrpo.trainer.registry

    @property
    def images_per_step(self) -> int:
        return self.num_prompts * self.num_generations

    def config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the preset trainer's config (``FlowGRPOConfig`` or ``DiffusionNFTConfig``; without
        output_dir / max_steps). The SDE window and noise level go to the trainers whose configuration has them (the
        Flow-GRPO family)."""
        if self.images_per_step % self.per_device_train_batch_size:
            raise ValueError(f"preset {self.name!r}: {self.images_per_step} images per step is not a multiple of the "
                             f"micro-batch {self.per_device_train_batch_size}")
        # One optimizer step = one generation batch: accumulate over all of its micro-batches.
        kwargs = dict(
            per_device_train_batch_size=self.per_device_train_batch_size, num_generations=self.num_generations,
            gradient_accumulation_steps=self.images_per_step // self.per_device_train_batch_size,
            resolution=self.resolution, num_inference_steps=self.num_inference_steps,
            eval_num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            max_sequence_length=self.max_sequence_length, beta=self.beta, dtype=self.dtype, learning_rate=1e-4,
            use_cpu=self.device == "cpu", cpu_threads=str(self.threads),
        )
        from ..trainer.registry import config_class

        fields = {f.name for f in dataclasses.fields(config_class(self.trainer))}
        if {"sde_window_size", "noise_level"} <= fields:  # an SDE-window sampler (the Flow-GRPO family)
            kwargs.update(sde_window_size=self.sde_window_size, noise_level=0.7)
        if self.reward_weights is not None:
            kwargs["reward_weights"] = list(self.reward_weights)
        if self.gradient_checkpointing:
            kwargs["activation_checkpointing"] = True
        if self.device == "cuda" and self.dtype == "bfloat16":
            kwargs["bf16"] = True  # autocast, as in the recipes
        if self.reward == "ocr":
            kwargs["reward_kwargs"] = {"ocr": {"num_threads": self.reward_threads}} if self.reward_threads else None
        kwargs.update(self.extra_args)
        return kwargs


PRESETS: dict[str, BenchmarkPreset] = {
    "tiny": BenchmarkPreset(
        name="tiny", description="tiny SD3 test pipeline, 64 px, 2x2 images, 4 steps (smoke test)",
        family="sd3", architecture="tiny", device="cpu", dtype="float32", resolution=64, num_prompts=2,
        num_generations=2, per_device_train_batch_size=2, num_inference_steps=4, sde_window_size=2,
        guidance_scale=1.0, max_sequence_length=16, lora_rank=4, default_steps=2,
    ),
    "small-cpu": BenchmarkPreset(
        name="small-cpu", description="~34M-parameter SD3-style MMDiT, 128 px, 2 prompts x G=4, 6 steps, window 2",
        family="sd3", architecture="small-cpu", device="cpu", dtype="float32", resolution=128, num_prompts=2,
        num_generations=4, per_device_train_batch_size=4, num_inference_steps=6, sde_window_size=2,
        guidance_scale=1.0, max_sequence_length=32, lora_rank=32, default_steps=5,
    ),
    "sd35m-random": BenchmarkPreset(
        name="sd35m-random", description="SD3.5-Medium architecture, random weights, bf16, 512 px, 8x8, 10 steps",
        family="sd3", architecture="sd35m", device="cuda", dtype="bfloat16", resolution=512, num_prompts=8,
        num_generations=8, per_device_train_batch_size=8, num_inference_steps=10, sde_window_size=3,
        guidance_scale=4.5, max_sequence_length=256, lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        gradient_checkpointing=True, beta=0.04, default_steps=5,
    ),
    "flux-random": BenchmarkPreset(
        name="flux-random", description="FLUX.1-dev architecture, random weights, bf16, 512 px, 8x8, 10 steps",
        family="flux", architecture="flux-dev", device="cuda", dtype="bfloat16", resolution=512, num_prompts=8,
        num_generations=8, per_device_train_batch_size=8, num_inference_steps=10, sde_window_size=3,
        guidance_scale=3.5, max_sequence_length=256, lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        gradient_checkpointing=True, default_steps=5,
    ),
    "toy": BenchmarkPreset(
        name="toy", description="the toy world with recipes/toy.yaml: 32 px, 4x8 images, 8 steps, CFG 3, window 2",
        family="sd3", architecture="toy", device="cpu", dtype="float32", resolution=32, num_prompts=4,
        num_generations=8, per_device_train_batch_size=32, num_inference_steps=8, sde_window_size=2,
        guidance_scale=3.0, max_sequence_length=8, reward=("toy_shape_score", "toy_color"), reward_weights=(1.0, 0.5),
        lora_rank=32, lora_targets=TOY_LORA_TARGET_MODULES, default_steps=10, warmup_steps=2,
        extra_args={"sde_window_range": [0, 3], "scale_rewards": "group", "epsilon": 1e-3, "learning_rate": 3e-4},
    ),
    "qwenimage-random": BenchmarkPreset(
        name="qwenimage-random", description="Qwen-Image architecture, random weights, bf16, 512 px, 4x8, 10 steps",
        family="qwenimage", architecture="qwen-image", device="cuda", dtype="bfloat16", resolution=512,
        num_prompts=4, num_generations=8, per_device_train_batch_size=4, num_inference_steps=10, sde_window_size=3,
        guidance_scale=4.0, max_sequence_length=256, lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        gradient_checkpointing=True, default_steps=5,
    ),
    "sd35m-nft-random": BenchmarkPreset(
        name="sd35m-nft-random",
        description="SD3.5-Medium architecture, random weights, bf16, 512 px, 8x8, DiffusionNFT: 10 CFG-free steps, "
                    "9 noise levels trained",
        family="sd3", architecture="sd35m", device="cuda", dtype="bfloat16", resolution=512, num_prompts=8,
        num_generations=8, per_device_train_batch_size=8, num_inference_steps=10, sde_window_size=0,
        guidance_scale=1.0, max_sequence_length=256, lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        gradient_checkpointing=True, beta=1e-4, default_steps=5, trainer="diffusion_nft",
        extra_args={"sampler": "dpmpp_2m", "timestep_fraction": 0.99, "nft_beta": 0.1, "old_policy_decay_start": 75,
                    "old_policy_decay_rate": 0.0075, "old_policy_decay_max": 0.999},
    ),
    "tiny-nft": BenchmarkPreset(
        name="tiny-nft", description="tiny SD3 test pipeline, 64 px, 2x2 images, DiffusionNFT, 4 steps (smoke test)",
        family="sd3", architecture="tiny", device="cpu", dtype="float32", resolution=64, num_prompts=2,
        num_generations=2, per_device_train_batch_size=2, num_inference_steps=4, sde_window_size=0,
        guidance_scale=1.0, max_sequence_length=16, lora_rank=4, beta=1e-4, default_steps=2, trainer="diffusion_nft",
        extra_args={"timestep_fraction": 0.75},
    ),
    "wan-random": BenchmarkPreset(
        name="wan-random", description="Wan 2.1 T2V 1.3B architecture, random weights, bf16, 33x480x832, 2x4, 10 steps",
        family="wan", architecture="wan-1.3b", device="cuda", dtype="bfloat16", resolution=480, num_prompts=2,
        num_generations=4, per_device_train_batch_size=2, num_inference_steps=10, sde_window_size=3,
        guidance_scale=5.0, max_sequence_length=512, reward="jpeg_compressibility", lora_rank=32,
        lora_targets=WAN_LORA_TARGETS, gradient_checkpointing=True,
        default_steps=3, extra_args={"width": 832, "num_frames": 33},
    ),
    "flux2-klein-random": BenchmarkPreset(
        name="flux2-klein-random", description="FLUX.2 [klein] 4B base architecture, random weights, bf16, 512 px, 4x8, "
                                               "10 steps, CFG 4",
        family="flux2_klein", architecture="flux2-klein-4b", device="cuda", dtype="bfloat16", resolution=512,
        num_prompts=4, num_generations=8, per_device_train_batch_size=4, num_inference_steps=10, sde_window_size=3,
        guidance_scale=4.0, max_sequence_length=512, lora_rank=32, lora_targets=FLUX2_LORA_TARGET_MODULES,
        gradient_checkpointing=True, default_steps=5,
    ),
    "flux2-random": BenchmarkPreset(
        name="flux2-random", description="FLUX.2 [dev] architecture, random weights, bf16, 512 px, 2x8, 10 steps",
        family="flux2", architecture="flux2-dev", device="cuda", dtype="bfloat16", resolution=512, num_prompts=2,
        num_generations=8, per_device_train_batch_size=2, num_inference_steps=10, sde_window_size=3,
        guidance_scale=4.0, max_sequence_length=512, lora_rank=32, lora_targets=FLUX2_LORA_TARGET_MODULES,
        gradient_checkpointing=True, default_steps=3,
    ),
    "zimage-random": BenchmarkPreset(
        name="zimage-random", description="Z-Image Turbo architecture, random weights, bf16, 512 px, 4x8, 8 steps, "
                                          "no CFG",
        family="zimage", architecture="zimage-turbo", device="cuda", dtype="bfloat16", resolution=512, num_prompts=4,
        num_generations=8, per_device_train_batch_size=8, num_inference_steps=8, sde_window_size=2,
        guidance_scale=0.0, max_sequence_length=512, lora_rank=32, lora_targets=ZIMAGE_LORA_TARGET_MODULES,
        gradient_checkpointing=True, default_steps=5,
    ),
    "wan-i2v-random": BenchmarkPreset(
        name="wan-i2v-random", description="Wan 2.1 I2V-14B architecture, random weights, bf16, 33x480x832, 1x4, "
                                           "10 steps, CFG 5",
        family="wan_i2v", architecture="wan-i2v-14b", device="cuda", dtype="bfloat16", resolution=480, num_prompts=1,
        num_generations=4, per_device_train_batch_size=1, num_inference_steps=10, sde_window_size=2,
        guidance_scale=5.0, max_sequence_length=512, reward="jpeg_compressibility", lora_rank=32,
        lora_targets=WAN_I2V_LORA_TARGET_MODULES, gradient_checkpointing=True, default_steps=2,
        extra_args={"width": 832, "num_frames": 33},
    ),
    "ltx2-random": BenchmarkPreset(
        name="ltx2-random", description="LTX-2 (19B) architecture with its audio stream, random weights, bf16, "
                                        "33x512x768, 1x4, 10 steps, CFG 4",
        family="ltx2", architecture="ltx2-19b", device="cuda", dtype="bfloat16", resolution=512, num_prompts=1,
        num_generations=4, per_device_train_batch_size=1, num_inference_steps=10, sde_window_size=2,
        guidance_scale=4.0, max_sequence_length=1024, reward="jpeg_compressibility", lora_rank=32,
        lora_targets=LTX2_LORA_TARGET_MODULES, gradient_checkpointing=True, default_steps=2,
        extra_args={"width": 768, "num_frames": 33},
    ),
    "hunyuanvideo15-random": BenchmarkPreset(
        name="hunyuanvideo15-random", description="HunyuanVideo 1.5 480p T2V architecture, random weights, bf16, "
                                                  "33x480x832, 1x4, 10 steps, CFG 6",
        family="hunyuanvideo15", architecture="hunyuanvideo15-480p-t2v", device="cuda", dtype="bfloat16",
        resolution=480, num_prompts=1, num_generations=4, per_device_train_batch_size=1, num_inference_steps=10,
        sde_window_size=2, guidance_scale=6.0, max_sequence_length=1000, reward="jpeg_compressibility", lora_rank=32,
        lora_targets=HUNYUANVIDEO15_LORA_TARGET_MODULES, gradient_checkpointing=True, default_steps=2,
        extra_args={"width": 832, "num_frames": 33},
    ),
    "qwenimage21-random": BenchmarkPreset(
        name="qwenimage21-random", description="Qwen-Image 2.1 architecture, random weights, bf16, 512 px, 4x8, "
                                               "10 steps, true CFG 4",
        family="qwenimage21", architecture="qwen-image-2.1", device="cuda", dtype="bfloat16", resolution=512,
        num_prompts=4, num_generations=8, per_device_train_batch_size=4, num_inference_steps=10, sde_window_size=3,
        guidance_scale=4.0, max_sequence_length=256, lora_rank=32, lora_targets=QWENIMAGE21_LORA_TARGET_MODULES,
        gradient_checkpointing=True, default_steps=5,
    ),
    "qwenimage-edit-plus-random": BenchmarkPreset(
        name="qwenimage-edit-plus-random", description="Qwen-Image-Edit-Plus architecture, random weights, bf16, "
                                                       "512 px, a source image, 2x8, 10 steps, true CFG 4",
        family="qwenimage_edit_plus", architecture="qwen-image-edit-plus", device="cuda", dtype="bfloat16",
        resolution=512, num_prompts=2, num_generations=8, per_device_train_batch_size=2, num_inference_steps=10,
        sde_window_size=3, guidance_scale=4.0, max_sequence_length=256, lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        gradient_checkpointing=True, default_steps=3,
    ),
}


def get_preset(name: str) -> BenchmarkPreset:
    if name not in PRESETS:
        raise ValueError(f"Unknown benchmark preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]


def check_device(preset: BenchmarkPreset) -> None:
    """Fail early, with the fix, when the preset needs a GPU this machine does not have."""
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"Preset {preset.name!r} builds full-size models in bf16 on a CUDA GPU, but torch.cuda.is_available() is "
            f"False on this machine (torch {torch.__version__}). Run it on a GPU machine with a CUDA build of torch "
            f"(make install TORCH=cuda), or use a CPU preset: {', '.join(p for p, v in PRESETS.items() if v.device == 'cpu')}."
        )


def _build_full_size(preset: BenchmarkPreset, seed: int, device: str = "cuda"):
    """The full-size pipeline, built on ``device`` in bf16 ("meta" builds the structure only, for tests)."""
    from .full_size_families import FULL_SIZE_BUILDERS

    if preset.architecture in FULL_SIZE_BUILDERS:
        return FULL_SIZE_BUILDERS[preset.architecture](seed, device)
    if preset.architecture == "qwen-image":
        return build_qwen_image(seed, device)
    if preset.architecture == "wan-1.3b":
        return build_wan(seed, device)
    return build_sd3_or_flux(preset.architecture, seed, device)


def build_preset_pipeline(preset: BenchmarkPreset, seed: int = 0):
    """Build the preset's pipeline with random weights (nothing is downloaded).

    CPU presets come out in float32 on the CPU; the full-size presets in bf16 on the current CUDA device.
    """
    check_device(preset)
    if preset.architecture in ("tiny", "small-cpu"):
        from ..testing import build_tiny_pipeline

        pipe = build_tiny_pipeline(preset.family, seed=seed)
        if preset.architecture == "small-cpu":
            from diffusers import SD3Transformer2DModel

            with building("cpu", torch.float32, seed * 1009 + 104):
                transformer = SD3Transformer2DModel(**SMALL_CPU_TRANSFORMER).eval()
            pipe.register_modules(transformer=transformer)
        return pipe
    from .full_size_families import FULL_SIZE_BUILDERS

    if preset.architecture in ("sd35m", "flux-dev", "qwen-image", "wan-1.3b") or preset.architecture in FULL_SIZE_BUILDERS:
        return _build_full_size(preset, seed)
    if preset.architecture == "toy":
        from diffusers import DiffusionPipeline

        from ..toy.build import cached_toy_world

        return DiffusionPipeline.from_pretrained(cached_toy_world("full", seed=seed))
    raise ValueError(f"Preset {preset.name!r} has an unknown architecture {preset.architecture!r}.")
