"""A tiny random CLAP (transformers' ``ClapModel``) in the layout of ``laion/larger_clap_general``, built offline.

The model: a RoBERTa text tower (width 32, 2 layers, 2 heads) over a RoBERTa byte-level BPE tokenizer learned here
(the Qwen2 merges of :mod:`flowgrpo.testing.tiny_tokenizers` with RoBERTa's special tokens), and an HTSAT audio
tower (spectrogram image 256 x 256 from 64 mel bins, as the real model, patch 4, window 8, two stages of one block, width 16), both
projected to 16 dimensions; no fusion, as ``larger_clap_general``.

The feature extractor is saved with the settings of ``laion/larger_clap_general``'s ``preprocessor_config.json``
(read from a mirror of the repository's file at revision ``ada0c23a``): 48 kHz, 64 mel bins, FFT 1024, hop 480,
50-14000 Hz, 10 s (480000 samples), padding ``repeatpad``, truncation ``rand_trunc``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["LARGER_CLAP_GENERAL_FEATURES", "build_roberta_tokenizer", "save_tiny_clap"]

#: ``laion/larger_clap_general``'s feature-extractor settings (its preprocessor_config.json)
LARGER_CLAP_GENERAL_FEATURES = {
    "chunk_length_s": 10,
    "feature_size": 64,
    "fft_window_size": 1024,
    "frequency_max": 14000,
    "frequency_min": 50,
    "hop_length": 480,
    "max_length_s": 10,
    "padding": "repeatpad",
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": False,
    "sampling_rate": 48000,
    "top_db": None,
    "truncation": "rand_trunc",
}

_ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def build_roberta_tokenizer() -> Any:
    """A ``RobertaTokenizer`` (byte-level BPE) over the locally learned Qwen2 merges, with RoBERTa's special tokens
    ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3 and ``<mask>`` last."""
    from transformers import RobertaTokenizer

    from .tiny_tokenizers import qwen2_vocab_and_merges

    base, merges = qwen2_vocab_and_merges()
    vocab = {token: i for i, token in enumerate(_ROBERTA_SPECIALS)}
    for token in base:
        vocab.setdefault(token, len(vocab))
    vocab["<mask>"] = len(vocab)
    return RobertaTokenizer(vocab=vocab, merges=list(merges), model_max_length=77)


def save_tiny_clap(folder: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build the tiny CLAP and save it as a hub repository holds one (model, tokenizer, feature extractor); returns
    the folder."""
    from transformers import ClapAudioConfig, ClapConfig, ClapFeatureExtractor, ClapModel, ClapTextConfig

    from .seeding import seeded_component

    folder = Path(folder)
    tokenizer = build_roberta_tokenizer()
    text = ClapTextConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=37, max_position_embeddings=80, pad_token_id=1, bos_token_id=0,
                          eos_token_id=2, projection_dim=16)
    audio = ClapAudioConfig(spec_size=256, num_mel_bins=64, patch_size=4, patch_stride=(4, 4), window_size=8,
                            depths=[1, 1], num_attention_heads=[2, 2], patch_embeds_hidden_size=16, hidden_size=32,
                            projection_dim=16, enable_fusion=False)
    config = ClapConfig(text_config=text.to_dict(), audio_config=audio.to_dict(), projection_dim=16)
    with seeded_component(seed, 61):
        model = ClapModel(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    ClapFeatureExtractor(**LARGER_CLAP_GENERAL_FEATURES).save_pretrained(folder)
    return folder
