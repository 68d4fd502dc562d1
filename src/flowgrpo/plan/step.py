"""One training step of a recipe, run on fake tensors at the model's real widths: rollout, decode, loss over the
trained timesteps, backward. Memory is counted with :class:`~flowgrpo.plan.tracking.LiveBytes`, FLOPs with
``torch.utils.flop_counter.FlopCounterMode``.

The transformer is built from its config on the meta device, gets the recipe's LoRA (peft) and gradient
checkpointing, and is materialised as CPU fake tensors (``FakeTensorMode``; fake "cuda" tensors would break the
device lookups of a machine without CUDA). The step calls the family adapter's own ``prepare_latents``,
``set_timesteps`` (on the real scheduler: schedules stay real tensors) and ``predict_velocity`` (CFG included), the
SDE transition with its log-probability (``sde_transition``, the one every replay calls), the forwards without
gradient the algorithm's spec names (the KL reference, the old policy, a teacher), and the VAE's decode. What the
training step is comes from the algorithm's spec (``flowgrpo.trainer.algorithm_spec.PlannedStep``), never from the
algorithm's name.

Depth scaling. A full-size step is linear in the number of blocks of each kind, so the planner measures small
copies with the real widths: the base copy has every depth key (``num_layers``, ``num_single_layers``) at 2 (so
that the largest block's transient, e.g. its recomputation under gradient checkpointing, is already in it, and SD3's
last, context-only block is not the one repeated) and block 0 in each block-index list (SD3's
``dual_attention_layers``); then each key at 3; then each list holding blocks 0 and 1. With b_k = min(2, N_k):

    total = R(base) + sum_k (N_k - b_k) (R(k at b_k + 1) - R(base)) + sum_L (|L| - 1) (R(L = [0, 1]) - R(base)).

This is exact for parameter counts and FLOPs and, for the training peak, exact when the peak is reached at the same
place in every copy (the start of the backward, when every block's saved activations are alive). The rollout runs
without gradients, so nothing accumulates over blocks: its peak is the largest of the copies' peaks. Models under
``FULL_DEPTH_PARAMS`` are measured at full depth instead.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .model_specs import ModelSpec
from .tracking import LiveBytes, flash_attention_patched

#: Config keys that count blocks, and config keys listing block indices with an extra part.
DEPTH_KEYS = ("num_layers", "num_single_layers", "n_layers")
INDEX_LIST_KEYS = ("dual_attention_layers",)
#: Transformers up to this many parameters are measured at full depth (CPU presets: exact, no scaling).
FULL_DEPTH_PARAMS = 300_000_000


@dataclass(frozen=True)
class StepSettings:
    """What the step depends on, read from the recipe's training arguments."""

    height: int
    width: int
    num_frames: int
    micro_batch: int
    num_inference_steps: int
    trained_steps: int               # backward passes per micro-batch (SDE window, or DiffusionNFT's noise levels)
    guidance_scale: float
    text_tokens: int                 # max_sequence_length
    dtype: torch.dtype
    use_lora: bool
    lora_r: int
    lora_alpha: int
    lora_targets: tuple[str, ...]
    checkpointing: bool
    beta: float
    trained_input: str               # the algorithm's spec (PlannedStep): "recorded_transition" | "noised_sample"
    frozen_forwards: tuple[str, ...]  # forwards without gradient per trained timestep: "old_policy", "teacher",
                                      # "reference"
    loss: str                        # "ratio" | "transition_mean_mse" | "velocity_mse"
    noise_level: float
    sde_type: str
    decode_batch: int
    rollout_passes: float = 0.0      # transformer passes per sample over a rollout (0: num_inference_steps); a
                                     # BranchGRPO tree's samples share their prefixes, so fewer
    trained_passes: float = 0.0      # trained transitions per sample (0: trained_steps); a tree's edges per leaf
    stored_per_step: int = 2         # latents kept per recorded step: x_j, x_{j+1} (3 with the transition means)
    teachers: int = 0                # on-policy distillation: the teachers kept
    teacher_kind: str = ""           # "lora" (a further adapter) | "model" (another transformer) | "" (none)
    trained_batch: int = 1           # rows of one trained part per sample (AWM: its train_timesteps levels at once)
    timesteps_per_pass: int = 1      # K: trained timesteps stacked into one forward and backward
                                     # (train_timesteps_per_pass, resolved against trained_steps)
    policy_copies: int = 0           # copies of the trained weights besides the EMA (old policy, sampling copy)
    unsharded_reference: bool = False  # full fine-tuning with beta > 0 keeps a whole frozen reference on every GPU
    samples_with_copy: bool = False  # the rollouts are sampled by a copy (a rollout worker holds it)
    split_tokens: bool = False       # sequence parallelism: the family's attention for split tokens
                                     # (``prepare_sequence_parallel``: HunyuanVideo 1.5's key-only mask)
    vae_tiling: bool = False         # decode in the VAE's spatial tiles (``vae_tiling``)
    backprop_steps: int = 0          # a reward-gradient step: sampler steps one trained chain runs with gradient
    checkpointed_steps: bool = False  # each of them recomputed in the backward (only its input kept), the decoder too

    @property
    def sampling_passes(self) -> float:
        """Transformer passes per sample without gradient: ``rollout_passes``, or the whole trajectory when that is 0
        (a reward-gradient step that backpropagates through every step samples nothing without gradient)."""
        if self.rollout_passes or self.backprop_steps:
            return float(self.rollout_passes)
        return float(self.num_inference_steps)


    @property
    def pass_rows(self) -> int:
        """Rows of one trained pass per sample: ``trained_batch`` x K."""
        return self.trained_batch * self.timesteps_per_pass

    @property
    def trained_pass_count(self) -> float:
        """Trained passes (forward + backward) per micro-batch: ceil(trained transitions / K)."""
        import math

        return float(math.ceil((self.trained_passes or self.trained_steps) / self.timesteps_per_pass))


