"""Cached rollouts (``rollout_cache``): diffusers' own cache hooks around the denoising loop of training rollouts.

A cache reuses (or extrapolates) the outputs of transformer blocks or attention layers from earlier denoising steps
instead of computing them, so a rollout costs fewer block computations and its images move away from the policy's
own, by a little. The hooks are diffusers' (``diffusers.hooks``); nothing here decides what to skip:

=================  ====================================  ==========================================================
``rollout_cache``  diffusers' configuration              what it skips
=================  ====================================  ==========================================================
``first_block``    ``FirstBlockCacheConfig``             every block after the first, while the first block's
                                                         residual changes by less than ``threshold``
``taylorseer``     ``TaylorSeerCacheConfig``             the hooked layers between full steps every
                                                         ``cache_interval``, predicted by a Taylor expansion
``mag``            ``MagCacheConfig``                    blocks while the accumulated magnitude-ratio error
                                                         stays under ``threshold`` (needs the ``mag_ratios``)
``faster``         ``FasterCacheConfig``                 attention every ``spatial_attention_block_skip_range``
                                                         steps in a timestep range, and the unconditional branch
``pab``            ``PyramidAttentionBroadcastConfig``   attention every ``spatial_attention_block_skip_range``
                                                         steps in a timestep range (default 2, in (100, 800))
=================  ====================================  ==========================================================

``rollout_cache_config`` gives the configuration's fields (a dict; JSON on the command line). The callbacks are the
rollout engine's: the current timestep (PAB, FasterCache; the scheduler's 0-1000 scale, as the stock pipelines'
``current_timestep``), and MagCache's ``num_inference_steps`` is the rollout's step count.

How the hooks go on: a transformer with diffusers' ``CacheMixin`` gets ``enable_cache`` / ``disable_cache``; one
without (SD3) gets the ``apply_*`` function and loses the hooks it added afterwards. Each trajectory gets fresh hooks
(a cache never carries state from one micro-batch, or one copy of the policy, to the next) and every transformer call
its own cache context (``hooks.hooks._set_cache_context``, what ``cache_context`` sets): ``"pass<k>"`` for the k-th
call of the current denoising step, so a family whose guidance calls the transformer twice per step (conditional,
then unconditional) keeps one cached state per branch, as the stock pipelines' ``cache_context("cond")`` /
``("uncond")`` do.

Skipped computations are counted from the hooks themselves: each hooked module's calls, and the calls of the forward
the hook falls back to when it computes. ``skipped_fraction`` is 1 - computed / called over the hooked modules
(blocks, or attention layers for PAB and FasterCache), the figure logged as ``rollout/cache_skipped``.

Which family runs which cache is measured on the tiny pipelines of every family (``scripts/rollout_cache_table.py``;
the table: ``flowgrpo.trainer.speed_settings.UNSUPPORTED`` and docs/benchmarks.md, "Cached rollouts"); a combination
that fails is refused when the trainer is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..speed_settings import ROLLOUT_CACHES

__all__ = ["CACHE_CONFIG_CLASSES", "CacheSteps", "RolloutCache", "build_cache_config", "cache_config_fields",
           "check_rollout_cache_fields"]

#: ``rollout_cache`` -> (the diffusers configuration class, the ``apply_*`` function of ``diffusers.hooks``)
CACHE_CONFIG_CLASSES = {
    "first_block": ("FirstBlockCacheConfig", "apply_first_block_cache"),
    "taylorseer": ("TaylorSeerCacheConfig", "apply_taylorseer_cache"),
    "mag": ("MagCacheConfig", "apply_mag_cache"),
    "faster": ("FasterCacheConfig", "apply_faster_cache"),
    "pab": ("PyramidAttentionBroadcastConfig", "apply_pyramid_attention_broadcast"),
}
#: configuration fields the rollout engine fills in itself: the callbacks (a recipe cannot give one), and
#: FasterCache's ``is_guidance_distilled`` (True when the rollout samples without classifier-free guidance: there is
#: no unconditional half of the batch to skip)
ENGINE_FIELDS = ("current_timestep_callback", "attention_weight_callback", "low_frequency_weight_callback",
                 "high_frequency_weight_callback", "is_guidance_distilled")


def _config_class(kind: str) -> type:
    import diffusers.hooks

    return getattr(diffusers.hooks, CACHE_CONFIG_CLASSES[kind][0])


def cache_config_fields(kind: str) -> dict[str, Any]:
    """The fields a recipe may give for ``rollout_cache: kind``, with diffusers' defaults (the engine's own fields
    left out)."""
    fields = {}
    for f in dataclasses.fields(_config_class(kind)):
        if f.name in ENGINE_FIELDS or f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        fields[f.name] = default
    return fields


def check_rollout_cache_fields(kind: str, fields: dict[str, Any]) -> None:
    """Refuse fields that ``kind``'s configuration does not have, or that the engine sets itself (imports
    diffusers)."""
    if kind == "none":
        if fields:
            raise ValueError(f"rollout_cache_config={fields} is given but rollout_cache is 'none'; set rollout_cache "
                             f"to one of {', '.join(ROLLOUT_CACHES[1:])}, or leave rollout_cache_config out.")
        return
    name = CACHE_CONFIG_CLASSES[kind][0]
    for key in fields:
        if key in ENGINE_FIELDS or key == "num_inference_steps":
            raise ValueError(f"rollout_cache_config[{key!r}] is set by the rollout engine (the rollout's own "
                             "timestep and step count); leave it out.")
    allowed = cache_config_fields(kind)
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(f"rollout_cache_config has {unknown}, which diffusers' {name} (rollout_cache: {kind}) does "
                         f"not have; its fields are {sorted(allowed)}.")
    if kind == "mag" and fields.get("mag_ratios") is None and not fields.get("calibrate"):
        raise ValueError("rollout_cache: mag needs the model's magnitude ratios: give rollout_cache_config "
                         "{mag_ratios: [...]} (one per rollout step, or any length diffusers interpolates), measured "
                         "for this checkpoint with {calibrate: true} (a calibration run skips nothing and prints "
                         "them); for FLUX.1-dev, diffusers.hooks.mag_cache.FLUX_MAG_RATIOS.")


def _converted(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Recipe values as the configuration takes them: dtype names -> torch dtypes, lists -> tuples where the
    default is a tuple (timestep ranges)."""
    defaults = cache_config_fields(kind)
    out = {}
    for key, value in fields.items():
        default = defaults.get(key)
        if isinstance(default, torch.dtype) and isinstance(value, str):
            value = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(value, torch.dtype):
                raise ValueError(f"rollout_cache_config[{key!r}]={fields[key]!r} is not a torch dtype; give e.g. "
                                 "'float32' or 'bfloat16'.")
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        out[key] = value
    return out


