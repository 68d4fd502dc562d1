"""Train the toy world's text-to-image model and save it as a stock ``StableDiffusion3Pipeline`` folder.

Steps (all on CPU, deterministic for a seed on a given machine and thread count):

1. **Text stack**: the CLIP-L-, CLIP-G- and T5-like encoders and tokenizers of
   :func:`flowgrpo.testing.build_tiny_pipeline` (``"sd3"``, random frozen weights, locally made tokenizers).
   The two CLIP tokenizers get ``model_max_length = clip_max_length`` (12: the longest caption is 11 CLIP tokens),
   which the pipeline uses as its CLIP sequence length; the encoders themselves are unchanged.
2. **Data**: the scenes of :func:`~flowgrpo.toy.world.split_scenes` (216 in all, disjoint train/eval), each train
   scene rendered ``images_per_scene`` times with its own jitter.
3. **VAE**: a small ``AutoencoderKL`` (``len(vae_channels) - 1`` downsamplings, ``latent_channels`` channels)
   trained on the renderings (L1 + MSE + a small KL term); ``shift_factor`` and ``scaling_factor`` are then set
   so that scaled latents have zero mean and unit variance, as the SD3 pipeline expects.
4. **Transformer**: an ``SD3Transformer2DModel`` trained with rectified flow matching on the cached latents
   (x_s = (1 - s) x0 + s eps, target eps - x0, s drawn like the shifted sampling schedule), conditioned on the
   pipeline's own ``encode_prompt`` embeddings; the prompt is swapped for the empty prompt with probability
   ``cfg_dropout`` so that classifier-free guidance works. T5 embeddings are taken at ``max_sequence_length``
   tokens (8, what the recipes pass: the CLIP embeddings carry the whole caption and T5 its first words, and 20
   text tokens instead of 32 make every transformer pass of the build and of RL on the world about 20% cheaper) and, for a fraction ``long_sequence_fraction`` of batches, at the pipeline's
   default of 256 tokens, so that a plain ``pipe(prompt)`` works too. The saved weights are an exponential moving
   average.
5. **Save**: ``StableDiffusion3Pipeline.save_pretrained`` (safetensors), plus ``prompts_train.txt``,
   ``prompts_eval.txt`` and ``toy_world.json`` (seed, settings, recommended generation settings, accuracies, and
   the :func:`builder_digest` of the code that made it).

The recipes' world (preset ``full``, seed 0, one thread) ships with the package (``SHIPPED_WORLD_DIR``, 4.4 MB):
:func:`cached_toy_world` copies it instead of spending minutes on a build, as long as its recorded digest is that of
the current builder. The tests build the ``light`` preset through the same code, and check that the shipped world's
text encoders and component configs are what the builder makes now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .world import Scene, render, split_scenes

__all__ = [
    "ToyWorldConfig",
    "PRESETS",
    "build_toy_world",
    "train_toy_pipeline",
    "evaluate_pipeline",
    "read_prompts",
    "cached_toy_world",
    "builder_digest",
    "shipped_toy_world",
    "SHIPPED_WORLD_DIR",
]

PROMPTS_TRAIN_FILE = "prompts_train.txt"
PROMPTS_EVAL_FILE = "prompts_eval.txt"
METADATA_FILE = "toy_world.json"
PIPELINE_DEFAULT_SEQUENCE_LENGTH = 256
BUILD_REVISION = 3
"""Bumped whenever the world or its training changes, so that cached worlds are rebuilt."""
SHIPPED_WORLD_DIR = Path(__file__).parent / "shipped_world"
"""The recipes' world (preset ``full``, seed 0) as this builder made it with one thread, shipped with the package so
that nobody waits minutes for it (``scripts/make_toy_world.py --ship`` remakes it)."""
SHIPPED_PRESET, SHIPPED_SEED = "full", 0

_LAST_BUILD_INFO: dict[str, Any] = {}


@dataclasses.dataclass
class ToyWorldConfig:
    """Everything that decides the toy world besides the seed (see the module docstring for the steps)."""

    resolution: int = 32
    eval_fraction: float = 0.2
    images_per_scene: int = 24
    clip_max_length: int = 12
    max_sequence_length: int = 8
    long_sequence_fraction: float = 0.0
    # VAE
    vae_channels: tuple[int, ...] = (8, 16, 16)
    latent_channels: int = 8
    vae_steps: int = 800
    vae_batch_size: int = 32
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    vae_foreground_weight: float = 4.0
    # transformer
    patch_size: int = 2
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    transformer_steps: int = 1500
    transformer_batch_size: int = 64
    transformer_lr: float = 1e-3
    cfg_dropout: float = 0.1
    ema_decay: float = 0.995
    scheduler_shift: float = 3.0
    # recommended generation settings (written to toy_world.json and used for the accuracies)
    num_inference_steps: int = 20
    guidance_scale: float = 3.0
    eval_images_per_prompt: int = 4


PRESETS: dict[str, ToyWorldConfig] = {
    "full": ToyWorldConfig(),
    "light": ToyWorldConfig(images_per_scene=4, vae_steps=40, transformer_steps=40, transformer_batch_size=32,
                            eval_images_per_prompt=1, num_inference_steps=4),
}
"""``full`` is the world the recipes use; ``light`` is a seconds-long build of the same shape for tests."""


class _ToyT5TruncationFilter(logging.Filter):
    """Drops the SD3 pipeline's warning that a prompt was cut at the toy world's T5 length: the world reads the first
    ``max_sequence_length`` (8) T5 tokens of a caption by design (its CLIP encoders carry the whole caption), so the
    warning would repeat for nearly every prompt. Other truncations (other lengths, CLIP) still warn."""

    def __init__(self, length: int):
        super().__init__()
        self.marker = f"`max_sequence_length` is set to  {length} tokens"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.marker not in record.getMessage()


def quiet_toy_truncation_warnings(length: int | None = None) -> None:
    """Install :class:`_ToyT5TruncationFilter` for the toy world's T5 length (once per process)."""
    length = ToyWorldConfig.max_sequence_length if length is None else int(length)
    target = logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")
    if not any(isinstance(f, _ToyT5TruncationFilter) and f.marker.endswith(f" {length} tokens") for f in target.filters):
        target.addFilter(_ToyT5TruncationFilter(length))