@dataclass
class StepMeasure:
    """Bytes and FLOPs of one micro-batch's step on one GPU (before sharding), and parameter counts."""

    rollout_bytes: float = 0.0       # transient peak of one sampling trajectory (no gradients)
    training_bytes: float = 0.0      # transient peak of one trained pass's forward + backward, gradients excluded
    decode_bytes: float = 0.0        # transient peak of decoding one slice of the micro-batch
    rollout_flops: float = 0.0       # FLOPs of the whole trajectory of one micro-batch
    training_flops: float = 0.0      # FLOPs of all trained steps of one micro-batch (forward, recompute, backward)
    decode_flops: float = 0.0
    latent_bytes: float = 0.0        # one micro-batch's latents in float32
    block_io_bytes: float = 0.0      # one block's input hidden states (image + text streams) for one trained step
    params: dict[str, float] = field(default_factory=dict)  # "total", "trainable", "block_max", "linear"

    def combine(self, other: StepMeasure, weight: float) -> StepMeasure:
        keys = ("rollout_bytes", "training_bytes", "decode_bytes", "rollout_flops", "training_flops", "decode_flops",
                "block_io_bytes", "latent_bytes")
        out = StepMeasure(**{k: getattr(self, k) + weight * getattr(other, k) for k in keys})
        out.params = {k: self.params.get(k, 0) + weight * other.params.get(k, 0) for k in self.params}
        return out

    def minus(self, other: StepMeasure) -> StepMeasure:
        return self.combine(other, -1.0)


_DECODE_CACHE: dict[tuple, tuple[float, float]] = {}


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _diffusers_class(name: str):
    import diffusers

    return getattr(diffusers, name)


def build_on_meta(spec: ModelSpec, transformer_config: dict[str, Any] | None = None):
    """(transformer, vae) built from their configs on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        transformer = _diffusers_class(spec.transformer_class).from_config(
            transformer_config if transformer_config is not None else spec.transformer_config)
        vae = _diffusers_class(spec.vae_class).from_config(spec.vae_config)
    return transformer, vae


def _pipeline(spec: ModelSpec, transformer, vae):
    """The family's diffusers pipeline around the fake transformer and VAE (no text encoders, no tokenizers)."""
    import inspect

    cls = _diffusers_class(spec.pipeline_class)
    scheduler = _diffusers_class(spec.scheduler_class).from_config(spec.scheduler_config)
    params = inspect.signature(cls.__init__).parameters
    kwargs = {name: None for name, p in params.items() if name != "self" and p.default is inspect.Parameter.empty}
    kwargs.update(transformer=transformer, vae=vae, scheduler=scheduler)
    kwargs.update({name: build_component(*part) for name, part in spec.components.items()})
    kwargs.update({name: make() for name, make in PIPELINE_ARGUMENTS.get(spec.pipeline_class, {}).items()})
    return cls(**kwargs)


def _qwenimage21_processor():
    from ..benchmarking.full_size_families import qwenimage21_processor

    return qwenimage21_processor()


#: Pipeline class -> arguments its constructor reads beyond the transformer, VAE and scheduler (Qwen-Image 2.1 counts
#: its system prompt's tokens with the processor): the locally made stand-ins of the full-size benchmark builders.
PIPELINE_ARGUMENTS: dict[str, dict[str, Callable[[], Any]]] = {
    "QwenImage21Pipeline": {"processor": _qwenimage21_processor},
}


