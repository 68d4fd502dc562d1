"""Tiny random-weight pipelines of every supported family, built offline, for tests, demos and benchmarks.

The pipelines are the stock diffusers classes with the real components, only shrunk. The text encoders, the
pooled projection and the transformer all have different widths, so that a mixed-up dimension fails loudly
instead of broadcasting by luck.

``"sd3"``: :class:`~diffusers.StableDiffusion3Pipeline`, shaped like SD3.5-medium

* ``text_encoder``   CLIP-L-like ``CLIPTextModelWithProjection``: hidden 32, 2 layers, 4 heads, projection 32,
  quick-GELU, 77 positions; ``tokenizer`` byte-level BPE (see :mod:`flowgrpo.testing.tiny_tokenizers`).
* ``text_encoder_2`` CLIP-G-like ``CLIPTextModelWithProjection``: hidden 48, 2 layers, 4 heads, projection 48,
  GELU; ``tokenizer_2`` the same BPE with ``"!"`` as padding, as in SD3.
* ``text_encoder_3`` T5-v1.1-like ``T5EncoderModel``: d_model 96, 2 layers, 4 heads of 16, gated-GELU FFN 128;
  ``tokenizer_3`` SentencePiece unigram, ``model_max_length`` 512.
* ``transformer``    ``SD3Transformer2DModel``: 2 MMDiT blocks (the first with dual attention), 4 heads of 16
  (inner 64), RMS qk-norm, patch 2, 16 latent channels, ``joint_attention_dim`` 96 (= T5 width),
  ``pooled_projection_dim`` 80 (= 32 + 48, the two CLIP projections), ``sample_size`` 8 (64 px by default),
  positional embedding for up to 32x32 patches (512 px).
* ``vae``            ``AutoencoderKL``: 4 levels (8, 16, 16, 16 channels, so the scale factor is 8 as in SD3),
  16 latent channels, no quant convs, SD3's scaling 1.5305 and shift 0.0609.
* ``scheduler``      ``FlowMatchEulerDiscreteScheduler`` with ``shift=3.0``.

``"flux"``: :class:`~diffusers.FluxPipeline`, shaped like FLUX.1-dev

* ``text_encoder``   CLIP-L-like ``CLIPTextModel`` (as above, without projection); ``tokenizer`` the BPE.
* ``text_encoder_2`` the T5-like encoder above; ``tokenizer_2`` the unigram model.
* ``transformer``    ``FluxTransformer2DModel``: 1 double-stream and 2 single-stream blocks, 4 heads of 16 (inner 64),
  RoPE axes (4, 6, 6), guidance embedding, ``in_channels`` 64 (16 latent channels packed 2x2),
  ``joint_attention_dim`` 96 (= T5 width), ``pooled_projection_dim`` 32 (= CLIP width).
* ``vae``            as for SD3, with FLUX's scaling 0.3611 and shift 0.1159.
* ``scheduler``      ``FlowMatchEulerDiscreteScheduler`` with FLUX's resolution-dependent (dynamic) shift.

``"flux_kontext"``: :class:`~diffusers.FluxKontextPipeline` (image editing) with the FLUX components above. Call it
with ``max_area=height * width, _auto_resize=False`` to keep a small source image small.

``"qwenimage"`` / ``"qwenimage_edit"`` / ``"qwenimage_edit_plus"``: see :mod:`flowgrpo.testing.tiny_qwenimage`;
``"qwenimage21"``: see :mod:`flowgrpo.testing.tiny_qwenimage21`; ``"wan"`` (and its variant
``"two_experts"``, Wan 2.2 A14B's layout): see :mod:`flowgrpo.testing.tiny_wan`; ``"flux2"``, ``"flux2_klein"`` (and its
variant ``"distilled"``) and ``"zimage"``: see :mod:`flowgrpo.testing.tiny_flux2`; ``"wan_i2v"`` (Wan 2.1 I2V, variants
``"two_experts"`` and ``"ti2v"``): see :mod:`flowgrpo.testing.tiny_wan`; ``"ltx2"``: see
:mod:`flowgrpo.testing.tiny_ltx2`; ``"hunyuanvideo15"``: see :mod:`flowgrpo.testing.tiny_hunyuanvideo15`.

Any image side that is a multiple of 16 px works (32, 64, 128, ..., non-square too; SD3 up to 512 px). The SD3 pipeline
defaults to 64 px; ``FluxPipeline`` hard-codes a 1024 px default, so pass ``height``/``width`` to it. Four 64 px
images with 10 steps take well under a second on 2 idle CPU cores. Building is deterministic: the same ``seed``
gives bit-identical weights and tokenizers in any process. A saved pipeline takes 3-3.5 MB (about 0.7 M
parameters; a third of the size is T5's normalisation table in ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from ..models import FAMILIES
from .seeding import seeded_component
from .tiny_flux2 import (
    FLUX2_CONFIGS,
    FLUX2_KLEIN_VARIANTS,
    ZIMAGE_CONFIGS,
    build_tiny_flux2,
    build_tiny_flux2_klein,
    build_tiny_zimage,
)
from .tiny_hunyuanvideo15 import HUNYUANVIDEO15_CONFIGS, build_tiny_hunyuanvideo15
from .tiny_ltx2 import LTX2_CONFIGS, build_tiny_ltx2
from .tiny_qwenimage import (
    QWEN_CONFIGS,
    build_tiny_qwenimage,
    build_tiny_qwenimage_edit,
    build_tiny_qwenimage_edit_plus,
)
from .tiny_qwenimage21 import QWEN21_CONFIGS, build_tiny_qwenimage21
from .tiny_tokenizers import (
    CLIP_MODEL_MAX_LENGTH,
    MISTRAL_CHAT_TEMPLATE,
    PROMPT_CORPUS,
    QWEN3_CHAT_TEMPLATE,
    build_clip_tokenizer,
    build_t5_tokenizer,
    clip_vocab_and_merges,
    qwen2_vocab_and_merges,
    t5_sentencepiece_model,
)
from .tiny_wan import WAN_CONFIGS, WAN_I2V_CONFIGS, WAN_I2V_VARIANTS, WAN_VARIANTS, build_tiny_wan, build_tiny_wan_i2v

__all__ = ["TINY_FAMILIES", "TINY_GENERATION_DEFAULTS", "TINY_VARIANTS", "build_tiny_pipeline", "save_tiny_pipeline",
           "cached_tiny_pipeline_path"]

#: A tiny pipeline of every family of the family table (``flowgrpo.models.FAMILIES``).
TINY_FAMILIES = tuple(FAMILIES)

#: Variants a family can be built in besides its default layout.
TINY_VARIANTS: dict[str, tuple[str, ...]] = {"wan": WAN_VARIANTS, "flux2_klein": FLUX2_KLEIN_VARIANTS,
                                             "wan_i2v": WAN_I2V_VARIANTS}

#: Settings of the later families, fingerprinted only for their own folders (the earlier folders keep their names).
_FAMILY_CONFIGS: dict[str, list] = {
    "flux2_klein": [FLUX2_CONFIGS, QWEN3_CHAT_TEMPLATE],
    "flux2": [FLUX2_CONFIGS, MISTRAL_CHAT_TEMPLATE, {"revision": 2}],  # 2: a plain tokenizer, no processor
    "qwenimage21": [QWEN21_CONFIGS],
    "zimage": [ZIMAGE_CONFIGS, QWEN3_CHAT_TEMPLATE],
    "wan_i2v": [WAN_I2V_CONFIGS],
    "ltx2": [LTX2_CONFIGS],
    "hunyuanvideo15": [HUNYUANVIDEO15_CONFIGS, QWEN3_CHAT_TEMPLATE],
}

# Bump when the build changes in a way the configs below do not show (e.g. initialisation), to refresh caches.
_BUILD_REVISION = 1

# ---------------------------------------------------------------------------------------------------------------------
# Architecture configs (plain dicts so that they also feed the cache fingerprint)
# ---------------------------------------------------------------------------------------------------------------------

_CLIP_L = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",
    "max_position_embeddings": CLIP_MODEL_MAX_LENGTH,
}
_CLIP_G = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "projection_dim": 48,
    "hidden_act": "gelu",
    "max_position_embeddings": CLIP_MODEL_MAX_LENGTH,
}
_T5 = {
    "d_model": 96,
    "d_kv": 16,
    "num_heads": 4,
    "d_ff": 128,
    "num_layers": 2,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.0,
    "tie_word_embeddings": False,
}
_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 16, 16, 16],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 64,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_VAE_SD3 = {**_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
_VAE_FLUX = {**_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
_SD3_TRANSFORMER = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "caption_projection_dim": 64,
    "joint_attention_dim": _T5["d_model"],
    "pooled_projection_dim": _CLIP_L["projection_dim"] + _CLIP_G["projection_dim"],
    "pos_embed_max_size": 32,
    "dual_attention_layers": [0],
    "qk_norm": "rms_norm",
}
_FLUX_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 4 * _VAE["latent_channels"],
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": _T5["d_model"],
    "pooled_projection_dim": _CLIP_L["hidden_size"],
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}
_SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_FLUX_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# ---------------------------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------------------------


_seeded = seeded_component


def _clip_config(arch: dict[str, Any], tokenizer) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
    )


def _t5_encoder(tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **_T5,
    )
    return T5EncoderModel(config)


def _finish(module: torch.nn.Module) -> torch.nn.Module:
    return module.eval()


def _build_sd3(seed: int) -> StableDiffusion3Pipeline:
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer(pad_token="!")
    tokenizer_3 = build_t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = CLIPTextModelWithProjection(_clip_config(_CLIP_L, tokenizer))
    with _seeded(seed, 2):
        text_encoder_2 = CLIPTextModelWithProjection(_clip_config(_CLIP_G, tokenizer_2))
    with _seeded(seed, 3):
        text_encoder_3 = _t5_encoder(tokenizer_3)
    with _seeded(seed, 4):
        transformer = SD3Transformer2DModel(**_SD3_TRANSFORMER)
    with _seeded(seed, 5):
        vae = AutoencoderKL(**_VAE_SD3)
    return StableDiffusion3Pipeline(
        transformer=_finish(transformer),
        scheduler=FlowMatchEulerDiscreteScheduler(**_SD3_SCHEDULER),
        vae=_finish(vae),
        text_encoder=_finish(text_encoder),
        tokenizer=tokenizer,
        text_encoder_2=_finish(text_encoder_2),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_finish(text_encoder_3),
        tokenizer_3=tokenizer_3,
    )


def _build_flux(seed: int) -> FluxPipeline:
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = CLIPTextModel(_clip_config(_CLIP_L, tokenizer))
    with _seeded(seed, 3):
        text_encoder_2 = _t5_encoder(tokenizer_2)
    with _seeded(seed, 4):
        transformer = FluxTransformer2DModel(**_FLUX_TRANSFORMER)
    with _seeded(seed, 5):
        vae = AutoencoderKL(**_VAE_FLUX)
    return FluxPipeline(
        transformer=_finish(transformer),
        scheduler=FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER),
        vae=_finish(vae),
        text_encoder=_finish(text_encoder),
        tokenizer=tokenizer,
        text_encoder_2=_finish(text_encoder_2),
        tokenizer_2=tokenizer_2,
    )


def _build_flux_kontext(seed: int) -> FluxKontextPipeline:
    flux = _build_flux(seed)
    return FluxKontextPipeline(**{k: v for k, v in flux.components.items() if v is not None})


_BUILDERS: dict[str, Callable[[int], DiffusionPipeline]] = {
    "sd3": _build_sd3, "flux": _build_flux, "qwenimage": build_tiny_qwenimage, "wan": build_tiny_wan,
    "flux_kontext": _build_flux_kontext, "qwenimage_edit": build_tiny_qwenimage_edit,
    "flux2_klein": build_tiny_flux2_klein, "zimage": build_tiny_zimage, "flux2": build_tiny_flux2,
    "qwenimage_edit_plus": build_tiny_qwenimage_edit_plus, "qwenimage21": build_tiny_qwenimage21,
    "wan_i2v": build_tiny_wan_i2v, "ltx2": build_tiny_ltx2, "hunyuanvideo15": build_tiny_hunyuanvideo15,
}


def _check_family(family: str) -> str:
    if family not in _BUILDERS:
        raise ValueError(f"Unknown tiny pipeline family {family!r}; choose one of {', '.join(TINY_FAMILIES)}.")
    return family


def _check_variant(family: str, variant: str | None) -> str | None:
    if variant is not None and variant not in TINY_VARIANTS.get(family, ()):
        known = TINY_VARIANTS.get(family, ())
        raise ValueError(f"Unknown variant {variant!r} of the tiny {family} pipeline; "
                         + (f"choose one of {', '.join(known)} or none." if known else "it has no variants."))
    return variant


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    return seed


# ---------------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------------


def build_tiny_pipeline(family: str = "sd3", seed: int = 0, variant: str | None = None) -> DiffusionPipeline:
    """Build a tiny random-weight pipeline of ``family`` (one of :data:`TINY_FAMILIES`) in memory, in float32, on CPU.

    Nothing is downloaded. The same ``seed`` always gives bit-identical weights; see the module docstring for
    the architectures. ``variant`` picks another layout of a family (:data:`TINY_VARIANTS`, e.g. ``"two_experts"``
    for ``"wan"``).
    """
    family, seed = _check_family(family), _check_seed(seed)
    if _check_variant(family, variant) is not None:
        return _BUILDERS[family](seed, variant)
    return _BUILDERS[family](seed)


#: The tiny pipelines' own generation defaults (``generation_defaults.json``, read by :mod:`flowgrpo.models.defaults`):
#: a size (and frame count) that a CPU samples in a moment where the family's own (1024 px, 480 x 832 x 81 frames,
#: ...) would not. The tiny SD3 pipeline has none: its family's default, 64 px, is small already.
TINY_GENERATION_DEFAULTS: dict[str, dict[str, int]] = {
    **{family: {"resolution": 32} for family in ("flux", "flux_kontext", "qwenimage", "qwenimage_edit", "flux2_klein",
                                                 "zimage", "flux2", "qwenimage_edit_plus", "qwenimage21")},
    **{family: {"resolution": 32, "num_frames": 5} for family in ("wan", "wan_i2v", "ltx2", "hunyuanvideo15")},
}


def save_tiny_pipeline(family: str, output_dir: str | os.PathLike[str], seed: int = 0,
                       variant: str | None = None) -> Path:
    """Build the tiny ``family`` pipeline and write it to ``output_dir`` with ``save_pretrained``, with its
    ``generation_defaults.json`` (:data:`TINY_GENERATION_DEFAULTS`) where the family's own size does not suit it.

    The folder loads back with stock ``DiffusionPipeline.from_pretrained(output_dir)``. Returns the folder's path.
    """
    output_dir = Path(output_dir)
    pipeline = build_tiny_pipeline(family, seed, variant)
    pipeline.save_pretrained(output_dir, safe_serialization=True)
    if family in TINY_GENERATION_DEFAULTS:
        (output_dir / "generation_defaults.json").write_text(json.dumps(
            {"generation": TINY_GENERATION_DEFAULTS[family],
             "source": "flowgrpo.testing: a tiny random-weight test pipeline, sampled small on a CPU"}, indent=1) + "\n")
    return output_dir


def _fingerprint(family: str, seed: int, variant: str | None = None) -> str:
    """Hash of everything that determines the saved folder, so a changed builder never reuses a stale cache."""
    import diffusers
    import transformers

    vocab, merges = clip_vocab_and_merges()
    spec = {
        "revision": _BUILD_REVISION,
        "family": family,
        "variant": variant,
        "seed": seed,
        "configs": [_CLIP_L, _CLIP_G, _T5, _VAE_SD3, _VAE_FLUX, _SD3_TRANSFORMER, _FLUX_TRANSFORMER,
                    _SD3_SCHEDULER, _FLUX_SCHEDULER, QWEN_CONFIGS, WAN_CONFIGS],
        "versions": [torch.__version__, diffusers.__version__, transformers.__version__],
        "corpus": PROMPT_CORPUS,
        "clip": [sorted(vocab.items()), merges],
        "qwen2": list(qwen2_vocab_and_merges()[1]),
    }
    if family in _FAMILY_CONFIGS:
        spec["family_configs"] = _FAMILY_CONFIGS[family]
    if family in TINY_GENERATION_DEFAULTS:
        spec["generation_defaults"] = TINY_GENERATION_DEFAULTS[family]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode("utf-8"))
    digest.update(t5_sentencepiece_model())
    return digest.hexdigest()[:16]


def default_tiny_cache_dir() -> Path:
    explicit = os.environ.get("FLOWGRPO_TINY_PIPELINE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flowgrpo" / "tiny-pipelines"


def cached_tiny_pipeline_path(family: str = "sd3", seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                              variant: str | None = None) -> Path:
    """Path of a saved tiny ``family`` pipeline, built on first use and reused afterwards.

    ``cache_dir`` defaults to ``$FLOWGRPO_TINY_PIPELINE_CACHE``, else ``$XDG_CACHE_HOME/flowgrpo/tiny-pipelines``
    (``~/.cache/...``). The folder name carries a fingerprint of the architecture, the tokenizers and the library
    versions, so a changed builder makes a new folder. Concurrent callers are safe: the first builds it in a
    private temporary folder renamed into place atomically, the others wait for it (``flowgrpo.build_cache``).
    """
    from ..build_cache import build_folder_once

    family, seed = _check_family(family), _check_seed(seed)
    variant = _check_variant(family, variant)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_tiny_cache_dir()
    name = family if variant is None else f"{family}-{variant}"
    target = cache_dir / f"{name}-seed{seed}-{_fingerprint(family, seed, variant)}"
    return build_folder_once(target, lambda path: save_tiny_pipeline(family, path, seed, variant=variant),
                             what="tiny pipeline cache folder")