def _log_default(message: str) -> None:
    print(message, flush=True)


def _seed_everything(seed: int) -> torch.Generator:
    torch.set_flush_denormal(True)  # tiny gradients of a tiny model: denormal floats slow CPU kernels tenfold
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------------------------


def _make_vae(config: ToyWorldConfig):
    from diffusers import AutoencoderKL

    levels = len(config.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(config.vae_channels),
        layers_per_block=1,
        latent_channels=config.latent_channels,
        norm_num_groups=1,
        sample_size=config.resolution,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )


def _make_transformer(config: ToyWorldConfig, joint_attention_dim: int, pooled_projection_dim: int):
    from diffusers import SD3Transformer2DModel

    latent_size = config.resolution // 2 ** (len(config.vae_channels) - 1)
    inner = config.num_attention_heads * config.attention_head_dim
    return SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=config.patch_size,
        in_channels=config.latent_channels,
        out_channels=config.latent_channels,
        num_layers=config.num_layers,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
        joint_attention_dim=joint_attention_dim,
        caption_projection_dim=inner,
        pooled_projection_dim=pooled_projection_dim,
        pos_embed_max_size=max(latent_size // config.patch_size, 4),
        qk_norm="rms_norm",
    )


def _text_stack(seed: int, config: ToyWorldConfig):
    """Encoders and tokenizers of the tiny SD3 pipeline, frozen, with the CLIP sequence length set."""
    from flowgrpo.testing import build_tiny_pipeline

    tiny = build_tiny_pipeline("sd3", seed=seed)
    for tokenizer in (tiny.tokenizer, tiny.tokenizer_2):
        tokenizer.model_max_length = config.clip_max_length
    tiny.tokenizer_max_length = config.clip_max_length
    for encoder in (tiny.text_encoder, tiny.text_encoder_2, tiny.text_encoder_3):
        encoder.requires_grad_(False).eval()
    return tiny