def build_component(class_name: str, config: dict[str, Any]):
    """A further pipeline module (a diffusers model from its config, or a transformers model from its config class)
    on the meta device: the adapter reads its configuration; it is never run."""
    import diffusers
    import transformers

    with torch.device("meta"):
        if hasattr(diffusers, class_name):
            return getattr(diffusers, class_name).from_config(config)
        cls = getattr(transformers, class_name)
        return cls(cls.config_class(**config))


def _adapter(spec: ModelSpec, pipeline, num_frames: int):
    from ..models import family_adapter_class

    adapter = family_adapter_class(spec.pipeline_class)(pipeline, num_frames=num_frames)
    if hasattr(adapter, "_mask_or_none"):  # every text token valid: the longest sequence (no data-dependent check)
        adapter._mask_or_none = lambda mask: None
    if hasattr(adapter, "_captions"):  # Z-Image's per-sample captions: every token valid (no boolean indexing)
        adapter._captions = lambda text: list(text["prompt_embeds"].unbind(0))
    return adapter


def _text(batch: int, tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(batch, tokens, width, dtype=dtype)


def _all_valid(batch: int, tokens: int) -> torch.Tensor:
    return torch.ones(batch, tokens, dtype=torch.long)


def _first_frame(config: dict[str, Any], latents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Wan image-to-video's ``condition``: 2.1 I2V (``in_channels`` above the latent channels) the frame mask and the
    first frame's latents over every latent frame, channel-concatenated to the noise; TI2V the first latent frame."""
    channels = int(latents.shape[1])
    extra = int(config["in_channels"]) - channels
    if extra > 0:
        return torch.zeros(latents.shape[0], extra, *latents.shape[2:], dtype=dtype)
    return torch.zeros(latents.shape[0], channels, 1, *latents.shape[3:], dtype=dtype)


#: Adapter family -> what its ``encode_prompts`` returns, as zero tensors of the right shapes:
#: ``(transformer config, batch, text tokens, latents, dtype) -> {name: tensor}``. Widths come from the transformer's
#: config; fixed lengths are the pipelines' (SD3: 77 CLIP tokens before T5's; Wan 2.1 I2V: 257 CLIP ViT-H image
#: tokens; HunyuanVideo 1.5: 256 ByT5 glyph tokens). Reference / source images (editing, image-to-video) are one per
#: sample, at the sample's size. Every text token is valid: the longest sequence, the memory a padded batch takes.
CONDITIONING: dict[str, Callable[[dict[str, Any], int, int, torch.Tensor, torch.dtype], dict[str, torch.Tensor]]] = {
    "sd3": lambda c, b, n, x, d: {"prompt_embeds": _text(b, 77 + n, c["joint_attention_dim"], d),
                                  "pooled_prompt_embeds": torch.zeros(b, c["pooled_projection_dim"], dtype=d)},
    "flux": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["joint_attention_dim"], d),
                                   "pooled_prompt_embeds": torch.zeros(b, c["pooled_projection_dim"], dtype=d)},
    "flux_kontext": lambda c, b, n, x, d: {**CONDITIONING["flux"](c, b, n, x, d),
                                           "image_latents": torch.zeros_like(x, dtype=d)},
    "flux2": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["joint_attention_dim"], d)},
    "flux2_klein": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["joint_attention_dim"], d)},
    "zimage": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["cap_feat_dim"], d),
                                     "prompt_embeds_mask": _all_valid(b, n)},
    "qwenimage": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["joint_attention_dim"], d),
                                        "prompt_embeds_mask": _all_valid(b, n)},
    "qwenimage_edit": lambda c, b, n, x, d: {**CONDITIONING["qwenimage"](c, b, n, x, d),
                                             "image_latents": torch.zeros_like(x, dtype=d)},
    "qwenimage_edit_plus": lambda c, b, n, x, d: CONDITIONING["qwenimage_edit"](c, b, n, x, d),
    "qwenimage21": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["context_in_dim"], d),
                                          "prompt_embeds_mask": _all_valid(b, n),
                                          "image_pad_mask": torch.zeros(b, n, dtype=torch.long)},
    "wan": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["text_dim"], d)},
    "wan_i2v": lambda c, b, n, x, d: {
        **CONDITIONING["wan"](c, b, n, x, d), "condition": _first_frame(c, x, d),
        **({"image_embeds": _text(b, 257, c["image_dim"], d)} if c.get("image_dim") else {})},
    "ltx2": lambda c, b, n, x, d: {"video_context": _text(b, n, c["caption_channels"], d),
                                   "audio_context": _text(b, n, c["caption_channels"], d),
                                   "context_mask": _all_valid(b, n)},
    "hunyuanvideo15": lambda c, b, n, x, d: {"prompt_embeds": _text(b, n, c["text_embed_dim"], d),
                                             "prompt_embeds_mask": _all_valid(b, n),
                                             "prompt_embeds_2": _text(b, 256, c["text_embed_2_dim"], d),
                                             "prompt_embeds_mask_2": _all_valid(b, 256)},
}


