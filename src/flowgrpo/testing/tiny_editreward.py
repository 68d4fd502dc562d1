"""A tiny random EditReward checkpoint in the official layout, built offline.

The base model is the tiny Qwen2.5-VL of :mod:`flowgrpo.testing.tiny_vlms` (its config, tokenizer and image processor);
the checkpoint is ``model.pth``, a ``torch.save`` of the reward model's full state dict as the official trainer writes
it: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` (rows for the tokenizer plus ``<|Reward|>``) and
the two heads ``rm_heads.head_{0,1}.{0,3,5}.*`` (Linear(32, 1024) -> ReLU -> Dropout -> Linear(1024, 16) -> ReLU ->
Linear(16, 2)). The heads are drawn with std 0.5 so that different inputs score visibly differently.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["save_tiny_editreward"]


def save_tiny_editreward(folder: str | os.PathLike[str], seed: int = 0,
                         base: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Write ``model.pth`` into ``folder``; returns ``{"base": the Qwen2.5-VL folder, "checkpoint": folder}``.

    ``base`` defaults to the cached tiny Qwen2.5-VL (built on first use).
    """
    import torch
    from transformers import AutoConfig

    from ..rewards.editreward import EDITREWARD_REWARD_TOKEN, build_editreward_model
    from ..rewards.vlm_models import load_vlm_processor
    from .seeding import seeded_component
    from .tiny_vlms import cached_tiny_vlm_path

    base = Path(base) if base is not None else cached_tiny_vlm_path("qwen2_5_vl")
    tokenizer = load_vlm_processor(str(base)).tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": [EDITREWARD_REWARD_TOKEN]})
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = len(tokenizer)
    with seeded_component(seed, 71):
        model = build_editreward_model(config, tokenizer.convert_tokens_to_ids(EDITREWARD_REWARD_TOKEN))
        for param in model.rm_heads.parameters():
            torch.nn.init.normal_(param, std=0.5)
        lm_head = torch.randn(len(tokenizer), config.text_config.hidden_size) * 0.02
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = lm_head
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "model.pth")
    return {"base": base, "checkpoint": folder}
