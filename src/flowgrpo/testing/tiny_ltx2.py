"""A tiny random-weight LTX-2 pipeline (:class:`~diffusers.LTX2Pipeline`, video with its audio stream), built offline.

* ``tokenizer`` ``GemmaTokenizer`` on a locally made character-level vocabulary (Gemma's special tokens, the
  SentencePiece word marker and the printable ASCII characters, no merges): every prompt tokenises without unknowns.
* ``text_encoder`` ``Gemma3ForConditionalGeneration``: text width 32, 2 layers (the pipeline stacks all 3 hidden
  states), a 1-layer SigLIP vision tower that the text-to-video pipeline never calls.
* ``connectors`` ``LTX2TextConnectors``: one layer per stream (4 heads of 8), no learnable registers.
* ``transformer`` ``LTX2VideoTransformer3DModel``: 1 block; video 2 heads of 8, audio 2 heads of 4; 4 latent channels
  in both streams; patch size 1.
* ``vae`` ``AutoencoderKLLTX2Video``: one level (2x in space and time: ``num_frames = 2k + 1``), 4 latent channels;
  ``audio_vae`` ``AutoencoderKLLTX2Audio`` (8 mel bins, 2 latent channels) and ``vocoder`` ``LTX2Vocoder`` (16 kHz).
* ``scheduler`` ``FlowMatchEulerDiscreteScheduler`` with LTX-2's dynamic shift (``base_shift`` 0.95, ``max_shift``
  2.05 between 1024 and 4096 video tokens).

Nine 32 px frames (5 latent frames of 16 x 16) and their audio take well under a second per step on one CPU core.
"""

from __future__ import annotations

import string

from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

from .seeding import seeded_component

__all__ = ["LTX2_CONFIGS", "build_gemma_tokenizer", "build_tiny_ltx2"]

_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                   "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_GEMMA3_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 256, "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"]}
_GEMMA3_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}
_LTX2_TRANSFORMER = {"in_channels": 4, "out_channels": 4, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 2,
                     "attention_head_dim": 8, "cross_attention_dim": 16, "audio_in_channels": 4,
                     "audio_out_channels": 4, "audio_num_attention_heads": 2, "audio_attention_head_dim": 4,
                     "audio_cross_attention_dim": 8, "num_layers": 1, "qk_norm": "rms_norm_across_heads",
                     "caption_channels": _GEMMA3_TEXT["hidden_size"], "rope_double_precision": False,
                     "rope_type": "split"}
_LTX2_CONNECTORS = {"caption_channels": _GEMMA3_TEXT["hidden_size"],
                    "text_proj_in_factor": _GEMMA3_TEXT["num_hidden_layers"] + 1,
                    "video_connector_num_attention_heads": 4, "video_connector_attention_head_dim": 8,
                    "video_connector_num_layers": 1, "video_connector_num_learnable_registers": None,
                    "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 8,
                    "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": None,
                    "connector_rope_base_seq_len": 32, "rope_theta": 10000.0, "rope_double_precision": False,
                    "causal_temporal_positioning": False, "rope_type": "split"}
_LTX2_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8,),
             "decoder_block_out_channels": (8,), "layers_per_block": (1,), "decoder_layers_per_block": (1, 1),
             "spatio_temporal_scaling": (True,), "decoder_spatio_temporal_scaling": (True,),
             "decoder_inject_noise": (False, False), "downsample_type": ("spatial",), "upsample_residual": (False,),
             "upsample_factor": (1,), "timestep_conditioning": False, "patch_size": 1, "patch_size_t": 1,
             "encoder_causal": True, "decoder_causal": False}
_LTX2_AUDIO_VAE = {"base_channels": 4, "output_channels": 2, "ch_mult": (1,), "num_res_blocks": 1,
                   "attn_resolutions": None, "in_channels": 2, "resolution": 32, "latent_channels": 2,
                   "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0, "mid_block_add_attention": False,
                   "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True, "mel_bins": 8}
_LTX2_VOCODER = {"in_channels": 2 * 8, "hidden_channels": 32, "out_channels": 2, "upsample_kernel_sizes": [4, 4],
                 "upsample_factors": [2, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]],
                 "leaky_relu_negative_slope": 0.1, "output_sampling_rate": 16000}
_LTX2_SCHEDULER = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
                   "max_image_seq_len": 4096}

#: Every architecture setting (feeds the cache fingerprint).
LTX2_CONFIGS = [_GEMMA_SPECIALS, _GEMMA3_TEXT, _GEMMA3_VISION, _LTX2_TRANSFORMER, _LTX2_CONNECTORS, _LTX2_VAE,
                _LTX2_AUDIO_VAE, _LTX2_VOCODER, _LTX2_SCHEDULER]


def build_gemma_tokenizer() -> GemmaTokenizer:
    """A character-level ``GemmaTokenizer``: Gemma's special tokens, the word marker and printable ASCII."""
    chars = ["\u2581", *string.ascii_letters, *string.digits, *string.punctuation]
    vocab = {token: i for i, token in enumerate([*_GEMMA_SPECIALS, *chars])}
    return GemmaTokenizer(vocab=vocab, merges=[])


def build_tiny_ltx2(seed: int) -> LTX2Pipeline:
    """The tiny ``LTX2Pipeline`` (see the module docstring)."""
    tokenizer = build_gemma_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")}
    config = Gemma3Config(text_config=dict(_GEMMA3_TEXT, vocab_size=len(tokenizer)), vision_config=dict(_GEMMA3_VISION),
                          mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    with seeded_component(seed, 41):
        text_encoder = Gemma3ForConditionalGeneration(config).eval()
    with seeded_component(seed, 42):
        transformer = LTX2VideoTransformer3DModel(**_LTX2_TRANSFORMER).eval()
    with seeded_component(seed, 43):
        connectors = LTX2TextConnectors(**_LTX2_CONNECTORS).eval()
    with seeded_component(seed, 44):
        vae = AutoencoderKLLTX2Video(**_LTX2_VAE).eval()
    with seeded_component(seed, 45):
        audio_vae = AutoencoderKLLTX2Audio(**_LTX2_AUDIO_VAE).eval()
    with seeded_component(seed, 46):
        vocoder = LTX2Vocoder(**_LTX2_VOCODER).eval()
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**_LTX2_SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder)
