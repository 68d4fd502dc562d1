"""Quantized base transformers for LoRA training on one consumer GPU (bitsandbytes through diffusers)."""

from __future__ import annotations

import torch


def build_quantization_config(kind: str, compute_dtype: torch.dtype):
    """diffusers ``BitsAndBytesConfig`` for ``kind`` = '4bit' (NF4, double quantization) or '8bit' (LLM.int8)."""
    from diffusers import BitsAndBytesConfig

    if kind == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype)
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"quantization={kind!r}; choose '4bit' or '8bit'.")