@torch.no_grad()
def _encode(pipe, prompts: Sequence[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=list(prompts), prompt_2=None, prompt_3=None, device=torch.device("cpu"),
        do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
    )
    return embeds.float(), pooled.float()


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def _render_dataset(scenes: Sequence[Scene], config: ToyWorldConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 3, H, W) and the index of each image's scene."""
    images, labels = [], []
    for index, scene in enumerate(scenes):
        for k in range(config.images_per_scene):
            rng = np.random.default_rng([seed, index, k])
            images.append(np.asarray(render(scene, config.resolution, rng)))
            labels.append(index)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return pixels, torch.tensor(labels, dtype=torch.long)


def _to_unit(pixels_uint8: torch.Tensor) -> torch.Tensor:
    return pixels_uint8.float() / 127.5 - 1.0


def _cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train_vae(vae, pixels: torch.Tensor, config: ToyWorldConfig, generator: torch.Generator,
               log: Callable[[str], None]) -> None:
    vae.train()
    # Start with a small posterior std (the log-variance half of the encoder output); with the default std of 1
    # the sampling noise drowns the latents early on and the decoder settles for grey blobs.
    with torch.no_grad():
        vae.encoder.conv_out.bias[config.latent_channels:].fill_(-6.0)
    # Channels-last convolutions: 1.2x faster on a CPU for these small channel counts (the saved weights are
    # ordinary contiguous tensors: ``save_pretrained`` writes them in the standard layout).
    vae.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
    n = pixels.shape[0]
    start = time.time()
    for step in range(config.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(step, config.vae_steps, config.vae_lr, warmup=max(1, config.vae_steps // 20))
        batch = _to_unit(pixels[torch.randint(0, n, (config.vae_batch_size,), generator=generator)])
        batch = batch.contiguous(memory_format=torch.channels_last)
        posterior = vae.encode(batch).latent_dist
        noise = torch.randn(posterior.mean.shape, generator=generator)
        latents = posterior.mean + posterior.std * noise
        recon = vae.decode(latents).sample
        # Objects cover a tenth of the canvas: weight their pixels up so that colour and shape are learned early.
        weight = 1.0 + config.vae_foreground_weight * (batch.max(dim=1, keepdim=True).values > -0.9).float()
        error = recon - batch
        loss = (weight * (error.abs() + error.square())).mean() + config.vae_kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % max(1, config.vae_steps // 5) == 0 or step == config.vae_steps - 1:
            log(f"  vae step {step + 1}/{config.vae_steps}  loss {loss.item():.4f}  ({time.time() - start:.0f}s)")
    vae.to(memory_format=torch.contiguous_format).eval()


@torch.no_grad()
def _reconstruction_accuracy(vae, scenes: Sequence[Scene], config: ToyWorldConfig, seed: int) -> dict[str, float]:
    """Attribute accuracies of VAE reconstructions of fresh renderings: the ceiling of the whole pipeline."""
    from PIL import Image

    from .rewards import score_images

    pixels = torch.from_numpy(np.stack([np.asarray(render(s, config.resolution, np.random.default_rng([seed, 7, i])))
                                        for i, s in enumerate(scenes)])).permute(0, 3, 1, 2)
    decoded = vae.decode(vae.encode(_to_unit(pixels)).latent_dist.mean).sample
    arrays = ((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    checks = score_images([s.caption for s in scenes], [Image.fromarray(a) for a in arrays])
    return {k: float(np.mean([c[k] for c in checks])) for k in ("color", "shape", "count", "position")}


@torch.no_grad()
def _encode_latents(vae, pixels: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    chunks = [vae.encode(_to_unit(pixels[i:i + batch_size])).latent_dist.mean
              for i in range(0, pixels.shape[0], batch_size)]
    return torch.cat(chunks)


def _sample_sigmas(batch: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Noise levels distributed like the shifted sampling schedule: s = shift t / (1 + (shift - 1) t), t ~ U(0, 1)."""
    t = torch.rand(batch, generator=generator)
    return shift * t / (1 + (shift - 1) * t)


def _train_transformer(transformer, latents: torch.Tensor, labels: torch.Tensor,
                       text: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       empty: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       config: ToyWorldConfig, generator: torch.Generator, log: Callable[[str], None]) -> None:
    """Rectified flow matching with prompt dropout; ``transformer`` ends holding the EMA weights."""
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.transformer_lr, weight_decay=0.01)
    ema = [p.detach().clone() for p in params]
    n = latents.shape[0]
    start = time.time()
    steps = config.transformer_steps
    for step in range(steps):
        lr = _cosine_lr(step, steps, config.transformer_lr, warmup=max(1, steps // 20))
        for group in optimizer.param_groups:
            group["lr"] = lr
        long = torch.rand((), generator=generator).item() < config.long_sequence_fraction
        key = "long" if long else "short"
        index = torch.randint(0, n, (config.transformer_batch_size,), generator=generator)
        x0 = latents[index]
        embeds, pooled = text[key][0][labels[index]], text[key][1][labels[index]]
        drop = torch.rand(config.transformer_batch_size, generator=generator) < config.cfg_dropout
        embeds = torch.where(drop[:, None, None], empty[key][0], embeds)
        pooled = torch.where(drop[:, None], empty[key][1], pooled)
        sigma = _sample_sigmas(config.transformer_batch_size, config.scheduler_shift, generator)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma[:, None, None, None]
        noisy = (1 - s) * x0 + s * noise
        pred = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds,
                           pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        decay = min(config.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p.detach(), 1 - decay)
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"  transformer step {step + 1}/{steps}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"({time.time() - start:.0f}s)")
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    transformer.eval()


def train_toy_pipeline(seed: int = 0, config: ToyWorldConfig | str = "full",
                       log: Callable[[str], None] = _log_default):
    """Render the data, train the VAE and the transformer; returns ``(pipeline, train_scenes, eval_scenes)``.

    The pipeline is a float32 ``StableDiffusion3Pipeline`` in memory (not yet saved).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    config = _resolve_config(config)
    quiet_toy_truncation_warnings(config.max_sequence_length)
    _LAST_BUILD_INFO.clear()
    generator = _seed_everything(seed)
    train_scenes, eval_scenes = split_scenes(seed, config.eval_fraction)
    prompts = [s.caption for s in train_scenes]

    start = time.time()
    tiny = _text_stack(seed, config)
    log(f"[toy world] seed {seed}: {len(train_scenes)} train / {len(eval_scenes)} eval scenes, "
        f"{config.resolution} px")
    pixels, labels = _render_dataset(train_scenes, config, seed)
    log(f"[toy world] rendered {pixels.shape[0]} images ({time.time() - start:.0f}s)")

    text = {"short": _encode(tiny, prompts, config.max_sequence_length),
            "long": _encode(tiny, prompts, PIPELINE_DEFAULT_SEQUENCE_LENGTH)}
    empty = {"short": _encode(tiny, [""], config.max_sequence_length),
             "long": _encode(tiny, [""], PIPELINE_DEFAULT_SEQUENCE_LENGTH)}

    torch.manual_seed(seed)
    vae = _make_vae(config)
    log(f"[toy world] training the VAE ({sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M parameters)")
    _train_vae(vae, pixels, config, generator, log)
    raw = _encode_latents(vae, pixels)
    recon = _reconstruction_accuracy(vae, eval_scenes, config, seed)
    _LAST_BUILD_INFO["vae_reconstruction_accuracy"] = recon
    log("[toy world] VAE reconstruction accuracy on eval scenes: "
        + ", ".join(f"{k} {v:.1%}" for k, v in recon.items()))
    shift, std = raw.mean().item(), raw.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    latents = (raw - shift) / std

    joint_dim = tiny.transformer.config.joint_attention_dim
    pooled_dim = tiny.transformer.config.pooled_projection_dim
    torch.manual_seed(seed + 1)
    transformer = _make_transformer(config, joint_dim, pooled_dim)
    log(f"[toy world] training the transformer ({sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M "
        f"parameters, latents {tuple(latents.shape[1:])}) ({time.time() - start:.0f}s)")
    _train_transformer(transformer, latents, labels, text, empty, config, generator, log)

    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.scheduler_shift),
        vae=vae,
        text_encoder=tiny.text_encoder,
        tokenizer=tiny.tokenizer,
        text_encoder_2=tiny.text_encoder_2,
        tokenizer_2=tiny.tokenizer_2,
        text_encoder_3=tiny.text_encoder_3,
        tokenizer_3=tiny.tokenizer_3,
    )
    pipeline.set_progress_bar_config(disable=True)
    log(f"[toy world] trained in {time.time() - start:.0f}s")
    return pipeline, train_scenes, eval_scenes


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_pipeline(pipeline, prompts: Sequence[str], images_per_prompt: int = 4, num_inference_steps: int = 20,
                      guidance_scale: float = 3.0, resolution: int | None = None,
                      max_sequence_length: int | None = 8, seed: int = 0, batch_size: int = 64,
                      return_images: bool = False, rewards: Sequence[str] = ()) -> dict[str, Any]:
    """Attribute accuracies of ``pipeline`` on ``prompts`` with deterministic ODE sampling (the pipeline's own
    Euler flow-matching scheduler), image ``j`` of prompt ``i`` drawn from ``torch.Generator().manual_seed(seed +
    1000 * j + i)``.

    Returns ``{"color": acc, "shape": acc, "count": acc, "position": acc, "all": acc, "n": images}`` (and
    ``"images"``, a list of PIL images prompt-major, when ``return_images``), plus ``"reward/NAME"``, the mean
    score of the registered reward ``NAME`` over the images it scores, for every name in ``rewards``.
    ``max_sequence_length=None`` uses the pipeline's default T5 length.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .rewards import score_images

    if max_sequence_length is not None:
        quiet_toy_truncation_warnings(max_sequence_length)
    resolution = resolution or pipeline.transformer.config.sample_size * pipeline.vae_scale_factor
    # Deterministic Euler ODE whatever scheduler the pipeline holds now (a trainer swaps in its SDE scheduler).
    original_scheduler = pipeline.scheduler
    accepted = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters
    config = {k: v for k, v in original_scheduler.config.items() if k in accepted}
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    pipeline.set_progress_bar_config(disable=True)
    try:
        summary = _evaluate(pipeline, prompts, images_per_prompt, num_inference_steps, guidance_scale, resolution,
                            max_sequence_length, seed, batch_size, bool(return_images or rewards), score_images)
    finally:
        pipeline.scheduler = original_scheduler
    if rewards:
        from ..rewards import get_reward

        expanded = [prompt for prompt in prompts for _ in range(images_per_prompt)]
        for name in rewards:
            scores = [x for x in get_reward(name)(expanded, summary["images"]) if x is not None]
            summary[f"reward/{name}"] = float(np.mean(scores)) if scores else float("nan")
        if not return_images:
            del summary["images"]
    return summary


def _evaluate(pipeline, prompts, images_per_prompt, num_inference_steps, guidance_scale, resolution,
              max_sequence_length, seed, batch_size, return_images, score_images) -> dict[str, Any]:
    jobs = [(i, j) for i in range(len(prompts)) for j in range(images_per_prompt)]
    results, images = [], []
    kwargs = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    for b in range(0, len(jobs), batch_size):
        chunk = jobs[b:b + batch_size]
        batch_prompts = [prompts[i] for i, _ in chunk]
        generators = [torch.Generator().manual_seed(seed + 1000 * j + i) for i, j in chunk]
        out = pipeline(prompt=batch_prompts, height=resolution, width=resolution,
                       num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                       generator=generators, output_type="pil", **kwargs).images
        results.extend(score_images(batch_prompts, out))
        if return_images:
            images.extend(out)
    summary: dict[str, Any] = {}
    for attribute in ("color", "shape", "count", "position"):
        values = [r[attribute] for r in results if attribute in r]
        summary[attribute] = float(np.mean(values)) if values else float("nan")
    summary["all"] = float(np.mean([all(r.values()) for r in results])) if results else float("nan")
    summary["n"] = len(results)
    if return_images:
        summary["images"] = images
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Folder
# ---------------------------------------------------------------------------------------------------------------------


def _resolve_config(config: ToyWorldConfig | str) -> ToyWorldConfig:
    if isinstance(config, ToyWorldConfig):
        return config
    if config not in PRESETS:
        raise ValueError(f"unknown toy world preset {config!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[config])


def read_prompts(world_dir: str | os.PathLike[str], split: str = "train") -> list[str]:
    """The prompts of a toy world folder: ``split`` is ``"train"`` or ``"eval"``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    path = Path(world_dir) / (PROMPTS_TRAIN_FILE if split == "train" else PROMPTS_EVAL_FILE)
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@contextlib.contextmanager
def _torch_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_toy_world(output_dir: str | os.PathLike[str], seed: int = 0, config: ToyWorldConfig | str = "full",
                    evaluate: bool = True, log: Callable[[str], None] = _log_default,
                    threads: int = 1) -> Path:
    """Train the toy world and save it to ``output_dir`` (a ``StableDiffusion3Pipeline`` folder).

    Besides the pipeline, the folder holds ``prompts_train.txt``, ``prompts_eval.txt`` (disjoint) and
    ``toy_world.json`` (seed, config, recommended generation settings and, with ``evaluate``, the accuracies on
    the eval prompts). ``config`` is a :class:`ToyWorldConfig` or a preset name (``"full"``, ``"light"``).
    ``threads`` (torch threads, set for the build and restored afterwards) defaults to 1: the build is deterministic
    for a seed, preset and thread count, so one thread gives the same world on every machine, and it is the fast
    choice where other work shares the cores (measured on 2 cores: two threads gained 1.25x alone, and the build took
    3.5x longer than with one while another process was busy).
    """
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1.")
    with _torch_threads(threads):
        return _build_toy_world(output_dir, seed, _resolve_config(config), evaluate, log)


def _build_toy_world(output_dir, seed: int, config: ToyWorldConfig, evaluate: bool, log) -> Path:
    output_dir = Path(output_dir)
    start = time.time()
    pipeline, train_scenes, eval_scenes = train_toy_pipeline(seed, config, log)
    train_seconds = time.time() - start
    output_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(output_dir, safe_serialization=True)
    (output_dir / PROMPTS_TRAIN_FILE).write_text("".join(s.caption + "\n" for s in train_scenes), encoding="utf-8")
    (output_dir / PROMPTS_EVAL_FILE).write_text("".join(s.caption + "\n" for s in eval_scenes), encoding="utf-8")
    metadata: dict[str, Any] = {
        "seed": seed,
        "config": dataclasses.asdict(config),
        "generation": {
            "resolution": config.resolution,
            "num_inference_steps": config.num_inference_steps,
            "guidance_scale": config.guidance_scale,
            "max_sequence_length": config.max_sequence_length,
        },
        "train_seconds": round(train_seconds, 1),
        "builder_digest": builder_digest(config, seed),
        **_LAST_BUILD_INFO,
        "torch_threads": torch.get_num_threads(),
    }
    if evaluate:
        eval_start = time.time()
        accuracy = evaluate_pipeline(
            pipeline, [s.caption for s in eval_scenes], images_per_prompt=config.eval_images_per_prompt,
            num_inference_steps=config.num_inference_steps, guidance_scale=config.guidance_scale,
            resolution=config.resolution, max_sequence_length=config.max_sequence_length, seed=seed,
        )
        metadata["eval_accuracy"] = accuracy
        log(f"[toy world] eval accuracy ({accuracy['n']} images, {config.num_inference_steps} ODE steps, "
            f"guidance {config.guidance_scale}): "
            + ", ".join(f"{k} {accuracy[k]:.1%}" for k in ("color", "shape", "count", "position", "all"))
            + f" ({time.time() - eval_start:.0f}s)")
    (output_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    log(f"[toy world] saved to {output_dir} ({time.time() - start:.0f}s in all)")
    return output_dir


def builder_digest(preset: str | ToyWorldConfig, seed: int) -> str:
    """What decides the weights a build writes: the revision, seed and settings, and the sources of the renderer
    (``world.py``) and the builder (``build.py``). A world whose ``toy_world.json`` records the digest of the current
    code is what a build would write now (on one thread), so it can be reused instead of rebuilt. The text encoders
    come from :func:`flowgrpo.testing.build_tiny_pipeline`; the tests compare the shipped ones with a fresh build."""
    import hashlib

    spec = {"revision": BUILD_REVISION, "seed": seed, "config": dataclasses.asdict(_resolve_config(preset))}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode("utf-8"))
    for module in ("world.py", "build.py"):
        digest.update((Path(__file__).parent / module).read_bytes().replace(b"\r\n", b"\n"))
    return digest.hexdigest()[:16]


def shipped_toy_world(preset: str | ToyWorldConfig = "full", seed: int = 0) -> Path | None:
    """The shipped world's folder when it is the world ``preset`` and ``seed`` would build now, else ``None``."""
    metadata = SHIPPED_WORLD_DIR / METADATA_FILE
    if not metadata.is_file() or not (SHIPPED_WORLD_DIR / "model_index.json").is_file():
        return None
    recorded = json.loads(metadata.read_text(encoding="utf-8")).get("builder_digest")
    return SHIPPED_WORLD_DIR if recorded == builder_digest(preset, seed) else None


def _fingerprint(preset: str | ToyWorldConfig, seed: int) -> str:
    import hashlib

    import diffusers
    import transformers

    spec = {"builder": builder_digest(preset, seed), "versions": [torch.__version__, diffusers.__version__,
                                                                transformers.__version__]}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8"))
    digest.update((Path(__file__).parent / "rewards.py").read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$FLOWGRPO_TOY_WORLD_CACHE``, else ``$XDG_CACHE_HOME/flowgrpo/toy-worlds`` (``~/.cache/...``)."""
    explicit = os.environ.get("FLOWGRPO_TOY_WORLD_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flowgrpo" / "toy-worlds"


def cached_toy_world(preset: str = "full", seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                     log: Callable[[str], None] = _log_default, threads: int = 1) -> Path:
    """Path of a built toy world (``preset``, ``seed``), made on first use and reused afterwards.

    The folder name carries a fingerprint of the builder's sources, the preset and the library versions, so a
    changed builder makes a new folder. A world missing from the cache is copied from the shipped one when that is
    what the builder would make now (:func:`shipped_toy_world`: the recipes' world, in a second), else built with
    ``threads`` threads (see :func:`build_toy_world`; ``toy_world.json`` records the count). Written in a private
    temporary folder and renamed into place atomically; concurrent callers wait for the first (``flowgrpo.build_cache``).
    """
    import shutil

    from ..build_cache import build_folder_once

    name = preset if isinstance(preset, str) else "custom"
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"{name}-seed{seed}-{_fingerprint(preset, seed)}"
    shipped = shipped_toy_world(preset, seed)

    def build(path: Path) -> None:
        if shipped is not None:
            log(f"[toy world] copying the shipped world (preset {name}, seed {seed}) to {target}")
            shutil.copytree(shipped, path)
        else:
            build_toy_world(path, seed=seed, config=preset, log=log, threads=threads)

    return build_folder_once(target, build, what="toy world cache folder")
