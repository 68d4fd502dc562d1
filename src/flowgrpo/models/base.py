"""The small interface every model family implements.

A family adapter hides what differs between flow-matching pipelines (prompt encoding, the source image of editing
models, latent layout and frames, how the transformer is called, how latents are decoded) behind a few methods, so
the trainer is written once. Adding a family means one new file with one new adapter class, listed in
``flowgrpo.models.ADAPTERS``.

What a family declares (class attributes):

* ``accepts_images``: an editing family; every sample is conditioned on a source image, which
  ``encode_prompts(..., images=...)`` encodes at the working resolution (the result is part of the conditioning).
* ``images_optional``: with ``accepts_images``, the source images are optional conditioning (FLUX.2's reference
  images): a dataset without an ``image`` column trains text-to-image.
* ``negative_depends_on_image``: the negative prompt's embedding depends on the source image (Qwen-Image-Edit:
  the vision-language encoder sees the image), so the trainer encodes it per image (``PromptEmbeds.negative``).
* ``is_video``: latents carry frames; ``num_frames`` (checked by :meth:`check_num_frames`) sets their number and
  :meth:`decode` returns frames.
* ``default_lora_target_modules``: the LoRA targets used when a ``LoraConfig`` names none.

What a family knows about generating with a checkpoint, from its component configs alone
(:meth:`ModelFamilyAdapter.generation_profile`, a :class:`~flowgrpo.models.profile.FamilyProfile`): the default size as
its pipeline computes it and the sizes it can take, the default and longest text length, the default frame count, the
published steps and guidance of the checkpoint's model card, and how ``guidance_scale`` is used (``cfg_off_value``:
the scale at which it samples in one pass without guidance). Each family overrides the pieces that differ:
``_default_size``, ``_size_rule``, ``_text_rule``, ``_default_frames``, ``_published``, ``_guidance_kind``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DiffusionPipeline

from .profile import FamilyProfile, ModelConfigs, Published, SizeRule, TextRule, vae_scale_factor_from_blocks

#: Attention projections of the joint (MMDiT-style) attention blocks of SD3, FLUX and Qwen-Image: the LoRA targets
#: of the published Flow-GRPO recipes. FLUX's single-stream blocks have no ``add_*`` projections; peft skips them.
MMDIT_LORA_TARGET_MODULES = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)


@dataclass
class PromptEmbeds:
    """Conditioning for a batch of samples: a dict of tensors whose first dimension is the batch.

    ``negative`` optionally holds per-sample negative-prompt conditioning (families whose negative embedding
    depends on the source image); it follows every selection, slice and move of its rows.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    negative: PromptEmbeds | None = None

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def index_select(self, index: torch.Tensor) -> PromptEmbeds:
        """Rows ``index`` (used to expand unique-prompt embeddings to the G samples of each group)."""
        negative = self.negative.index_select(index) if self.negative is not None else None
        return PromptEmbeds({k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()}, negative)

    def __getitem__(self, item: slice) -> PromptEmbeds:
        negative = self.negative[item] if self.negative is not None else None
        return PromptEmbeds({k: v[item] for k, v in self.tensors.items()}, negative)

    def to(self, *args: Any, **kwargs: Any) -> PromptEmbeds:
        negative = self.negative.to(*args, **kwargs) if self.negative is not None else None
        return PromptEmbeds({k: v.to(*args, **kwargs) if v.is_floating_point() else v.to(device=_device_of(args, kwargs))
                             for k, v in self.tensors.items()}, negative)

    def expand_to(self, batch_size: int) -> PromptEmbeds:
        """Repeat a single-row embedding (e.g. the negative prompt) to ``batch_size`` rows."""
        negative = self.negative.expand_to(batch_size) if self.negative is not None else None
        return PromptEmbeds({k: v.expand(batch_size, *v.shape[1:]) for k, v in self.tensors.items()}, negative)

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        keys = parts[0].tensors.keys()
        negative = None
        if all(p.negative is not None for p in parts):
            negative = PromptEmbeds.cat([p.negative for p in parts])
        return PromptEmbeds(pad_rows_to_longest([{k: p.tensors[k] for k in keys} for p in parts]), negative)


def _is_mask(name: str) -> bool:
    return "mask" in name


