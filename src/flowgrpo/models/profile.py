"""What a family knows about generating with one of its checkpoints, read from the component configs alone.

A :class:`ModelConfigs` holds the ``config.json`` files of a pipeline's components (transformer, VAE, scheduler, text
encoders, tokenizers, guider), its ``model_index.json`` settings and the checkpoint's own generation defaults, without
any weight. Each family adapter turns it into a :class:`FamilyProfile` (``ModelFamilyAdapter.generation_profile``):

* the default size, as the family's pipeline computes it when called without one (``default_sample_size *
  vae_scale_factor`` for SD3, FLUX and Qwen-Image; the call's defaults for the video pipelines), and the sizes it can
  take (:class:`SizeRule`: a multiple of the VAE factor times the patch size, and for transformers with a positional
  table or a rotary table of fixed length, a largest side);
* the default text length and the longest the pipeline and its encoder take (:class:`TextRule`);
* the default frame count (video families);
* the published steps and guidance of the checkpoint's model card (:class:`Published`; a distilled variant keeps its
  few steps and samples without guidance), and how the family uses ``guidance_scale`` (true CFG, an embedding, or not
  at all).

:mod:`flowgrpo.models.defaults` reads the configs and resolves a run's settings from a profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: how a family uses ``guidance_scale``: classifier-free guidance (two passes above its off value), a guidance
#: embedding (one pass; the value is the embedding's), or not at all (a distilled pipeline that ignores it)
GUIDANCE_KINDS = ("cfg", "embedded", "ignored")


@dataclass
class ModelConfigs:
    """The component configs of one pipeline, without weights.

    ``components`` maps a component name of ``model_index.json`` (``transformer``, ``vae``, ``scheduler``,
    ``text_encoder``, ``tokenizer_2``, ``guider``, ...) to its config (a ``config.json``, ``scheduler_config.json``,
    ``guider_config.json`` or ``tokenizer_config.json``); ``pipeline_config`` holds the non-component entries of
    ``model_index.json`` (``is_distilled``, ``boundary_ratio``, ``expand_timesteps``, ...). ``name`` is the hub id, the
    folder or the loaded pipeline's ``name_or_path`` (read for variant names such as "turbo"); ``checkpoint_defaults``
    the checkpoint's own generation settings (``generation_defaults.json`` and the like, see
    :data:`flowgrpo.models.defaults.CHECKPOINT_DEFAULTS_FILES`), named by ``checkpoint_defaults_source``.
    """

    pipeline_class: str
    name: str = ""
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    pipeline_config: dict[str, Any] = field(default_factory=dict)
    checkpoint_defaults: dict[str, Any] = field(default_factory=dict)
    checkpoint_defaults_source: str | None = None
    origin: str = ""

    def config(self, component: str) -> dict[str, Any]:
        """The config of ``component`` (an empty dict when the pipeline has none or it could not be read)."""
        return self.components.get(component) or {}

    def name_has(self, *fragments: str) -> bool:
        """Whether the checkpoint's name (hub id or folder) contains any of ``fragments``, case-insensitively."""
        name = self.name.lower().replace("_", "-")
        return any(fragment.lower() in name for fragment in fragments)


@dataclass(frozen=True)
class Published:
    """The steps and guidance a checkpoint is sampled with, and where those numbers come from.

    ``distilled``: a step- or guidance-distilled checkpoint, sampled in few steps without guidance (its
    ``guidance_scale`` is the family's off value).
    """

    num_inference_steps: int
    guidance_scale: float
    source: str
    distilled: bool = False


@dataclass(frozen=True)
class SizeRule:
    """Image sides the family can take: multiples of ``multiple`` (``multiple_why`` says why, e.g. "VAE factor 8 x
    patch size 2") up to ``max_side`` (``None``: no limit here; ``max_why`` names the positional range)."""

    multiple: int
    multiple_why: str
    max_side: int | None = None
    max_why: str = ""


@dataclass(frozen=True)
class TextRule:
    """The text length (``max_sequence_length``) of a family: its ``default``, the longest it takes (``limit``,
    ``limit_why``), a length it must be exactly (``exact``, ``exact_why``), and whether the family reads the setting at
    all (``used``: HunyuanVideo 1.5 and Qwen-Image 2.1 encode with their pipeline's own lengths)."""

    default: int
    default_why: str
    limit: int | None = None
    limit_why: str = ""
    exact: int | None = None
    exact_why: str = ""
    used: bool = True


@dataclass(frozen=True)
class FamilyProfile:
    """Everything :mod:`flowgrpo.models.defaults` needs to resolve and check a run's generation settings."""

    family: str
    pipeline_class: str
    height: int
    width: int
    size_why: str
    size: SizeRule
    text: TextRule
    num_frames: int
    frames_why: str
    published: Published
    guidance: str
    cfg_off: float
    guidance_why: str = ""


def vae_scale_factor_from_blocks(vae: dict[str, Any], fallback: int = 8) -> int:
    """``2 ** (len(block_out_channels) - 1)``: the spatial factor of SD3's, FLUX's and Z-Image's VAE, as their
    pipelines compute it (``fallback`` when the config does not say)."""
    blocks = vae.get("block_out_channels")
    return 2 ** (len(blocks) - 1) if blocks else fallback


def vae_scale_factor_from_temporal(vae: dict[str, Any], fallback: int = 8) -> int:
    """``2 ** len(temperal_downsample)``: the spatial factor of Qwen-Image's and Wan's VAE, as their pipelines compute
    it (``fallback`` when the config does not say)."""
    downsample = vae.get("temperal_downsample")
    return 2 ** len(downsample) if downsample else fallback


def sane_length(value: Any) -> int | None:
    """A tokenizer's ``model_max_length`` or an encoder's position count, or ``None`` when it is missing or the
    "no limit" placeholder (transformers writes 1e30 for tokenizers without one)."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if 0 < number < 10**7 else None


def encoder_positions(config: dict[str, Any]) -> int | None:
    """The position range of a text encoder's config (``max_position_embeddings``, or that of its ``text_config``
    for vision-language models); ``None`` for encoders without one (T5's relative positions)."""
    for source in (config, config.get("text_config") or {}):
        if isinstance(source, dict) and sane_length(source.get("max_position_embeddings")):
            return sane_length(source.get("max_position_embeddings"))
    return None


def smallest(*candidates: tuple[int | None, str]) -> tuple[int | None, str]:
    """The smallest of ``(value, why)`` pairs whose value is known (``(None, "")`` when none is)."""
    known = [(v, why) for v, why in candidates if v is not None]
    return min(known, key=lambda pair: pair[0]) if known else (None, "")


__all__ = ["GUIDANCE_KINDS", "FamilyProfile", "ModelConfigs", "Published", "SizeRule", "TextRule", "encoder_positions",
           "sane_length", "smallest", "vae_scale_factor_from_blocks", "vae_scale_factor_from_temporal"]