#: Families whose transformer reads the values of its masks to lay out its token sequence (Qwen-Image 2.1's image
#: slots, HunyuanVideo 1.5's reordered text tokens): their step runs with :class:`~flowgrpo.plan.real_masks.
#: RealValuedMasks`, which keeps small data-independent tensors real.
REAL_MASK_FAMILIES = ("qwenimage21", "hunyuanvideo15")


def conditioning(spec: ModelSpec, config: dict[str, Any], batch: int, text_tokens: int, latents: torch.Tensor,
                 dtype: torch.dtype):
    """Prompt embeddings of the family's shapes (what its ``encode_prompts`` returns), for ``batch`` samples."""
    from ..models import PromptEmbeds

    if spec.family not in CONDITIONING:
        raise ValueError(f"The planner has no conditioning shapes for family {spec.family!r}; add them to "
                         f"flowgrpo.plan.step.CONDITIONING (known: {', '.join(sorted(CONDITIONING))}).")
    return PromptEmbeds(CONDITIONING[spec.family](config, batch, text_tokens, latents, dtype))


def prepare_transformer(transformer, settings: StepSettings, spec: ModelSpec):
    """The recipe's trained model around ``transformer``: its LoRA (on the recipe's targets, else the family
    adapter's defaults; float32, as the trainer casts it) or every weight trained, and gradient checkpointing."""
    from ..models import family_adapter_class

    adapter_targets = tuple(family_adapter_class(spec.pipeline_class).default_lora_target_modules)
    transformer.requires_grad_(False)
    transformer.to(settings.dtype)  # gradient checkpointing (below) runs for real, as torch's checkpoint
    if settings.use_lora:
        from peft import LoraConfig, get_peft_model

        targets = list(settings.lora_targets or adapter_targets)
        model = get_peft_model(transformer, LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha,
                                                       target_modules=targets, init_lora_weights="gaussian"))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # as the trainer: LoRA tensors train in float32
    else:
        transformer.requires_grad_(True)
        model = transformer
    if settings.checkpointing:
        import functools

        from torch.utils.checkpoint import checkpoint

        # torch's checkpoint as the trainer enables it (non-reentrant); no RNG state is saved: it changes no memory
        # (the blocks have no dropout) and forking the RNG state dominates its cost under fake tensors
        transformer.enable_gradient_checkpointing(
            gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False))
    return model


def _param_counts(transformer, model) -> dict[str, float]:
    blocks = [m for name, m in transformer.named_children() if isinstance(m, torch.nn.ModuleList)]
    block_max = max((sum(p.numel() for p in b.parameters()) for lst in blocks for b in lst), default=0)
    linear = sum(m.weight.numel() for m in transformer.modules() if type(m) is torch.nn.Linear)
    total = sum(p.numel() for p in transformer.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"total": float(total), "trainable": float(trainable), "frozen": float(frozen),
            "block_max": float(block_max), "linear": float(linear)}


def _counting(phase: str, also_track: Callable[[str], contextlib.AbstractContextManager] | None = None):
    """One mode counting live bytes and FLOPs (``LiveBytes``), and the context entered beside it: ``also_track(phase)``
    when given (a second tracker of the same phase, for cross-checks), else a no-op."""
    live = LiveBytes()
    return live, also_track(phase) if also_track is not None else contextlib.nullcontext(live)


