"""The checks of ``torch_compile`` and ``rollout_cache`` (``OnlineRLConfig``'s "compiled blocks and cached rollouts"
section) against the algorithm, the model family and the launch, run by the trainer before anything is loaded.
Standard library only: configurations import without torch or diffusers.

* ``rollout_cache`` is refused for an algorithm whose loss reads the rollout's recorded transition log-probs or means
  (`RolloutRecord.loss_reads_log_probs`, a fact of its spec): a cached rollout's log-probs are those of the cached
  computation, not the policy's, so the first pass's ratio would no longer be 1. It is refused with
  ``base_model_tail_steps`` (the reference's steps would share the policy's cached states), and on the families where
  diffusers' hook does not run (`UNSUPPORTED`, measured by ``scripts/rollout_cache_table.py``).
* ``torch_compile`` is refused under FSDP and DeepSpeed ZeRO-3, which gather each block's weights in hooks around its
  forward: the blocks are compiled when the policy is built, before the launch wraps them, and a compiled region
  traced before the wrapping has not been shown to keep those gathers right. It is refused with ``rollout_cache``:
  the cache's hooks, put on the blocks for each rollout, make them compile again at every rollout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .json_setting import decode_json_setting

__all__ = ["ROLLOUT_CACHES", "UNSUPPORTED", "CacheRefusal", "check_speed_settings", "parse_rollout_cache_config",
           "rollout_cache_refusal", "sharded_launch", "torch_compile_refusal"]

#: the values of ``rollout_cache``
ROLLOUT_CACHES = ("none", "first_block", "taylorseer", "mag", "faster", "pab")

@dataclass(frozen=True)
class CacheRefusal:
    """Why a cache does not run on a family: ``reason``; ``with_guidance_only``: only when the rollouts use
    classifier-free guidance; ``unless_given``: not when ``rollout_cache_config`` sets one of these fields."""

    reason: str
    with_guidance_only: bool = False
    unless_given: tuple[str, ...] = ()


_FBC_FAILS = "diffusers' FirstBlockCache hook fails on its transformer ({})."
_MAG_FAILS = "diffusers' MagCache hook fails on its transformer ({})."
_NOT_REGISTERED = "its blocks are not in diffusers' registry of transformer blocks"
_TWO_PASSES = ("its classifier-free guidance calls the transformer twice per step (conditional, then unconditional), "
               "and {} keeps one cached state per layer for both calls (the run fails, or mixes the two).")
_TAYLORSEER_PATTERNS = ("diffusers' default TaylorSeer patterns (modules named '<blocks>.N.attn') match none of its "
                        "layers, so nothing would be skipped: give rollout_cache_config {cache_identifiers: [...]} "
                        r"(e.g. 'blocks\.\d+\.attn\d' for Wan).")

#: (rollout_cache, family) -> why diffusers' hook does not run on that family's transformer: measured through the
#: rollout engine on the tiny pipeline of every family, with and without guidance (``scripts/rollout_cache_table.py``;
#: the table with the skipped fractions is in docs/benchmarks.md ("Cached rollouts"))
UNSUPPORTED: dict[tuple[str, str], CacheRefusal] = {
    ("first_block", "sd3"): CacheRefusal(_FBC_FAILS.format("its last block returns no encoder states")),
    ("first_block", "flux2"): CacheRefusal(_FBC_FAILS.format("its blocks return their encoder states as a list")),
    ("first_block", "flux2_klein"): CacheRefusal(_FBC_FAILS.format("its blocks return their encoder states as a "
                                                                    "list")),
    ("first_block", "zimage"): CacheRefusal(_FBC_FAILS.format("it finds no block output to cache")),
    ("first_block", "qwenimage21"): CacheRefusal(_FBC_FAILS.format(_NOT_REGISTERED)),
    ("first_block", "ltx2"): CacheRefusal(_FBC_FAILS.format("it finds no block output to cache")),
    ("first_block", "hunyuanvideo15"): CacheRefusal(_FBC_FAILS.format("it finds no block output to cache")),
    ("taylorseer", "wan"): CacheRefusal(_TAYLORSEER_PATTERNS, unless_given=("cache_identifiers",
                                                                            "skip_predict_identifiers")),
    ("taylorseer", "wan_i2v"): CacheRefusal(_TAYLORSEER_PATTERNS, unless_given=("cache_identifiers",
                                                                                "skip_predict_identifiers")),
    ("taylorseer", "zimage"): CacheRefusal(_TAYLORSEER_PATTERNS, unless_given=("cache_identifiers",
                                                                               "skip_predict_identifiers")),
    ("mag", "zimage"): CacheRefusal(_MAG_FAILS.format("its blocks take no hidden_states argument")),
    ("mag", "qwenimage21"): CacheRefusal(_MAG_FAILS.format(_NOT_REGISTERED)),
    ("mag", "ltx2"): CacheRefusal(_MAG_FAILS.format(_NOT_REGISTERED)),
    ("mag", "hunyuanvideo15"): CacheRefusal(_MAG_FAILS.format(_NOT_REGISTERED)),
    ("faster", "zimage"): CacheRefusal("diffusers' FasterCache reads the latents as one tensor; Z-Image's "
                                       "transformer takes a list of them."),
    **{("faster", family): CacheRefusal("diffusers' FasterCache splits the batch into its unconditional and "
                                        "conditional halves, and this family's guided call does not have the "
                                        "layout it expects (the hook fails).", with_guidance_only=True)
       for family in ("sd3", "wan_i2v", "ltx2")},
    **{("faster", family): CacheRefusal(_TWO_PASSES.format("FasterCache"), with_guidance_only=True)
       for family in ("qwenimage", "qwenimage_edit", "qwenimage_edit_plus", "qwenimage21", "flux2_klein")},
    **{("pab", family): CacheRefusal(_TWO_PASSES.format("Pyramid Attention Broadcast"), with_guidance_only=True)
       for family in ("qwenimage", "qwenimage_edit", "qwenimage_edit_plus", "qwenimage21", "flux2_klein")},
}


def parse_rollout_cache_config(value: Any) -> dict[str, Any]:
    """``rollout_cache_config`` as a dict: None -> {}, a JSON string (the command line) -> its object."""
    if value is None or value == "":
        return {}
    value = decode_json_setting(value, "rollout_cache_config", "give an object of the diffusers cache configuration's "
                                'fields, e.g. \'{"cache_interval": 4}\'.')
    if not isinstance(value, dict):
        raise ValueError(f"rollout_cache_config={value!r} must be a mapping of the diffusers cache configuration's "
                         "fields to values, e.g. {cache_interval: 4}.")
    return {str(k): v for k, v in value.items()}


def rollout_cache_refusal(kind: str, family: str, uses_cfg: bool, fields: dict[str, Any] | None = None
                          ) -> str | None:
    """Why ``rollout_cache: kind`` with ``rollout_cache_config`` ``fields`` cannot run on ``family`` (``uses_cfg``:
    the rollouts use classifier-free guidance), or None."""
    refusal = None if kind == "none" else UNSUPPORTED.get((kind, family))
    if refusal is None or (refusal.with_guidance_only and not uses_cfg):
        return None
    if any((fields or {}).get(name) for name in refusal.unless_given):
        return None
    return refusal.reason


def _true(value: str | None) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes")


def sharded_launch(args: Any) -> str | None:
    """``"FSDP"`` or ``"DeepSpeed ZeRO-3"`` when this launch shards the weights in hooks around each block's forward
    (from the configuration and the environment ``accelerate launch`` sets), else None."""
    if getattr(args, "fsdp", None) or _true(os.environ.get("ACCELERATE_USE_FSDP")):
        return "FSDP"
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    deepspeed = getattr(args, "deepspeed", None)
    if deepspeed and stage is None:
        config = deepspeed
        if isinstance(config, str) and os.path.isfile(config):
            with open(config) as handle:
                config = json.load(handle)
        if isinstance(config, dict):
            stage = (config.get("zero_optimization") or {}).get("stage")
    if (deepspeed or _true(os.environ.get("ACCELERATE_USE_DEEPSPEED"))) and str(stage) == "3":
        return "DeepSpeed ZeRO-3"
    return None


def torch_compile_refusal(sharded: str) -> str:
    """Why ``torch_compile`` is refused under ``sharded`` (``"FSDP"``, ``"DeepSpeed ZeRO-3"``)."""
    return (f"torch_compile=True with {sharded}: the transformer's blocks are compiled when the policy is built, "
            f"before {sharded} wraps them with the hooks that gather each block's weights around its forward, and a "
            "block compiled before that wrapping is not known to keep those gathers right. Launch with DDP (or "
            "DeepSpeed ZeRO-2), or set torch_compile: false.")


def check_speed_settings(args: Any, facts: Any, family: str | None, uses_cfg: bool,
                         algorithm: str = "this algorithm") -> None:
    """Refuse ``torch_compile`` and ``rollout_cache`` where they cannot give the run's own results (module
    docstring). ``facts``: the algorithm's `AlgorithmFacts`; ``family``: the model family (None when not known
    yet); ``uses_cfg``: whether the rollouts use classifier-free guidance."""
    split = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if getattr(args, "torch_compile", False):
        sharded = sharded_launch(args)
        if sharded is not None:
            raise ValueError(torch_compile_refusal(sharded))
        if split > 1:
            raise ValueError(f"torch_compile=True with sequence_parallel_size={split}: the split attention's all-to-all "
                             "collectives inside the compiled blocks have not been run; use one of the two.")
    kind = getattr(args, "rollout_cache", "none")
    if kind == "none":
        return
    if split > 1:
        raise ValueError(f"rollout_cache={kind!r} with sequence_parallel_size={split}: the cache hooks would keep "
                         "each process's shard of a block's output, which has not been run with split tokens; use "
                         "one of the two.")
    if getattr(args, "torch_compile", False):
        raise ValueError(f"torch_compile=True with rollout_cache={kind!r}: the cache's hooks go onto the compiled "
                         "blocks for every rollout and decide in Python at each step whether a block runs, so the "
                         "blocks are compiled again at every rollout (measured on the tiny SD3 with pab: 12 new "
                         "graphs per step) until torch's recompile limit stops the run. Use one of the two.")
    if facts.record.kind == "prompts":
        raise ValueError(f"rollout_cache={kind!r} with {algorithm}: its rollout runs inside its loss, with gradient "
                         "through the sampler, so a cache would differentiate skipped or extrapolated block outputs "
                         "instead of the policy's. Set rollout_cache: none.")
    if facts.record.loss_reads_log_probs:
        raise ValueError(f"rollout_cache={kind!r} with {algorithm}: its loss reads the rollout's recorded transition "
                         "log-probs (the clipped ratio's denominator). A cached rollout's log-probs are those of the "
                         "cached computation, not the policy's, so the ratio would no longer be 1 on-policy. Set "
                         "rollout_cache: none, or use an algorithm whose loss reads only the rollout's samples "
                         "(DiffusionNFT, AWM, DGPO, CRD, online DPO, on-policy distillation).")
    if getattr(args, "base_model_tail_steps", 0):
        raise ValueError(f"rollout_cache={kind!r} with base_model_tail_steps={args.base_model_tail_steps}: the "
                         "reference's tail steps would read and overwrite the policy's cached states. Set one of "
                         "them off.")
    reason = rollout_cache_refusal(kind, family, uses_cfg, args.rollout_cache_config) if family else None
    if reason is not None:
        raise ValueError(f"rollout_cache={kind!r} does not run on the {family} family: {reason} Choose another cache "
                         "(docs/benchmarks.md, 'Cached rollouts', lists which run on each family), or set "
                         "rollout_cache: none.")