def build_cache_config(kind: str, fields: dict[str, Any], num_inference_steps: int,
                       current_timestep: Callable[[], float], *, uses_cfg: bool = False, video: bool = False) -> Any:
    """diffusers' configuration of ``kind``: the recipe's ``fields`` (dtype names converted), the engine's
    timestep callback (PAB, FasterCache) and step count (MagCache); PAB skips spatial attention every second step
    unless told otherwise; FasterCache skips the unconditional half of the batch only with guidance (``uses_cfg``) and
    reads latents as ``BCFHW`` (``video``) or ``BCHW`` unless given ``tensor_format``."""
    config_class = _config_class(kind)
    values = _converted(kind, fields)
    names = {f.name for f in dataclasses.fields(config_class)}
    if "current_timestep_callback" in names:
        values["current_timestep_callback"] = current_timestep
    if kind == "mag":
        values["num_inference_steps"] = int(num_inference_steps)
    if kind == "faster":
        values["is_guidance_distilled"] = not uses_cfg
        values.setdefault("tensor_format", "BCFHW" if video else "BCHW")
    if kind == "pab" and not any(values.get(k) is not None for k in (
            "spatial_attention_block_skip_range", "temporal_attention_block_skip_range",
            "cross_attention_block_skip_range")):
        values["spatial_attention_block_skip_range"] = 2
    return config_class(**values)


def _hook_names(module: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, set[str]]]:
    """id(submodule) -> (submodule, the names of the diffusers hooks on it)."""
    out = {}
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is not None:
            out[id(sub)] = (sub, set(registry.hooks))
    return out