def run_step(spec: ModelSpec, settings: StepSettings, transformer_config: dict[str, Any] | None = None, *,
             fake: bool = True, real_modules: tuple | None = None, rollout_only: bool = False,
             decode: bool = True, also_track: Callable[[str], contextlib.AbstractContextManager] | None = None,
             decode_only: bool = False) -> StepMeasure:
    """Run one micro-batch's rollout, decode and training on the transformer of ``transformer_config`` (default:
    the full one) and return its measured bytes and FLOPs. ``fake=False`` runs the same step on real tensors
    (``real_modules``: the (transformer, vae) to use), for the fidelity checks. ``also_track(phase)`` (phase
    ``"rollout"``, ``"decode"`` or ``"training"``) returns a context entered beside the counting mode for that phase,
    e.g. torch's ``MemTracker`` to cross-check the counts. ``decode_only`` measures the decode alone (only
    ``decode_bytes`` and ``decode_flops`` are set): the transformer is neither prepared nor run, and the decoded
    slice is cut from latents of the rollout's shape and dtype (float32), all that the decode reads of the
    rollout's sample."""
    from ..schedulers.transition import SDESettings, sde_transition

    config = dict(transformer_config if transformer_config is not None else spec.transformer_config)
    if real_modules is None:
        transformer, vae = build_on_meta(spec, config)
    else:
        transformer, vae = real_modules
    measure = StepMeasure()
    mode = _fake_mode() if fake else contextlib.nullcontext()
    generator = torch.Generator().manual_seed(0)
    vae.to(settings.dtype).requires_grad_(False)
    if settings.vae_tiling:
        vae.enable_tiling()
    model = transformer
    if not decode_only:
        model = prepare_transformer(transformer, settings, spec)
        measure.params = _param_counts(transformer, model)
    # the pipeline, its adapter and the schedule are built on real tensors, before fake mode starts
    pipeline = _pipeline(spec, transformer, vae)
    adapter = _adapter(spec, pipeline, settings.num_frames)
    if settings.split_tokens:  # the attention the trainer runs once a sample's tokens are split
        adapter.prepare_sequence_parallel(transformer)
    height, width, batch = settings.height, settings.width, settings.micro_batch
    scheduler = pipeline.scheduler
    if spec.scheduler_class != "FlowMatchEulerDiscreteScheduler":
        from ..schedulers.scheduling_flow_match_sde import FlowMatchSDEScheduler

        scheduler = FlowMatchSDEScheduler.from_config(adapter.sde_scheduler_config())
    adapter.set_timesteps(scheduler, settings.num_inference_steps, height, width, torch.device("cpu"))
    sigmas = [float(s) for s in scheduler.sigmas]   # plain numbers: no data-dependent op under fake mode
    timesteps = [float(t) for t in scheduler.timesteps]
    import json

    decode_key = (spec.vae_class, json.dumps(spec.vae_config, sort_keys=True), height, width, settings.num_frames,
                  settings.decode_batch, str(settings.dtype), spec.family, settings.vae_tiling)
    if fake and decode and decode_key in _DECODE_CACHE:  # the same VAE decoding the same slice: measured before
        measure.decode_bytes, measure.decode_flops = _DECODE_CACHE[decode_key]
        decode = False
    from .real_masks import RealValuedMasks

    masks = RealValuedMasks() if fake and spec.family in REAL_MASK_FAMILIES else contextlib.nullcontext()
    with flash_attention_patched(), mode, masks:
        if fake:
            if not decode_only:
                model.to_empty(device="cpu")
            if decode:
                vae.to_empty(device="cpu")
        latents = adapter.prepare_latents(batch, height, width, generator if not fake else None,
                                          torch.device("cpu"), torch.float32)
        if decode_only:
            if decode:
                measure.decode_bytes, measure.decode_flops = _decode_phase(adapter, latents, settings, also_track,
                                                                           decode_key if fake else None)
            return measure
        embeds = conditioning(spec, config, batch, settings.text_tokens, latents, settings.dtype)
        negative = conditioning(spec, config, batch, settings.text_tokens, latents, settings.dtype) \
            if adapter.uses_cfg(settings.guidance_scale) else None

        def velocity(net, x, t_value):
            t = torch.full((batch,), t_value, dtype=torch.float32)
            return adapter.predict_velocity(net, x.to(settings.dtype), t, embeds, settings.guidance_scale, negative,
                                            height, width).float()

        measure.latent_bytes = float(latents.numel() * 4)
        try:
            image_tokens, text_tokens = adapter.sequence_lengths(embeds, latents)
        except (NotImplementedError, RuntimeError):  # no token count for this family (LTX-2's two streams) or a
            image_tokens = text_tokens = 0            # count read from a mask, which fake tensors do not hold
        rows = batch * (2 if negative is not None else 1)
        inner = int(config.get("num_attention_heads", 1)) * int(config.get("attention_head_dim", 1))
        measure.block_io_bytes = float(rows * (image_tokens + text_tokens) * inner * settings.dtype.itemsize)

        # ---- rollout: one sampling step (every step has the same shapes), no gradients -----------------------------
        live, flops = _counting("rollout", also_track)
        with torch.no_grad(), live, flops:
            v = velocity(model, latents, timesteps[0])
            out = sde_transition(v, latents, sigmas[0], sigmas[1],
                                 SDESettings(settings.noise_level, settings.sde_type, sigma_max_fallback=sigmas[1]))
            x_next, old_log_prob = out.prev_sample, out.log_prob
            del v, out
        measure.rollout_bytes = live.peak
        measure.rollout_flops = live.get_total_flops() * settings.sampling_passes

        # ---- decode: one slice of the micro-batch ------------------------------------------------------------------
        if decode:  # the VAE does not change with the transformer's depth: measured once
            measure.decode_bytes, measure.decode_flops = _decode_phase(adapter, x_next, settings, also_track,
                                                                       decode_key if fake else None)

        if rollout_only:
            return measure
        # ---- training: one trained pass's forward and backward (K trained timesteps stacked, every pass alike; the
        # last, smaller one of an uneven split peaks lower), as the algorithm's spec plans it (`_trained_step_loss`)
        live, flops = _counting("training", also_track)
        hooks = [p.register_post_accumulate_grad_hook(lambda param: live.exclude(param.grad))
                 for p in model.parameters() if p.requires_grad]
        trained_velocity = _trained_velocity(spec, config, adapter, settings, latents, embeds, negative)
        if settings.loss == "reward_gradient" and fake and not decode:
            vae.to_empty(device="cpu")  # the chain is decoded with gradient: the VAE takes part in every copy
        with live, flops:
            if settings.loss == "reward_gradient":
                loss = _reward_gradient_loss(settings, model, trained_velocity, adapter, latents, sigmas, timesteps)
            else:
                loss = _trained_step_loss(settings, model, trained_velocity, latents, x_next, old_log_prob, sigmas,
                                          timesteps[0])
            loss.backward()
            del loss
        for hook in hooks:
            hook.remove()
        measure.training_bytes = live.peak_excluding  # gradients are a term of their own (sharded by FSDP / ZeRO)
        # FLOPs are linear in the rows: one pass of K timesteps' rows, times the trained transitions over K
        measure.training_flops = live.get_total_flops() * (settings.trained_passes or settings.trained_steps) / \
            settings.timesteps_per_pass
    return measure