def pad_rows_to_longest(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch from batches of conditioning (dicts of ``(B_i, L_i, ...)`` tensors, e.g. cached rows): each tensor
    concatenated along dim 0; where the parts differ in length ``L_i`` along dim 1 (text encoders that pad a batch
    only to its longest prompt, as Qwen-Image's), each part is first right-padded with zeros to the longest.

    This is how the Qwen-Image pipelines pad a batch (``_get_qwen_prompt_embeds``: ``cat([u, u.new_zeros(...)])``
    for the embeddings, the mask and Qwen-Image 2.1's ``image_pad_mask``); text positions do not move and padded
    tokens are masked out of attention, so the transformer's output per row equals the batched encoding's. Zero
    padding is only correct where a mask marks it: a ragged tensor that is not itself a mask (its name contains
    ``mask``) needs a mask whose rows have the same lengths (``prompt_embeds`` -> ``prompt_embeds_mask``); masks are
    padded with zeros (no token).

    Raises:
        ValueError: rows of a tensor differ in a dimension other than 1, or a ragged tensor has no mask.
    """
    names = list(parts[0])
    lengths = {name: [tuple(p[name].shape[1:2]) for p in parts] for name in names}
    batch: dict[str, torch.Tensor] = {}
    for name in names:
        tensors = [p[name] for p in parts]
        if len({tuple(t.shape[1:]) for t in tensors}) == 1:
            batch[name] = torch.cat(tensors)
            continue
        if min(t.dim() for t in tensors) < 2 or len({tuple(t.shape[2:]) for t in tensors}) != 1:
            shapes = sorted({tuple(t.shape) for t in tensors})
            raise ValueError(f"The prompt embeddings {name!r} come in shapes {shapes}, which differ beyond the sequence "
                             "dimension (1) and cannot be padded into one batch; the family adapter's encode_prompts "
                             "must give every prompt the same shape there (or set cache_prompt_embeddings: false).")
        if not _is_mask(name) and not any(lengths[m] == lengths[name] for m in names if _is_mask(m)):
            raise ValueError(f"The prompt embeddings {name!r} have different lengths "
                             f"{sorted({t.shape[1] for t in tensors})} along the sequence dimension and no mask tensor "
                             "of the same lengths to mark zero padding; the family adapter's encode_prompts must pad "
                             f"to a fixed length or return a mask (e.g. {name + '_mask'!r}), or set "
                             "cache_prompt_embeddings: false.")
        longest = max(t.shape[1] for t in tensors)
        batch[name] = torch.cat([torch.cat([t, t.new_zeros(t.shape[0], longest - t.shape[1], *t.shape[2:])], dim=1)
                                 for t in tensors])
    return batch


def packed_latent_size(vae_scale_factor: int, height: int, width: int) -> tuple[int, int]:
    """Latent height and width for families that pack 2x2 latent patches into tokens (FLUX.1, Qwen-Image): the
    image size over the VAE's scale, rounded down to even numbers, as their pipelines compute it."""
    return 2 * (height // (vae_scale_factor * 2)), 2 * (width // (vae_scale_factor * 2))


def _device_of(args: tuple, kwargs: dict) -> Any:
    """The device of a ``.to(...)`` call (masks and ids keep their integer dtype)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str)):
            return a
    return None


class ModelFamilyAdapter(ABC):
    """What the trainer needs from a flow-matching text-to-image, editing or text-to-video pipeline.

    Latents handed around by the trainer are exactly what the family's transformer consumes (packed
    sequences for FLUX and Qwen-Image, 4-D maps for SD3, 5-D video latents for Wan); every SDE/log-prob computation
    reduces over all non-batch dimensions, so the layout does not matter to the algorithm.
    """

    family: str = ""
    pipeline_class_names: tuple[str, ...] = ()
    accepts_images: bool = False
    images_optional: bool = False
    negative_depends_on_image: bool = False
    is_video: bool = False
    #: the family generates sound with its pictures (LTX-2): ``decode_audio`` gives it to the rewards that score it
    makes_audio: bool = False
    #: ``encode_images`` gives training latents (SD3, FLUX.1): offline preference pairs
    encodes_images: bool = False
    default_lora_target_modules: tuple[str, ...] = MMDIT_LORA_TARGET_MODULES
    #: Whether a training forward may leave some trainable weights without a gradient (DDP then has to search for
    #: them: ``find_unused_parameters``). False for families whose every block output reaches the velocity.
    may_leave_weights_unused: bool = False
    #: the ``guidance_scale`` at which the family samples in one pass without guidance (Z-Image: 0, it guides above 0)
    cfg_off_value: float = 1.0

    def __init__(self, pipeline: DiffusionPipeline, num_frames: int = 1):
        self.check_num_frames(num_frames)
        self.pipeline = pipeline
        self.num_frames = int(num_frames)
        # The pipeline's own scheduler configuration, kept before the trainer swaps in its SDE scheduler.
        self.scheduler_config = dict(pipeline.scheduler.config)

    @classmethod
    def supports(cls, pipeline: DiffusionPipeline | str) -> bool:
        """Whether this adapter handles ``pipeline`` (a pipeline or its class name)."""
        name = pipeline if isinstance(pipeline, str) else type(pipeline).__name__
        return name in cls.pipeline_class_names

    @classmethod
    def check_num_frames(cls, num_frames: int | None) -> None:
        """Raise a clear error when ``num_frames`` does not suit this family (image families: exactly 1); ``None``
        (the model's own, not resolved yet) passes."""
        if num_frames is None:
            return
        if not cls.is_video and num_frames != 1:
            raise ValueError(f"num_frames={num_frames}, but {cls.family} ({', '.join(cls.pipeline_class_names)}) "
                             "generates images; set num_frames=1 (the default).")

    @classmethod
    def check_video_settings(cls, num_frames: int | None, height: int | None, width: int | None,
                             vae_config: dict | None = None) -> None:
        """Raise a clear error, before any weight is loaded, when the frame count or the size does not suit the
        family's VAE (``vae_config``: its ``config.json``, when readable); nothing to check for most families. A value
        that is ``None`` (the model's own, not resolved yet) is not checked."""
        return None

    # --- generation settings from the component configs -------------------------------------------
    @classmethod
    def generation_profile(cls, configs: ModelConfigs) -> FamilyProfile:
        """What this family knows about generating with the checkpoint whose component configs are ``configs``:
        default size and the sizes it takes, text length, frames, published steps and guidance (no weight is read)."""
        height, width, size_why = cls._default_size(configs)
        frames, frames_why = cls._default_frames(configs)
        kind, guidance_why = cls._guidance_kind(configs)
        return FamilyProfile(family=cls.family, pipeline_class=configs.pipeline_class, height=int(height),
                             width=int(width), size_why=size_why, size=cls._size_rule(configs),
                             text=cls._text_rule(configs), num_frames=int(frames), frames_why=frames_why,
                             published=cls._published(configs), guidance=kind, cfg_off=cls.cfg_off_value,
                             guidance_why=guidance_why)

    @classmethod
    def _vae_scale_factor(cls, configs: ModelConfigs) -> int:
        """The VAE's spatial factor as the family's pipeline computes it (``2 ** (len(block_out_channels) - 1)``)."""
        return vae_scale_factor_from_blocks(configs.config("vae"))

    @classmethod
    def _default_size(cls, configs: ModelConfigs) -> tuple[int, int, str]:
        """``(height, width, why)`` when the pipeline is called without a size: ``default_sample_size *
        vae_scale_factor`` with the ``default_sample_size`` of 128 that FLUX's, Qwen-Image's and FLUX.2's pipelines
        fix."""
        factor = cls._vae_scale_factor(configs)
        return 128 * factor, 128 * factor, f"default_sample_size 128 x VAE factor {factor}"

    @classmethod
    def _size_rule(cls, configs: ModelConfigs) -> SizeRule:
        """Sides that are multiples of the VAE factor times 2: the latents are packed 2x2 into tokens."""
        factor = cls._vae_scale_factor(configs)
        return SizeRule(factor * 2, f"VAE factor {factor} x 2, the 2x2 packing of latents into tokens")

    @classmethod
    def _text_rule(cls, configs: ModelConfigs) -> TextRule:
        raise NotImplementedError(f"{cls.__name__} does not say its text length.")

    @classmethod
    def _default_frames(cls, configs: ModelConfigs) -> tuple[int, str]:
        """``(frames, why)``: 1 for image families."""
        return 1, "an image family"

    @classmethod
    def _published(cls, configs: ModelConfigs) -> Published:
        raise NotImplementedError(f"{cls.__name__} does not say its published steps and guidance.")

    @classmethod
    def _guidance_kind(cls, configs: ModelConfigs) -> tuple[str, str]:
        """``(kind, why)``: how ``guidance_scale`` is used (``flowgrpo.models.profile.GUIDANCE_KINDS``); classifier-free
        guidance with the negative prompt by default."""
        return "cfg", "classifier-free guidance with the negative prompt"

    # --- conditioning -----------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str], max_sequence_length: int, device: torch.device,
                       images: Sequence[Any] | None = None, *, height: int | None = None,
                       width: int | None = None) -> PromptEmbeds:
        """Encode each prompt once (no CFG duplication).

        ``images`` (editing families): one source ``PIL.Image`` per prompt, encoded at ``height`` x ``width``, the
        working resolution; its encoding is part of the returned conditioning.
        """

    def _require_images(self, prompts: list[str], images: Sequence[Any] | None, height: int | None,
                        width: int | None) -> list[Any]:
        if images is None:
            raise ValueError(f"{type(self.pipeline).__name__} edits a source image: pass one image per prompt "
                             "(a dataset column 'image' holding paths, PIL images or a datasets.Image feature).")
        images = list(images)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} source images; give one image per prompt.")
        if height is None or width is None:
            raise ValueError("Encoding source images needs the working resolution: pass height= and width=.")
        return images

    # --- latents ----------------------------------------------------------------------------------
    @abstractmethod
    def prepare_latents(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | list[torch.Generator] | None,
        device: torch.device, dtype: torch.dtype,
    ) -> torch.Tensor:
        """Initial noise x_1 ~ N(0, I) in the transformer's latent layout (with ``num_frames`` for video)."""

    @abstractmethod
    def set_timesteps(self, scheduler: Any, num_inference_steps: int, height: int, width: int,
                      device: torch.device) -> None:
        """Configure ``scheduler`` exactly as the family's pipeline does (shift / dynamic shift)."""

    def sde_scheduler_config(self) -> dict[str, Any]:
        """The configuration that the trainer's ``FlowMatchSDEScheduler`` is built from (the pipeline's own)."""
        return dict(self.scheduler_config)

    # --- the transformer call ---------------------------------------------------------------------
    @abstractmethod
    def predict_velocity(
        self, transformer: Callable[..., Any], latents: torch.Tensor, timestep: torch.Tensor,
        embeds: PromptEmbeds, guidance_scale: float, negative_embeds: PromptEmbeds | None, height: int, width: int,
    ) -> torch.Tensor:
        """Velocity v (after classifier-free guidance or with the guidance embedding) for ``latents``.

        ``timestep`` is a 1-D tensor of per-sample timesteps on the scheduler's 0..1000 scale. ``transformer`` is
        what :meth:`trainable_module` returned (possibly wrapped by peft / DDP).
        """

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether ``guidance_scale`` means two transformer passes (true CFG) for this family."""
        return guidance_scale > 1.0

    def trainable_module(self) -> torch.nn.Module:
        """The module the trainer trains (and hands back to :meth:`predict_velocity`): the transformer."""
        return self.pipeline.transformer

    def transformers(self) -> list[torch.nn.Module]:
        """Every diffusers transformer that samples (for gradient checkpointing and FLOP counts)."""
        return [self.pipeline.transformer]

    # --- sequence parallelism ---------------------------------------------------------------------
    #: why the family's tokens cannot be split over several processes (``sequence_parallel_size > 1``); None: they can
    sequence_parallel_refusal: str | None = None

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict[str, Any]:
        """The diffusers context-parallel plan that splits ``transformer``'s tokens over an SP group (Ulysses): which
        inputs (or outputs) of which modules are split along which dimension, which outputs are gathered. By default
        the transformer class's own ``_cp_plan`` (Wan, LTX, FLUX.1, FLUX.2, Qwen-Image in diffusers 0.42.1); a family
        whose transformer has none writes its own (HunyuanVideo 1.5) or extends it (LTX-2's sound stream)."""
        plan = getattr(type(transformer), "_cp_plan", None)
        if not plan:
            raise ValueError(f"{type(transformer).__name__} has no context-parallel plan (_cp_plan) in this diffusers "
                             f"version, so {self.family} cannot split its tokens over several processes; use "
                             "sequence_parallel_size 1.")
        return dict(plan)

    def prepare_sequence_parallel(self, transformer: torch.nn.Module) -> None:
        """Make ``transformer`` ready for its tokens to be split (before `context_parallel_plan` is applied): nothing
        for most families; HunyuanVideo 1.5 swaps in a joint-attention processor whose mask marks keys only."""
        return None

    def sequence_lengths(self, embeds: PromptEmbeds, latents: torch.Tensor) -> tuple[int, int]:
        """``(image_tokens, text_tokens)`` that one transformer call of one sample attends over (FLOP counts).

        ``image_tokens`` counts every latent token of the call (target and, for editing families, source image).
        """
        raise NotImplementedError(f"{type(self).__name__} does not report its sequence lengths.")

    def audio_sequence_length(self, latents: torch.Tensor) -> int:
        """The audio tokens of one transformer call of one sample (FLOP counts); 0 for families without an audio
        stream (LTX-2 has one)."""
        return 0

    def lora_writer(self) -> Any:
        """The class whose ``save_lora_weights`` writes this family's diffusers-format LoRA: the pipeline's own."""
        return type(self.pipeline)

    def final_latents(self, latents: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The sample the pipeline decodes from the last step's ``latents`` (Wan 2.2 TI2V image-to-video: the
        first latent frame is the source image's latents); ``latents`` unchanged for most families."""
        return latents

    # --- pixels -----------------------------------------------------------------------------------
    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Decode latents to pixels in [0, 1], float32: images ``(B, 3, H, W)``, or frames ``(B, F, 3, H, W)`` for a
        video family."""

    def decode_audio(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Decode the sound of the state to waveforms ``(B, channels, samples)``, float32, at `audio_sampling_rate`
        (families with ``makes_audio``)."""
        raise NotImplementedError(f"{type(self).__name__} generates no sound.")

    def audio_sampling_rate(self) -> int:
        """Samples per second of `decode_audio`'s waveforms (families with ``makes_audio``)."""
        raise NotImplementedError(f"{type(self).__name__} generates no sound.")

    def encode_images(self, images: Sequence[Any], height: int, width: int, device: torch.device) -> torch.Tensor:
        """Images (PIL) as clean latents x0 in the layout ``decode`` reads and the transformer denoises: resized to
        ``height`` x ``width`` by the pipeline's image processor, the VAE's mean, shifted and scaled; float32 (offline
        preference pairs). Families whose latents are laid out otherwise (video, Qwen-Image) do not provide it."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import retrieve_latents

        if not self.encodes_images:
            raise NotImplementedError(f"{type(self).__name__} does not encode images to training latents; offline "
                                      "preference pairs are supported for the SD3 and FLUX.1 families.")
        vae = self.pipeline.vae
        pixels = self._preprocess_images(images, height, width, device, vae.dtype)
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return self._latents_layout((latents.float() - shift) * vae.config.scaling_factor)

    def _latents_layout(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``(B, C, h, w)`` in the transformer's layout (identity for SD3; FLUX.1 packs them)."""
        return latents

    # --- helpers shared by families ---------------------------------------------------------------
    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        latents = latents / vae.config.scaling_factor + shift
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def _preprocess_images(self, images: Sequence[Any], height: int, width: int, device: torch.device,
                           dtype: torch.dtype) -> torch.Tensor:
        """Source images resized to ``height`` x ``width`` and scaled to [-1, 1] by the pipeline's image processor,
        as its own editing call does for an image of that size."""
        processor = self.pipeline.image_processor
        return processor.preprocess(self._resize_images(images, height, width), height, width).to(device=device,
                                                                                               dtype=dtype)

    def _resize_images(self, images: Sequence[Any], height: int, width: int) -> list[Any]:
        """RGB copies of ``images`` resized to ``height`` x ``width`` as the pipeline's image processor resizes."""
        processor = self.pipeline.image_processor
        return [processor.resize(im.convert("RGB"), height, width) for im in images]