class CacheSteps:
    """The hooks of one trajectory (see the module docstring): `step` before each denoising step; the call and
    compute counts of the hooked modules."""

    def __init__(self, kind: str, config_fields: dict[str, Any], transformers: Sequence[torch.nn.Module],
                 num_inference_steps: int, *, uses_cfg: bool = False, video: bool = False):
        from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

        self._context_class, self._set_context = CacheContext, _set_cache_context
        self.kind = kind
        self.transformers = list(transformers)
        self.num_inference_steps = int(num_inference_steps)
        self.timestep = 1000.0
        self.step_index = -1
        self.sigma: float | None = None
        self.calls = 0
        self.computed = 0
        self._passes: dict[int, int] = {}
        self._added: list[tuple[torch.nn.Module, list[str]]] = []
        self._wrapped: list[tuple[Any, Any, Any]] = []
        self._handles: list[Any] = []
        self._mixin: list[torch.nn.Module] = []
        config = build_cache_config(kind, config_fields, num_inference_steps, lambda: self.timestep,
                                    uses_cfg=uses_cfg, video=video)
        try:
            for transformer in self.transformers:
                before = _hook_names(transformer)
                if hasattr(transformer, "enable_cache") and hasattr(transformer, "disable_cache"):
                    transformer.enable_cache(config)  # CacheMixin
                    self._mixin.append(transformer)
                else:
                    import diffusers.hooks

                    getattr(diffusers.hooks, CACHE_CONFIG_CLASSES[kind][1])(transformer, config)
                    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
                for key, (sub, names) in _hook_names(transformer).items():
                    added = sorted(names - before.get(key, (None, set()))[1])
                    if added and transformer not in self._mixin:
                        self._added.append((sub, added))
                    if added and sub is not transformer:  # the root's own hook (FasterCache's) always computes
                        self._count(sub._diffusers_hook, added)
                self._handles.append(transformer.register_forward_pre_hook(self._pre_call))
        except BaseException:
            self.close()
            raise

    def _count(self, registry: Any, names: list[str]) -> None:
        """Count each call of the hooked module and each call of the forward the hooks fall back to (a
        computation)."""
        refs = [registry._fn_refs[registry._hook_order.index(n)] for n in names]
        refs = [r for r in refs if r.original_forward is not None]
        if not refs:
            return
        innermost, outermost = refs[0], refs[-1]
        original, hooked = innermost.original_forward, outermost.forward

        def computed(*args, **kwargs):
            self.computed += 1
            return original(*args, **kwargs)

        def called(*args, **kwargs):
            self.calls += 1
            return hooked(*args, **kwargs)

        innermost.original_forward, outermost.forward = computed, called
        self._wrapped.append((innermost, "original_forward", original))
        self._wrapped.append((outermost, "forward", hooked))

    def _pre_call(self, module: torch.nn.Module, args: Any) -> None:
        """Each transformer call's cache context: its name counts the calls of the current step."""
        k = self._passes.get(id(module), 0)
        self._passes[id(module)] = k + 1
        self._set_context(module, self._context_class(
            f"pass{k}", step_index=self.step_index, num_inference_steps=self.num_inference_steps,
            timestep=self.timestep, sigma=self.sigma))

    def step(self, timestep: float, sigma: float | None = None) -> None:
        """The next denoising step starts at ``timestep`` (the scheduler's 0-1000 scale) and noise level ``sigma``."""
        self.step_index += 1
        self.timestep = float(timestep)
        self.sigma = None if sigma is None else float(sigma)
        self._passes.clear()

    @property
    def skipped_fraction(self) -> float:
        """1 - computed / called over the hooked modules (0 before any call)."""
        return 1.0 - self.computed / self.calls if self.calls else 0.0

    def close(self) -> None:
        """Remove every hook this trajectory added (the model is as it was)."""
        from diffusers.hooks.hooks import HookRegistry

        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for ref, attribute, value in reversed(self._wrapped):
            setattr(ref, attribute, value)
        self._wrapped.clear()
        for transformer in self._mixin:
            if transformer.is_cache_enabled:
                transformer.disable_cache()
        self._mixin.clear()
        for sub, names in self._added:
            for name in reversed(names):
                sub._diffusers_hook.remove_hook(name, recurse=False)
        self._added.clear()
        for transformer in self.transformers:
            if hasattr(transformer, "_diffusers_hook"):
                self._set_context(transformer, None)
                HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()


class RolloutCache:
    """``rollout_cache`` of a run: `trajectory` puts fresh hooks on the transformers for one denoising loop; the
    counts of every trajectory since the last `take_skipped_fraction` make the logged fraction.

    Args:
        kind: one of `ROLLOUT_CACHES` other than ``"none"``.
        config_fields: ``rollout_cache_config`` (checked by `check_rollout_cache_fields`).
        transformers: the diffusers transformers that sample (``adapter.transformers()``: not the peft wrapper, whose
            module names diffusers' block patterns do not match).
        video: the family samples videos (FasterCache's default ``tensor_format``).
    """

    def __init__(self, kind: str, config_fields: dict[str, Any], transformers: Sequence[torch.nn.Module],
                 video: bool = False):
        if kind not in CACHE_CONFIG_CLASSES:
            raise ValueError(f"rollout_cache={kind!r} is not valid; choose one of {', '.join(ROLLOUT_CACHES)}.")
        self.kind = kind
        self.config_fields = dict(config_fields)
        self.transformers = list(transformers)
        self.video = video
        self._calls = 0
        self._computed = 0

    @contextmanager
    def trajectory(self, num_inference_steps: int, uses_cfg: bool = False) -> Iterator[CacheSteps]:
        """The hooks for one denoising loop of ``num_inference_steps`` steps (``uses_cfg``: with classifier-free
        guidance); removed when the block ends."""
        steps = CacheSteps(self.kind, self.config_fields, self.transformers, num_inference_steps,
                           uses_cfg=uses_cfg, video=self.video)
        try:
            yield steps
        finally:
            steps.close()
            self._calls += steps.calls
            self._computed += steps.computed

    def take_counts(self) -> tuple[int, int]:
        """(calls, computations) of the hooked modules since the last call, then reset: the skipped fraction is
        1 - computations / calls."""
        counts = (self._calls, self._computed)
        self._calls = self._computed = 0
        return counts