def _decode_phase(adapter, x_next: torch.Tensor, settings: StepSettings,
                  also_track: Callable[[str], contextlib.AbstractContextManager] | None,
                  cache_key: tuple | None = None) -> tuple[float, float]:
    """``(peak bytes, FLOPs)`` of decoding the first ``decode_batch`` samples of ``x_next``, without gradients; kept
    in the decode cache under ``cache_key`` when given (a fake-tensor step's)."""
    live, flops = _counting("decode", also_track)
    with torch.no_grad(), live, flops:
        images = adapter.decode(x_next[: settings.decode_batch].to(settings.dtype), settings.height, settings.width)
        del images
    result = (live.peak, live.get_total_flops())
    if cache_key is not None:
        _DECODE_CACHE[cache_key] = result
    return result


def _trained_velocity(spec: ModelSpec, config: dict[str, Any], adapter, settings: StepSettings,
                      latents: torch.Tensor, embeds, negative):
    """``velocity(net, x, t)`` over the rows of one trained pass: the micro-batch, or ``pass_rows`` copies of it (one
    forward over several noise levels or recorded steps of each sample: AWM's levels, K timesteps per pass)."""
    rows_embeds, rows_negative = embeds, negative
    if settings.pass_rows > 1:
        rows = latents.shape[0] * settings.pass_rows
        rows_latents = torch.cat([latents] * settings.pass_rows)
        rows_embeds = conditioning(spec, config, rows, settings.text_tokens, rows_latents, settings.dtype)
        rows_negative = conditioning(spec, config, rows, settings.text_tokens, rows_latents, settings.dtype) \
            if negative is not None else None

    def velocity(net, x, t_value):
        t = torch.full((x.shape[0],), t_value, dtype=torch.float32)
        return adapter.predict_velocity(net, x.to(settings.dtype), t, rows_embeds, settings.guidance_scale,
                                        rows_negative, settings.height, settings.width).float()

    return velocity


