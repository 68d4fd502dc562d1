"""Tiny random reward models in the official checkpoint layouts, made offline, for tests.

* ImageReward: a BLIP ViT (width 128, 2 blocks, 2 heads, patch 16 at 224 px) and a med BERT with cross-attention
  (width 32, 2 layers) plus the MLP head, saved as the official ``ImageReward`` module's state dict
  (``blip.visual_encoder.*``, ``blip.text_encoder.*`` with ``embeddings.position_ids``, ``blip.vision_proj.*``,
  ``blip.text_proj.*``, ``mlp.layers.*``) in ``ImageReward.pt``, with its ``med_config.json`` and a BERT WordPiece
  tokenizer folder built here.
* HPS v2: an open_clip ViT-H-14-shaped CLIP (patch 14 at 224 px, GELU, tiny widths), its state dict in half
  precision under ``state_dict`` in a ``.pt`` file (open_clip names: ``visual.conv1.weight``, ``visual.proj``,
  ``transformer.resblocks.*.attn.in_proj_weight``, ``text_projection``, ``logit_scale`` ...), with a CLIP tokenizer
  folder (``vocab.json``, ``merges.txt``) from `flowgrpo.testing.tiny_tokenizers`.

Every weight is drawn from a seeded generator (LayerNorm gains around 1), so scores vary with the image and prompt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TINY_IMAGEREWARD_MED_CONFIG", "randomize_", "save_tiny_hpsv2", "save_tiny_imagereward",
           "write_bert_tokenizer"]

_BERT_WORDS = (
    "a an the of on in with and photo painting cat dog red blue green yellow apple car tree house sky sun moon "
    "sitting next to under over two three big small astronaut horse riding city night bird flying field flower"
).split()

TINY_IMAGEREWARD_MED_CONFIG = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 37,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 64,
    "model_type": "bert",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 0,  # set to the tokenizer's size (+ [DEC], [ENC]) when written
    "encoder_width": 768,
    "add_cross_attention": True,
}


def randomize_(module: Any, seed: int, scale: float = 0.05) -> Any:
    """Draw every parameter of ``module`` again from a seeded normal (LayerNorm weights ``1 + scale * N``)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * scale
            if p.ndim == 1 and ("norm" in name.lower() or name.endswith("ln_1.weight") or ".ln_" in name) \
                    and name.endswith("weight"):
                noise = noise + 1.0
            p.copy_(noise.to(p.dtype))
    return module


def write_bert_tokenizer(folder: str | os.PathLike[str]) -> Path:
    """A lower-casing BERT WordPiece tokenizer (``vocab.txt`` of the BERT specials, letters, digits, ``##`` pieces
    and a few words), saved with ``save_pretrained`` into ``folder``."""
    import string

    from transformers import BertTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += list(string.ascii_lowercase) + list(string.digits) + list(".,!?'\"-")
    tokens += ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens += [w for w in _BERT_WORDS if w not in tokens]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def save_tiny_imagereward(folder: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Write a tiny random ImageReward in the official layout; returns the paths of ``checkpoint`` (the ``.pt``),
    ``med_config`` (json) and ``tokenizer`` (folder)."""
    import torch

    from ..rewards.imagereward import build_imagereward_model, load_imagereward_tokenizer, ours_to_official

    folder = Path(folder)
    tokenizer_dir = write_bert_tokenizer(folder / "tokenizer")
    med = dict(TINY_IMAGEREWARD_MED_CONFIG)
    med["vocab_size"] = len(load_imagereward_tokenizer(tokenizer_dir))
    (folder / "med_config.json").write_text(json.dumps(med, indent=2))
    vision_width = 128
    model = build_imagereward_model(med, vision_width=vision_width, vision_layers=2, vision_heads=2,
                                    vision_intermediate=160, mlp_sizes=[med["hidden_size"], 24, 16, 8, 4, 1])
    randomize_(model, seed)
    randomize_(model.mlp, seed + 2, scale=0.6)  # a head with gain, so that scores spread visibly
    state = ours_to_official(model.state_dict())
    generator = torch.Generator().manual_seed(seed + 1)
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(med["max_position_embeddings"]).expand(1, -1)
    state["blip.vision_proj.weight"] = torch.randn(16, vision_width, generator=generator)
    state["blip.vision_proj.bias"] = torch.randn(16, generator=generator)
    state["blip.text_proj.weight"] = torch.randn(16, med["hidden_size"], generator=generator)
    state["blip.text_proj.bias"] = torch.randn(16, generator=generator)
    checkpoint = folder / "ImageReward.pt"
    torch.save(state, checkpoint)
    return {"checkpoint": checkpoint, "med_config": folder / "med_config.json", "tokenizer": tokenizer_dir,
            "folder": folder}


def save_tiny_hpsv2(folder: str | os.PathLike[str], seed: int = 0, filename: str = "HPS_v2.1_compressed.pt"
                    ) -> dict[str, Path]:
    """Write a tiny random open_clip CLIP shaped like ViT-H-14 (patch 14 at 224 px, tiny widths) as an HPS
    checkpoint (half-precision state dict under ``state_dict``); returns ``checkpoint`` and ``tokenizer`` paths."""
    import torch

    from ..rewards.hpsv2 import build_hps_clip, byte_to_unicode, ours_to_open_clip
    from .tiny_tokenizers import clip_vocab_and_merges

    folder = Path(folder)
    tokenizer_dir = folder / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    _, merges = clip_vocab_and_merges()
    # open_clip's vocabulary construction: bytes, bytes + "</w>", one token per merge (a repeated token keeps its
    # last id), then the start and end tokens
    symbols = list(byte_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = dict(zip(tokens, range(len(tokens))))
    (tokenizer_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tokenizer_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    # head widths as ViT-H-14's (80 in the ViT, 64 in the text tower), which the loader assumes
    model = build_hps_clip(vision_width=160, vision_layers=2, vision_heads=2, text_width=128, text_layers=2,
                           text_heads=2, embed_dim=24, vocab_size=len(tokens))
    randomize_(model, seed)
    state = ours_to_open_clip(model.state_dict())
    state = {k: v.half() for k, v in state.items()}
    checkpoint = folder / filename
    torch.save({"state_dict": state}, checkpoint)
    return {"checkpoint": checkpoint, "tokenizer": tokenizer_dir, "folder": folder}
