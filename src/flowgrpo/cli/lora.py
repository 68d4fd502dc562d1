"""The LoRA configuration of a run, from :class:`ModelArguments`."""

from __future__ import annotations

from typing import Any

from .arguments import LORA_INITS, ModelArguments
from .parser import RecipeError


def build_peft_config(model_args: ModelArguments) -> Any:
    """A ``peft.LoraConfig`` for the transformer, or ``None`` when ``use_peft`` is false (full fine-tuning).

    Without ``lora_target_modules`` the config names no targets and the trainer, which knows the model family, uses
    the family's default (``ModelFamilyAdapter.default_lora_target_modules``: the attention projections, ``attn1`` /
    ``attn2`` for Wan). ``lora_init`` maps to peft's ``init_lora_weights`` (:data:`LORA_INITS`).
    """
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    init = model_args.lora_init.lower()
    if init not in LORA_INITS:
        raise RecipeError(f"lora_init={model_args.lora_init!r} is not valid; choose one of {list(LORA_INITS)}.")
    targets = list(model_args.lora_target_modules) if model_args.lora_target_modules else None
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        init_lora_weights=LORA_INITS[init],
        target_modules=targets,
    )


__all__ = ["build_peft_config"]