def _trained_step_loss(settings: StepSettings, model, velocity, latents: torch.Tensor, x_next: torch.Tensor,
                       old_log_prob: torch.Tensor, sigmas: list[float], t_value: float) -> torch.Tensor:
    """The loss of one trained pass (``pass_rows`` rows per sample: K timesteps stacked, each the same shapes) as the
    algorithm's spec plans it (`PlannedStep`): the trained forward's input
    (the recorded transition x_j -> x_{j+1}, or the final sample noised to a level, x_t = (1 - sigma) x0 + sigma eps),
    the forwards without gradient it adds (the old policy's before it; a teacher's and the reference's after it, as
    the trainers run them) and the loss's form (the ratio of the recomputed transition, the distance of its mean to a
    teacher's, a velocity regression), plus ``beta`` x the velocity KL to the reference."""
    from ..schedulers.transition import SDESettings, sde_transition

    if settings.trained_input == "recorded_transition":
        x_in = latents
    else:
        x_in = (1 - sigmas[0]) * x_next + sigmas[0] * latents
    if settings.pass_rows > 1:  # the pass's rows: K timesteps (and AWM's levels) of each sample, stacked
        copies = settings.pass_rows
        x_in, latents, x_next = (torch.cat([x] * copies) for x in (x_in, latents, x_next))
        old_log_prob = torch.cat([old_log_prob] * copies)
    frozen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if "old_policy" in settings.frozen_forwards:
            frozen["old_policy"] = velocity(model, x_in, t_value)
    v = velocity(model, x_in, t_value)
    with torch.no_grad():
        if "teacher" in settings.frozen_forwards:
            frozen["teacher"] = velocity(model, x_in, t_value)
        if "reference" in settings.frozen_forwards:
            frozen["reference"] = _reference_velocity(model, velocity, x_in, t_value, settings)
    sde = SDESettings(settings.noise_level, settings.sde_type, sigma_max_fallback=sigmas[1])
    if settings.loss == "ratio":
        out = sde_transition(v, latents, sigmas[0], sigmas[1], sde, next_state=x_next)
        loss = -torch.exp(out.log_prob - old_log_prob).mean()
    elif settings.loss == "transition_mean_mse":
        out = sde_transition(v, latents, sigmas[0], sigmas[1], sde, next_state=x_next)
        with torch.no_grad():
            target = sde_transition(frozen.get("teacher", frozen.get("reference", v.detach())), latents, sigmas[0],
                                    sigmas[1], sde).prev_sample_mean
        loss = ((out.prev_sample_mean - target) ** 2).mean()
    else:
        target = frozen.get("old_policy", frozen.get("reference"))
        loss = ((v - (target if target is not None else v.detach())) ** 2).mean()
    if "reference" in frozen and settings.beta > 0:
        loss = loss + settings.beta * ((v - frozen["reference"]) ** 2).mean()
    return loss


def _reward_gradient_loss(settings: StepSettings, model, velocity, adapter, latents: torch.Tensor,
                          sigmas: list[float], timesteps: list[float]) -> torch.Tensor:
    """A reward-gradient step as the trainer runs it: ``backprop_steps`` Euler steps with gradient from a state the
    sampler reached without it (each checkpointed with ``checkpointed_steps``: only its input kept, its forward
    recomputed in the backward), with the KL reference's forward at each state when the spec names it, the end decoded
    with gradient in slices of the decode batch (each checkpointed likewise), and a stand-in reward (the images'
    mean) backpropagated through all of it. The reward model's own activations are not part of the measure."""
    from torch.utils.checkpoint import checkpoint

    steps = settings.num_inference_steps
    chain = max(1, min(settings.backprop_steps, steps))
    x = latents
    for i in range(steps - chain, steps):
        if "reference" in settings.frozen_forwards:
            with torch.no_grad():
                _reference_velocity(model, velocity, x, timesteps[i], settings)
        if settings.checkpointed_steps:
            v = checkpoint(velocity, model, x, timesteps[i], use_reentrant=False, preserve_rng_state=False)
        else:
            v = velocity(model, x, timesteps[i])
        x = x + (sigmas[i + 1] - sigmas[i]) * v

    def decode(z):
        return adapter.decode(z.to(settings.dtype), settings.height, settings.width).float()

    slices = []
    for start in range(0, x.shape[0], max(1, settings.decode_batch)):
        part = x[start:start + max(1, settings.decode_batch)]
        slices.append(checkpoint(decode, part, use_reentrant=False, preserve_rng_state=False)
                      if settings.checkpointed_steps else decode(part))
    return -torch.cat(slices).mean()


def _reference_velocity(model, velocity, x, t_value, settings: StepSettings):
    if settings.use_lora:
        with model.disable_adapter():
            return velocity(model, x, t_value)
    return velocity(model, x, t_value)  # full fine-tuning: a frozen copy of the same size (its weights: "copies")


def reduced_configs(spec: ModelSpec) -> list[tuple[dict[str, Any], float]]:
    """The small copies to measure and the weight of each one's difference from the first (module docstring)."""
    full = spec.transformer_config
    counts = {k: int(full.get(k, 0) or 0) for k in DEPTH_KEYS if int(full.get(k, 0) or 0) > 0}
    lists = [k for k in INDEX_LIST_KEYS if full.get(k)]
    base_depth = {k: min(2, n) for k, n in counts.items()}
    base = dict(full, **base_depth, **{k: [0] for k in lists})
    plan: list[tuple[dict[str, Any], float]] = [(base, 1.0)]
    for k, n in counts.items():
        if n > base_depth[k]:
            plan.append((dict(base, **{k: base_depth[k] + 1}), float(n - base_depth[k])))
    for k in lists:
        if len(full[k]) > 1 and base_depth.get("num_layers", 0) >= 2:
            plan.append((dict(base, **{k: [0, 1]}), float(len(full[k]) - 1)))
    return plan


_CACHE: dict[tuple, tuple[StepMeasure, StepMeasure, int]] = {}
#: The same results keyed without the settings that change only the decode (`decode_settings_free`).
_STEP_CACHE: dict[tuple, tuple[StepMeasure, StepMeasure, int]] = {}
#: (model, transformer config) -> the full transformer's parameter count (built on the meta device once).
_FULL_PARAMS: dict[tuple, int] = {}

#: Settings that change only what the decode measures (the slice decoded, the VAE's tiling); the rollout and the
#: training do not read them, except a reward-gradient step's, which decodes with gradient.
DECODE_FIELDS = ("decode_batch", "vae_tiling")


def decode_settings_free(settings: StepSettings) -> StepSettings | None:
    """``settings`` with `DECODE_FIELDS` at fixed values: equal for two steps that differ only in their decode (None
    for a reward-gradient step, whose training decodes)."""
    import dataclasses

    if settings.loss == "reward_gradient":
        return None
    return dataclasses.replace(settings, decode_batch=0, vae_tiling=False)


def _with_decode(result: tuple[StepMeasure, StepMeasure, int], decode_bytes: float, decode_flops: float
                 ) -> tuple[StepMeasure, StepMeasure, int]:
    """A measured ``(total, smallest, blocks)`` with another decode's measure (every copy decodes the same, so the
    combined total's decode is the base copy's)."""
    total, base, blocks = result
    new_total = copy.deepcopy(total)
    new_base = new_total if base is total else copy.deepcopy(base)
    for m in {id(new_total): new_total, id(new_base): new_base}.values():
        m.decode_bytes, m.decode_flops = decode_bytes, decode_flops
    return new_total, new_base, blocks


def measure_full_depth(spec: ModelSpec, settings: StepSettings, *, full_depth: bool | None = None
                       ) -> tuple[StepMeasure, StepMeasure, int]:
    """``(total, smallest, blocks)``: the step of the full-depth model (measured directly for small models, else
    combined from small copies), the step of the smallest copy measured, and the full model's block count.
    Results are kept per (model, settings) for the process (suggestions re-plan from them); settings that differ
    from measured ones only in the decode (`DECODE_FIELDS`) measure the decode alone and keep the rest."""
    import json

    config_key = json.dumps(spec.transformer_config, sort_keys=True)
    key = (spec.name, config_key, settings, full_depth)
    if key in _CACHE:
        return _CACHE[key]
    free = decode_settings_free(settings)
    step_key = (spec.name, config_key, free, full_depth)
    if free is not None and step_key in _STEP_CACHE:
        # the VAE's decode does not depend on the transformer (not run): the cheapest copy to build
        decode = run_step(spec, settings, reduced_configs(spec)[0][0], decode_only=True)
        result = _with_decode(_STEP_CACHE[step_key], decode.decode_bytes, decode.decode_flops)
        _CACHE[key] = result
        return result
    full = spec.transformer_config
    blocks = sum(int(full.get(k, 0) or 0) for k in DEPTH_KEYS)
    if full_depth is None:
        if (spec.name, config_key) not in _FULL_PARAMS:
            transformer, _ = build_on_meta(spec)
            _FULL_PARAMS[(spec.name, config_key)] = sum(p.numel() for p in transformer.parameters())
            del transformer
        full_depth = _FULL_PARAMS[(spec.name, config_key)] <= FULL_DEPTH_PARAMS
    if full_depth:
        total = run_step(spec, settings)
        result = (total, total, 1)
    else:
        plan = reduced_configs(spec)
        base = run_step(spec, settings, plan[0][0])
        total = copy.deepcopy(base)
        rollout_peaks = [base.rollout_bytes]
        for config, weight in plan[1:]:
            copy_step = run_step(spec, settings, config, decode=False)
            copy_step.decode_bytes, copy_step.decode_flops = base.decode_bytes, base.decode_flops
            rollout_peaks.append(copy_step.rollout_bytes)
            total = total.combine(copy_step.minus(base), weight)
        # without gradients nothing accumulates over blocks: the rollout's peak is the largest block's, not a sum
        total.rollout_bytes = max(rollout_peaks)
        result = (total, base, blocks)
    _CACHE[key] = result
    if free is not None:
        _STEP_CACHE[step_key] = result
    return result


__all__ = ["CONDITIONING", "DEPTH_KEYS", "REAL_MASK_FAMILIES", "FULL_DEPTH_PARAMS", "StepMeasure", "StepSettings", "build_component", "build_on_meta", "conditioning",
           "DECODE_FIELDS", "decode_settings_free", "measure_full_depth", "prepare_transformer", "reduced_configs", "run_step"]
