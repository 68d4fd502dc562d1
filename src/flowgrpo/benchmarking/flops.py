"""Analytic matmul FLOPs of the SD3, FLUX.1, FLUX.2, Z-Image, Qwen-Image, Wan, LTX-2 and HunyuanVideo 1.5 transformers,
from their configs and the token counts.

A forward pass is enumerated layer by layer as the matmuls diffusers runs (``SD3Transformer2DModel``,
``FluxTransformer2DModel``, ``Flux2Transformer2DModel``, ``ZImageTransformer2DModel``, ``QwenImageTransformer2DModel``,
``WanTransformer3DModel``): every ``nn.Linear`` (and the patch-embedding convolution) as ``2 * rows * in * out``
and the attention core as ``4 * tokens_q * tokens_kv * inner_dim`` (Q K^T and A V), per sample. Element-wise work
(norms, activations, RoPE, softmax) is not counted, as is customary for model FLOPs. Per-sample layers (timestep /
pooled-text embeddings, adaLN modulation) have one row per sample; per-token layers one row per token. The editing
families (FLUX.1 Kontext, Qwen-Image-Edit) count their source-image tokens as image tokens (they run through every
image-stream layer); Wan's image tokens are all latent frames' patches ``F' * H/16 * W/16``. LTX-2 has a second,
audio stream: its token count is passed as ``audio_tokens``. HunyuanVideo 1.5's text tokens are its whole joint
context (SigLIP image tokens, ByT5 tokens, Qwen2.5-VL tokens).

LoRA adds ``2 * rows * r * (in + out)`` to each adapted linear; which linears are adapted follows peft's rule for a
list of target names (the module's name equals the target or ends with ``"." + target``) or a regex string (full
match).

A backward pass is counted from what autograd actually runs (:meth:`ForwardFlops.backward`): the attention core
costs twice its forward (dQ, dK and dV); a frozen linear costs once its forward (the input gradient only); a
trained linear (full fine-tuning, or a LoRA branch) twice. Input gradients are left out where autograd skips them.
With a frozen base (LoRA): the embedders, the per-sample adaLN modulation linears (the conditioning vector depends on
no trained weight), the first block's q/k/v projections (they read embedder outputs) and Wan's cross-attention keys
and values (they read the text embedding, which no block changes). With full fine-tuning: only
the layers that read raw model inputs (patch / latent embedding, context embedder, the embedders' first linears).
Families whose module names the shared rules do not fit (LTX-2, HunyuanVideo 1.5) have their own (``_GRADIENT_RULES``):
with LoRA on LTX-2's video stream, the audio stream's first-block layers get no gradient until the video-to-audio
attention; HunyuanVideo 1.5's first double block's text projections read the refined tokens, which the refiner's LoRA
changes. Gradient checkpointing recomputes one more forward.

``tests/tooling/test_benchmark.py`` checks these counts against ``torch.utils.flop_counter.FlopCounterMode`` on the tiny
models and on the full-size architectures (built on the meta device, where nothing is computed).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Matmul",
    "ForwardFlops",
    "StepFlops",
    "transformer_forward_flops",
    "sd3_forward_matmuls",
    "flux_forward_matmuls",
    "flux2_forward_matmuls",
    "zimage_forward_matmuls",
    "qwenimage21_forward_matmuls",
    "qwenimage_forward_matmuls",
    "wan_forward_matmuls",
    "ltx2_forward_matmuls",
    "hunyuanvideo15_forward_matmuls",
    "step_flops",
    "count_flops",
]


@dataclass(frozen=True)
class Matmul:
    """One matmul of a forward pass, per sample.

    ``name`` is the module path for linears (``transformer_blocks.3.attn.to_q``) and ends in ``.sdpa`` for the
    attention core; ``flops`` counts a multiply-add as 2.
    """

    name: str
    flops: int
    rows: int = 0
    in_features: int = 0
    out_features: int = 0
    #: attention cores: the linears whose outputs make the queries, the keys and the values
    sources: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())
    #: the output never reaches the model's output (e.g. Qwen-Image's last text stream): no backward at all
    dead: bool = False

    @property
    def is_linear(self) -> bool:
        return self.in_features > 0


def _linear(name: str, rows: int, in_features: int, out_features: int, dead: bool = False) -> Matmul:
    return Matmul(name, 2 * rows * in_features * out_features, rows, in_features, out_features, dead=dead)


def _attention(name: str, tokens_q: int, tokens_kv: int, inner_dim: int,
               sources: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None) -> Matmul:
    """The attention core ``softmax(Q K^T) V``; ``sources`` default to the module's ``to_q`` / ``to_k`` / ``to_v``
    (joint attention adds the text stream's ``add_*_proj``)."""
    if sources is None:
        sources = ((f"{name}.to_q",), (f"{name}.to_k",), (f"{name}.to_v",))
    return Matmul(f"{name}.sdpa", 4 * tokens_q * tokens_kv * inner_dim, sources=sources)


def _joint(name: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Sources of a joint (image + text) attention: each of Q, K, V concatenates both streams' projections."""
    return tuple((f"{name}.{img}", f"{name}.{txt}") for img, txt in
                 (("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj")))


def _joint_attention(name: str, image_tokens: int, text_tokens: int, dim: int) -> list[Matmul]:
    """An MMDiT block's joint attention up to the image stream's output: the Q, K, V projections of each stream,
    attention over both, and ``to_out.0`` (the text stream's output projection differs between families)."""
    mm = [_linear(f"{name}.{proj}", image_tokens, dim, dim) for proj in ("to_q", "to_k", "to_v")]
    mm += [_linear(f"{name}.{proj}", text_tokens, dim, dim) for proj in ("add_q_proj", "add_k_proj", "add_v_proj")]
    tokens = image_tokens + text_tokens
    mm.append(_attention(name, tokens, tokens, dim, _joint(name)))
    mm.append(_linear(f"{name}.to_out.0", image_tokens, dim, dim))
    return mm


def _cfg(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def sd3_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``SD3Transformer2DModel`` forward for one sample.

    ``image_tokens`` = (latent height / patch) x (latent width / patch); ``text_tokens`` = the length of
    ``encoder_hidden_states`` (77 CLIP tokens + the T5 length for SD3 pipelines).
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    layers = int(_cfg(config, "num_layers"))
    patch = int(_cfg(config, "patch_size", 2))
    c_in = int(_cfg(config, "in_channels", 16))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    caption = int(_cfg(config, "caption_projection_dim", d))
    dual = set(int(i) for i in (_cfg(config, "dual_attention_layers", ()) or ()))
    n_i, n_t = int(image_tokens), int(text_tokens)

    mm = [
        _linear("pos_embed.proj", n_i, c_in * patch * patch, d),
        _linear("time_text_embed.timestep_embedder.linear_1", 1, 256, d),
        _linear("time_text_embed.timestep_embedder.linear_2", 1, d, d),
        _linear("time_text_embed.text_embedder.linear_1", 1, int(_cfg(config, "pooled_projection_dim")), d),
        _linear("time_text_embed.text_embedder.linear_2", 1, d, d),
        _linear("context_embedder", n_t, int(_cfg(config, "joint_attention_dim")), caption),
    ]
    for i in range(layers):
        b = f"transformer_blocks.{i}"
        pre_only = i == layers - 1  # the last block only feeds the text stream into attention
        is_dual = i in dual
        mm.append(_linear(f"{b}.norm1.linear", 1, d, (9 if is_dual else 6) * d))
        mm.append(_linear(f"{b}.norm1_context.linear", 1, d, (2 if pre_only else 6) * d))
        mm += _joint_attention(f"{b}.attn", n_i, n_t, d)
        if not pre_only:
            mm.append(_linear(f"{b}.attn.to_add_out", n_t, d, d))
        if is_dual:
            for proj in ("to_q", "to_k", "to_v"):
                mm.append(_linear(f"{b}.attn2.{proj}", n_i, d, d))
            mm.append(_attention(f"{b}.attn2", n_i, n_i, d))
            mm.append(_linear(f"{b}.attn2.to_out.0", n_i, d, d))
        mm.append(_linear(f"{b}.ff.net.0.proj", n_i, d, 4 * d))
        mm.append(_linear(f"{b}.ff.net.2", n_i, 4 * d, d))
        if not pre_only:
            mm.append(_linear(f"{b}.ff_context.net.0.proj", n_t, d, 4 * d))
            mm.append(_linear(f"{b}.ff_context.net.2", n_t, 4 * d, d))
    mm.append(_linear("norm_out.linear", 1, d, 2 * d))
    mm.append(_linear("proj_out", n_i, d, patch * patch * c_out))
    return mm


def flux_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``FluxTransformer2DModel`` forward for one sample.

    ``image_tokens`` = packed latent sequence length ((H / 16) x (W / 16) for FLUX.1); ``text_tokens`` = the T5
    length.
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch = int(_cfg(config, "patch_size", 1))
    c_in = int(_cfg(config, "in_channels", 64))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    n_i, n_t = int(image_tokens), int(text_tokens)
    n = n_i + n_t
    mlp = 4 * d

    mm = [
        _linear("x_embedder", n_i, c_in, d),
        _linear("context_embedder", n_t, int(_cfg(config, "joint_attention_dim")), d),
        _linear("time_text_embed.timestep_embedder.linear_1", 1, 256, d),
        _linear("time_text_embed.timestep_embedder.linear_2", 1, d, d),
    ]
    if _cfg(config, "guidance_embeds", False):
        mm.append(_linear("time_text_embed.guidance_embedder.linear_1", 1, 256, d))
        mm.append(_linear("time_text_embed.guidance_embedder.linear_2", 1, d, d))
    mm.append(_linear("time_text_embed.text_embedder.linear_1", 1, int(_cfg(config, "pooled_projection_dim")), d))
    mm.append(_linear("time_text_embed.text_embedder.linear_2", 1, d, d))
    for i in range(int(_cfg(config, "num_layers"))):
        b = f"transformer_blocks.{i}"
        last = False  # FLUX's text stream goes on into the single-stream blocks
        mm.append(_linear(f"{b}.norm1.linear", 1, d, 6 * d))
        mm.append(_linear(f"{b}.norm1_context.linear", 1, d, 6 * d))
        mm += _joint_attention(f"{b}.attn", n_i, n_t, d)
        mm.append(_linear(f"{b}.attn.to_add_out", n_t, d, d, dead=last))
        mm.append(_linear(f"{b}.ff.net.0.proj", n_i, d, mlp))
        mm.append(_linear(f"{b}.ff.net.2", n_i, mlp, d))
        mm.append(_linear(f"{b}.ff_context.net.0.proj", n_t, d, mlp))
        mm.append(_linear(f"{b}.ff_context.net.2", n_t, mlp, d))
    for i in range(int(_cfg(config, "num_single_layers"))):
        b = f"single_transformer_blocks.{i}"
        mm.append(_linear(f"{b}.norm.linear", 1, d, 3 * d))
        mm.append(_linear(f"{b}.proj_mlp", n, d, mlp))
        for proj in ("to_q", "to_k", "to_v"):
            mm.append(_linear(f"{b}.attn.{proj}", n, d, d))
        mm.append(_attention(f"{b}.attn", n, n, d))
        mm.append(_linear(f"{b}.proj_out", n, d + mlp, d))
    mm.append(_linear("norm_out.linear", 1, d, 2 * d))
    mm.append(_linear("proj_out", n_i, d, patch * patch * c_out))
    return mm


def flux2_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``Flux2Transformer2DModel`` forward for one sample (FLUX.2 [dev] and [klein]).

    ``image_tokens`` = the packed target sequence ((H / 16) x (W / 16)) plus every reference image's tokens;
    ``text_tokens`` = the padded prompt length (``max_sequence_length``). The modulation is shared by all blocks
    (three per-sample linears), the feed-forwards are SwiGLU (``linear_in`` makes both halves), and each single-stream
    block fuses Q, K, V and the MLP input in ``attn.to_qkv_mlp_proj`` and its outputs in ``attn.to_out``.
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch = int(_cfg(config, "patch_size", 1))
    c_in = int(_cfg(config, "in_channels", 128))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    channels = int(_cfg(config, "timestep_guidance_channels", 256))
    mlp = int(d * float(_cfg(config, "mlp_ratio", 3.0)))
    n_i, n_t = int(image_tokens), int(text_tokens)
    n = n_i + n_t
    mm = [
        _linear("time_guidance_embed.timestep_embedder.linear_1", 1, channels, d),
        _linear("time_guidance_embed.timestep_embedder.linear_2", 1, d, d),
    ]
    if _cfg(config, "guidance_embeds", True):
        mm.append(_linear("time_guidance_embed.guidance_embedder.linear_1", 1, channels, d))
        mm.append(_linear("time_guidance_embed.guidance_embedder.linear_2", 1, d, d))
    mm += [
        _linear("double_stream_modulation_img.linear", 1, d, 6 * d),
        _linear("double_stream_modulation_txt.linear", 1, d, 6 * d),
        _linear("single_stream_modulation.linear", 1, d, 3 * d),
        _linear("x_embedder", n_i, c_in, d),
        _linear("context_embedder", n_t, int(_cfg(config, "joint_attention_dim")), d),
    ]
    for i in range(int(_cfg(config, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mm += _joint_attention(f"{b}.attn", n_i, n_t, d)
        mm.append(_linear(f"{b}.attn.to_add_out", n_t, d, d))
        mm.append(_linear(f"{b}.ff.linear_in", n_i, d, 2 * mlp))
        mm.append(_linear(f"{b}.ff.linear_out", n_i, mlp, d))
        mm.append(_linear(f"{b}.ff_context.linear_in", n_t, d, 2 * mlp))
        mm.append(_linear(f"{b}.ff_context.linear_out", n_t, mlp, d))
    for i in range(int(_cfg(config, "num_single_layers"))):
        b = f"single_transformer_blocks.{i}.attn"
        qkv = (f"{b}.to_qkv_mlp_proj",)
        mm.append(_linear(f"{b}.to_qkv_mlp_proj", n, d, 3 * d + 2 * mlp))
        mm.append(_attention(b, n, n, d, (qkv, qkv, qkv)))
        mm.append(_linear(f"{b}.to_out", n, d + mlp, d))
    mm.append(_linear("norm_out.linear", 1, d, 2 * d))
    mm.append(_linear("proj_out", n_i, d, patch * patch * c_out))
    return mm


def _padded(tokens: int, multiple: int = 32) -> int:
    return tokens + (-tokens) % multiple


def zimage_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``ZImageTransformer2DModel`` forward for one sample (text-to-image).

    ``image_tokens`` = (H / 16) x (W / 16) latent patches; ``text_tokens`` = the prompt's valid tokens. The model pads
    both to multiples of 32 before embedding them; the noise refiners run over the image tokens, the context refiners
    over the text tokens, the main blocks and the final layer over both. Every block's attention has ``dim`` inner
    width (``n_heads x dim / n_heads``); its feed-forward is SwiGLU with hidden ``int(dim / 3 * 8)``.
    """
    d = int(_cfg(config, "dim"))
    heads = int(_cfg(config, "n_heads"))
    kv_dim = int(_cfg(config, "n_kv_heads", heads)) * (d // heads)
    patch = int(list(_cfg(config, "all_patch_size", (2,)))[0])
    f_patch = int(list(_cfg(config, "all_f_patch_size", (1,)))[0])
    c_in = int(_cfg(config, "in_channels", 16))
    adaln = min(d, 256)
    hidden = int(d / 3 * 8)
    n_x, n_c = _padded(int(image_tokens)), _padded(int(text_tokens))
    key = f"{patch}-{f_patch}"

    def block(name: str, rows: int, modulation: bool) -> list[Matmul]:
        mm = [_linear(f"{name}.adaLN_modulation.0", 1, adaln, 4 * d)] if modulation else []
        mm += [_linear(f"{name}.attention.to_q", rows, d, d), _linear(f"{name}.attention.to_k", rows, d, kv_dim),
               _linear(f"{name}.attention.to_v", rows, d, kv_dim)]
        mm.append(_attention(f"{name}.attention", rows, rows, d))
        mm.append(_linear(f"{name}.attention.to_out.0", rows, d, d))
        mm += [_linear(f"{name}.feed_forward.w1", rows, d, hidden), _linear(f"{name}.feed_forward.w3", rows, d, hidden),
               _linear(f"{name}.feed_forward.w2", rows, hidden, d)]
        return mm

    mm = [
        _linear("t_embedder.mlp.0", 1, 256, 1024),
        _linear("t_embedder.mlp.2", 1, 1024, adaln),
        _linear(f"all_x_embedder.{key}", n_x, f_patch * patch * patch * c_in, d),
    ]
    for i in range(int(_cfg(config, "n_refiner_layers", 2))):
        mm += block(f"noise_refiner.{i}", n_x, True)
    mm.append(_linear("cap_embedder.1", n_c, int(_cfg(config, "cap_feat_dim")), d))
    for i in range(int(_cfg(config, "n_refiner_layers", 2))):
        mm += block(f"context_refiner.{i}", n_c, False)
    for i in range(int(_cfg(config, "n_layers"))):
        mm += block(f"layers.{i}", n_x + n_c, True)
    mm.append(_linear(f"all_final_layer.{key}.adaLN_modulation.1", 1, adaln, d))
    mm.append(_linear(f"all_final_layer.{key}.linear", n_x + n_c, d, patch * patch * f_patch * c_in))
    return mm


def qwenimage21_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``QwenImage21Transformer2DModel`` forward for one sample (text-to-image, no KV cache).

    ``image_tokens`` = (H / 16) x (W / 16) latent tokens; ``text_tokens`` = the prompt embedding's length. One joint
    sequence of ``text + image`` tokens runs through every block; attention is block-causal, computed as the
    pipeline's processor does: the text attends to the text (``L x L``), the image to everything (``N x (L + N)``).
    With ``causal_condition`` the per-sample embedding and modulation linears run one extra row (the ``t = 0`` row
    for the text): counted here as two rows per sample, exact for a call of one sample (a call of B samples runs
    B + 1 rows).
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch = int(_cfg(config, "patch_size", 1))
    c_in = int(_cfg(config, "in_channels", 64))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    mlp = d * int(_cfg(config, "mlp_ratio", 3))
    n_i, n_t = int(image_tokens), int(text_tokens)
    n = n_i + n_t
    per_sample = 2 if _cfg(config, "causal_condition", True) else 1
    mm = [
        _linear("img_in", n_i, c_in * patch * patch, d),
        _linear("txt_in.in_layer", n_t, int(_cfg(config, "context_in_dim")), d),
        _linear("txt_in.out_layer", n_t, d, d),
        _linear("time_text_embed.timestep_embedder.linear_1", per_sample, 256, d),
        _linear("time_text_embed.timestep_embedder.linear_2", per_sample, d, d),
        _linear("modulation.1", per_sample, d, 4 * d),
    ]
    for i in range(int(_cfg(config, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mm += [_linear(f"{b}.attn.{proj}", n, d, d) for proj in ("to_q", "to_k", "to_v")]
        mm.append(_attention(f"{b}.attn", n_t, n_t, d))  # the text segment, causal over itself
        mm.append(_attention(f"{b}.attn", n_i, n, d))    # the image block: every earlier token and itself
        mm.append(_linear(f"{b}.attn.to_out.0", n, d, d))
        mm += [_linear(f"{b}.img_mlp.proj", n, d, mlp), _linear(f"{b}.img_mlp.gate_layer", n, d, mlp),
               _linear(f"{b}.img_mlp.out", n, mlp, d)]
    mm.append(_linear("norm_out.linear", per_sample, d, d))
    mm.append(_linear("proj_out", n, d, patch * patch * c_out))
    return mm


def qwenimage_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``QwenImageTransformer2DModel`` forward for one sample.

    ``image_tokens`` = packed latent sequence length ((H / 16) x (W / 16); Qwen-Image-Edit: twice that, target and
    source); ``text_tokens`` = the prompt embedding's length (after the template's system part is dropped).
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch = int(_cfg(config, "patch_size", 2))
    c_in = int(_cfg(config, "in_channels", 64))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    n_i, n_t = int(image_tokens), int(text_tokens)
    mm = [
        _linear("img_in", n_i, c_in, d),
        _linear("txt_in", n_t, int(_cfg(config, "joint_attention_dim")), d),
        _linear("time_text_embed.timestep_embedder.linear_1", 1, 256, d),
        _linear("time_text_embed.timestep_embedder.linear_2", 1, d, d),
    ]
    layers = int(_cfg(config, "num_layers"))
    for i in range(layers):
        b = f"transformer_blocks.{i}"
        last = i == layers - 1  # the last block's text stream is computed but never used
        mm.append(_linear(f"{b}.img_mod.1", 1, d, 6 * d))
        mm.append(_linear(f"{b}.txt_mod.1", 1, d, 6 * d))
        mm += _joint_attention(f"{b}.attn", n_i, n_t, d)
        mm.append(_linear(f"{b}.attn.to_add_out", n_t, d, d, dead=last))
        mm.append(_linear(f"{b}.img_mlp.net.0.proj", n_i, d, 4 * d))
        mm.append(_linear(f"{b}.img_mlp.net.2", n_i, 4 * d, d))
        mm.append(_linear(f"{b}.txt_mlp.net.0.proj", n_t, d, 4 * d, dead=last))
        mm.append(_linear(f"{b}.txt_mlp.net.2", n_t, 4 * d, d, dead=last))
    mm.append(_linear("norm_out.linear", 1, d, 2 * d))
    mm.append(_linear("proj_out", n_i, d, patch * patch * c_out))
    return mm


#: The text length Wan's image-to-video cross-attention assumes (the tokens before it are CLIP image tokens).
WAN_TEXT_CONTEXT = 512


def wan_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int) -> list[Matmul]:
    """The matmuls of one ``WanTransformer3DModel`` forward for one sample (text-to-video, one timestep per sample).

    ``image_tokens`` = F' x (H / 16) x (W / 16) latent patches of all frames; ``text_tokens`` = the (zero-padded)
    UMT5 length, ``max_sequence_length``. The patch embedding is a 3-D convolution counted like a linear over the
    patches. Image-to-video (Wan 2.1 I2V, ``image_dim`` set): ``text_tokens`` is the whole cross-attention context,
    the CLIP image tokens first; as in the model, the last 512 are text and the rest image tokens, which pass the
    image embedder (a two-layer MLP) and get their own keys / values (``attn2.add_k_proj`` / ``add_v_proj``) and
    attention core in every block. The 36 input channels of I2V come from ``in_channels``.
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch = [int(p) for p in _cfg(config, "patch_size", (1, 2, 2))]
    c_in = int(_cfg(config, "in_channels", 16))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    ffn = int(_cfg(config, "ffn_dim"))
    n_i, n_t = int(image_tokens), int(text_tokens)
    image_dim = _cfg(config, "image_dim", None)
    n_clip = 0
    if image_dim is not None:  # Wan 2.1 I2V: CLIP image tokens ahead of the 512 text tokens
        n_clip, n_t = n_t - WAN_TEXT_CONTEXT, WAN_TEXT_CONTEXT
        if n_clip <= 0:
            raise ValueError(f"text_tokens={text_tokens}: a Wan image-to-video context is the CLIP image tokens plus "
                             f"{WAN_TEXT_CONTEXT} text tokens.")
    volume = patch[0] * patch[1] * patch[2]
    mm = [
        _linear("patch_embedding", n_i, c_in * volume, d),
        _linear("condition_embedder.time_embedder.linear_1", 1, int(_cfg(config, "freq_dim", 256)), d),
        _linear("condition_embedder.time_embedder.linear_2", 1, d, d),
        _linear("condition_embedder.time_proj", 1, d, 6 * d),
        _linear("condition_embedder.text_embedder.linear_1", n_t, int(_cfg(config, "text_dim")), d),
        _linear("condition_embedder.text_embedder.linear_2", n_t, d, d),
    ]
    if n_clip:
        mm.append(_linear("condition_embedder.image_embedder.ff.net.0.proj", n_clip, int(image_dim), int(image_dim)))
        mm.append(_linear("condition_embedder.image_embedder.ff.net.2", n_clip, int(image_dim), d))
    for i in range(int(_cfg(config, "num_layers"))):
        b = f"blocks.{i}"
        for proj in ("to_q", "to_k", "to_v"):
            mm.append(_linear(f"{b}.attn1.{proj}", n_i, d, d))
        mm.append(_attention(f"{b}.attn1", n_i, n_i, d))
        mm.append(_linear(f"{b}.attn1.to_out.0", n_i, d, d))
        mm.append(_linear(f"{b}.attn2.to_q", n_i, d, d))
        mm.append(_linear(f"{b}.attn2.to_k", n_t, d, d))
        mm.append(_linear(f"{b}.attn2.to_v", n_t, d, d))
        mm.append(_attention(f"{b}.attn2", n_i, n_t, d))
        if n_clip:
            added = int(_cfg(config, "added_kv_proj_dim"))
            mm.append(_linear(f"{b}.attn2.add_k_proj", n_clip, added, d))
            mm.append(_linear(f"{b}.attn2.add_v_proj", n_clip, added, d))
            mm.append(_attention(f"{b}.attn2_img", n_i, n_clip, d, sources=(
                (f"{b}.attn2.to_q",), (f"{b}.attn2.add_k_proj",), (f"{b}.attn2.add_v_proj",))))
        mm.append(_linear(f"{b}.attn2.to_out.0", n_i, d, d))
        mm.append(_linear(f"{b}.ffn.net.0.proj", n_i, d, ffn))
        mm.append(_linear(f"{b}.ffn.net.2", n_i, ffn, d))
    mm.append(_linear("proj_out", n_i, d, c_out * volume))
    return mm


def _ltx2_attention(name: str, tokens_q: int, tokens_kv: int, query_dim: int, kv_dim: int, inner: int,
                    heads: int, gated: bool) -> list[Matmul]:
    """One ``LTX2Attention``: Q from ``tokens_q`` rows of width ``query_dim``, K / V from ``tokens_kv`` rows of width
    ``kv_dim``, the core at ``inner`` width, ``to_out.0`` back to ``query_dim``; gated attention adds the per-head
    gate logits (``to_gate_logits``) of the query rows."""
    mm = [_linear(f"{name}.to_q", tokens_q, query_dim, inner), _linear(f"{name}.to_k", tokens_kv, kv_dim, inner),
          _linear(f"{name}.to_v", tokens_kv, kv_dim, inner), _attention(name, tokens_q, tokens_kv, inner),
          _linear(f"{name}.to_out.0", tokens_q, inner, query_dim)]
    if gated:
        mm.append(_linear(f"{name}.to_gate_logits", tokens_q, query_dim, heads))
    return mm


def ltx2_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int,
                         audio_tokens: int = 0) -> list[Matmul]:
    """The matmuls of one ``LTX2VideoTransformer3DModel`` forward for one sample (video and audio streams).

    ``image_tokens`` = F' x h x w video latent tokens (patch size 1); ``audio_tokens`` = the audio latent frames;
    ``text_tokens`` = the connectors' context length (the same for both streams). Per sample, each of the six (eight
    with LTX-2.3's prompt modulation) adaLN-single embedders runs its timestep MLP (256 -> dim -> dim) and its
    modulation linear (dim -> k dim). Per block, with video width ``d`` and audio width ``d_a``: video and audio
    self-attention, each stream's text cross-attention (keys / values from the projected caption), audio-to-video
    attention (Q video, K / V audio, at the audio width ``d_a``) and video-to-audio attention (Q audio, K / V video),
    and each stream's GELU feed-forward (4x). Gated attention (LTX-2.3) adds per-head gate logits of the queries.
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    a_heads, a_head_dim = int(_cfg(config, "audio_num_attention_heads")), int(_cfg(config, "audio_attention_head_dim"))
    d, d_a = heads * head_dim, a_heads * a_head_dim
    c_in, a_in = int(_cfg(config, "in_channels", 128)), int(_cfg(config, "audio_in_channels", 128))
    c_out = int(_cfg(config, "out_channels", None) or c_in)
    a_out = int(_cfg(config, "audio_out_channels", None) or a_in)
    caption = int(_cfg(config, "caption_channels"))
    gated, a_gated = bool(_cfg(config, "gated_attn", False)), bool(_cfg(config, "audio_gated_attn", False))
    video_mod = 9 if _cfg(config, "cross_attn_mod", False) else 6
    audio_mod = 9 if _cfg(config, "audio_cross_attn_mod", False) else 6
    prompt_mod = (bool(_cfg(config, "cross_attn_mod", False)) or bool(_cfg(config, "audio_cross_attn_mod", False))) \
        and bool(_cfg(config, "use_prompt_adaln_single", True))
    n_v, n_a, n_t = int(image_tokens), int(audio_tokens), int(text_tokens)
    if n_a <= 0:
        raise ValueError(f"audio_tokens={audio_tokens}: an LTX-2 forward always carries its audio stream; pass the "
                         "audio latent frame count (the adapter's audio_sequence_length).")

    mm = [_linear("proj_in", n_v, c_in, d), _linear("audio_proj_in", n_a, a_in, d_a)]
    embedders = [("time_embed", d, video_mod), ("audio_time_embed", d_a, audio_mod),
                 ("av_cross_attn_video_scale_shift", d, 4), ("av_cross_attn_video_a2v_gate", d, 1),
                 ("av_cross_attn_audio_scale_shift", d_a, 4), ("av_cross_attn_audio_v2a_gate", d_a, 1)]
    if prompt_mod:
        embedders += [("prompt_adaln", d, 2), ("audio_prompt_adaln", d_a, 2)]
    for name, width, params in embedders:
        mm.append(_linear(f"{name}.emb.timestep_embedder.linear_1", 1, 256, width))
        mm.append(_linear(f"{name}.emb.timestep_embedder.linear_2", 1, width, width))
        mm.append(_linear(f"{name}.linear", 1, width, params * width))
    if _cfg(config, "use_prompt_embeddings", True):
        mm.append(_linear("caption_projection.linear_1", n_t, caption, d))
        mm.append(_linear("caption_projection.linear_2", n_t, d, d))
        mm.append(_linear("audio_caption_projection.linear_1", n_t, caption, d_a))
        mm.append(_linear("audio_caption_projection.linear_2", n_t, d_a, d_a))
    text_dim, a_text_dim = int(_cfg(config, "cross_attention_dim")), int(_cfg(config, "audio_cross_attention_dim"))
    for i in range(int(_cfg(config, "num_layers"))):
        b = f"transformer_blocks.{i}"
        mm += _ltx2_attention(f"{b}.attn1", n_v, n_v, d, d, d, heads, gated)
        mm += _ltx2_attention(f"{b}.audio_attn1", n_a, n_a, d_a, d_a, d_a, a_heads, a_gated)
        mm += _ltx2_attention(f"{b}.attn2", n_v, n_t, d, text_dim, d, heads, gated)
        mm += _ltx2_attention(f"{b}.audio_attn2", n_a, n_t, d_a, a_text_dim, d_a, a_heads, a_gated)
        mm += _ltx2_attention(f"{b}.audio_to_video_attn", n_v, n_a, d, d_a, d_a, a_heads, gated)
        mm += _ltx2_attention(f"{b}.video_to_audio_attn", n_a, n_v, d_a, d, d_a, a_heads, a_gated)
        mm.append(_linear(f"{b}.ff.net.0.proj", n_v, d, 4 * d))
        mm.append(_linear(f"{b}.ff.net.2", n_v, 4 * d, d))
        mm.append(_linear(f"{b}.audio_ff.net.0.proj", n_a, d_a, 4 * d_a))
        mm.append(_linear(f"{b}.audio_ff.net.2", n_a, 4 * d_a, d_a))
    mm.append(_linear("proj_out", n_v, d, c_out))
    mm.append(_linear("audio_proj_out", n_a, d_a, a_out))
    return mm


#: HunyuanVideo 1.5's fixed context parts ahead of the Qwen2.5-VL tokens: the SigLIP image tokens (zeros and masked
#: out in text-to-video, but still attended over) and the ByT5 glyph tokens (the pipeline's lengths).
HUNYUANVIDEO15_IMAGE_TOKENS = 729
HUNYUANVIDEO15_BYT5_TOKENS = 256


def hunyuanvideo15_forward_matmuls(config: Mapping[str, Any], image_tokens: int, text_tokens: int,
                                   byt5_tokens: int = HUNYUANVIDEO15_BYT5_TOKENS,
                                   image_embed_tokens: int = HUNYUANVIDEO15_IMAGE_TOKENS) -> list[Matmul]:
    """The matmuls of one ``HunyuanVideo15Transformer3DModel`` forward for one sample.

    ``image_tokens`` = F' x (h / p) x (w / p) latent patches; ``text_tokens`` = the whole joint-attention context:
    ``image_embed_tokens`` SigLIP tokens (the image projection, a two-layer MLP), ``byt5_tokens`` ByT5 tokens (a
    three-layer MLP to the model width) and the rest Qwen2.5-VL tokens, which pass the token refiner (``proj_in``, then
    ``num_refiner_layers`` self-attention blocks with a SiLU MLP of 4x and a per-sample gate linear; its conditioning
    is a timestep MLP plus a pooled-text MLP). The double-stream blocks are MMDiT blocks over the video tokens and the
    whole context (GELU MLPs of ``mlp_ratio``); the last block's text outputs (``to_add_out``, ``ff_context``) are
    computed and discarded. The patch embedding is a 3-D convolution counted like a linear over the patches.
    """
    heads, head_dim = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "attention_head_dim"))
    d = heads * head_dim
    patch, patch_t = int(_cfg(config, "patch_size", 1)), int(_cfg(config, "patch_size_t", 1))
    c_in, c_out = int(_cfg(config, "in_channels")), int(_cfg(config, "out_channels"))
    text_dim, byt5_dim = int(_cfg(config, "text_embed_dim")), int(_cfg(config, "text_embed_2_dim"))
    image_dim = int(_cfg(config, "image_embed_dim"))
    mlp = int(d * float(_cfg(config, "mlp_ratio", 4.0)))
    n_i, n_c = int(image_tokens), int(text_tokens)
    n_b, n_s = int(byt5_tokens), int(image_embed_tokens)
    n_q = n_c - n_b - n_s
    if n_q <= 0:
        raise ValueError(f"text_tokens={text_tokens}: a HunyuanVideo 1.5 context is {n_s} image tokens, {n_b} ByT5 "
                         "tokens and the Qwen2.5-VL tokens.")
    volume = patch_t * patch * patch
    mm = [
        _linear("time_embed.timestep_embedder.linear_1", 1, 256, d),
        _linear("time_embed.timestep_embedder.linear_2", 1, d, d),
        _linear("x_embedder.proj", n_i, c_in * volume, d),
        _linear("context_embedder.time_text_embed.timestep_embedder.linear_1", 1, 256, d),
        _linear("context_embedder.time_text_embed.timestep_embedder.linear_2", 1, d, d),
        _linear("context_embedder.time_text_embed.text_embedder.linear_1", 1, text_dim, d),
        _linear("context_embedder.time_text_embed.text_embedder.linear_2", 1, d, d),
        _linear("context_embedder.proj_in", n_q, text_dim, d),
    ]
    for i in range(int(_cfg(config, "num_refiner_layers", 2))):
        b = f"context_embedder.token_refiner.refiner_blocks.{i}"
        mm += [_linear(f"{b}.attn.{proj}", n_q, d, d) for proj in ("to_q", "to_k", "to_v")]
        mm.append(_attention(f"{b}.attn", n_q, n_q, d))
        mm.append(_linear(f"{b}.attn.to_out.0", n_q, d, d))
        mm.append(_linear(f"{b}.norm_out.linear", 1, d, 2 * d))
        mm.append(_linear(f"{b}.ff.net.0.proj", n_q, d, 4 * d))
        mm.append(_linear(f"{b}.ff.net.2", n_q, 4 * d, d))
    mm += [
        _linear("context_embedder_2.linear_1", n_b, byt5_dim, 2048),
        _linear("context_embedder_2.linear_2", n_b, 2048, 2048),
        _linear("context_embedder_2.linear_3", n_b, 2048, d),
        _linear("image_embedder.linear_1", n_s, image_dim, image_dim),
        _linear("image_embedder.linear_2", n_s, image_dim, d),
    ]
    layers = int(_cfg(config, "num_layers"))
    for i in range(layers):
        b = f"transformer_blocks.{i}"
        last = i == layers - 1  # the last block's text stream is discarded
        mm.append(_linear(f"{b}.norm1.linear", 1, d, 6 * d))
        mm.append(_linear(f"{b}.norm1_context.linear", 1, d, 6 * d))
        mm += _joint_attention(f"{b}.attn", n_i, n_c, d)
        mm.append(_linear(f"{b}.attn.to_add_out", n_c, d, d, dead=last))
        mm.append(_linear(f"{b}.ff.net.0.proj", n_i, d, mlp))
        mm.append(_linear(f"{b}.ff.net.2", n_i, mlp, d))
        mm.append(_linear(f"{b}.ff_context.net.0.proj", n_c, d, mlp, dead=last))
        mm.append(_linear(f"{b}.ff_context.net.2", n_c, mlp, d, dead=last))
    mm.append(_linear("norm_out.linear", 1, d, 2 * d))
    mm.append(_linear("proj_out", n_i, d, volume * c_out))
    return mm


#: The FLOP model of each family (the editing families share their base model's).
_FAMILIES = {
    "sd3": sd3_forward_matmuls, "flux": flux_forward_matmuls, "flux_kontext": flux_forward_matmuls,
    "qwenimage": qwenimage_forward_matmuls, "qwenimage_edit": qwenimage_forward_matmuls, "wan": wan_forward_matmuls,
    "flux2": flux2_forward_matmuls, "flux2_klein": flux2_forward_matmuls, "zimage": zimage_forward_matmuls,
    "wan_i2v": wan_forward_matmuls,
    "qwenimage_edit_plus": qwenimage_forward_matmuls, "qwenimage21": qwenimage21_forward_matmuls,
    "ltx2": ltx2_forward_matmuls, "hunyuanvideo15": hunyuanvideo15_forward_matmuls,
}


def _lora_targets_match(name: str, targets: str | Iterable[str]) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


# Linears whose input never needs a gradient when the base model is frozen: the embedders (model inputs), and the
# first block's q/k/v projections, which read the (normalised) embedder outputs.
_NO_INPUT_GRAD = re.compile(
    r"^(pos_embed\.proj|x_embedder|context_embedder|time_text_embed\..*|img_in|txt_in|patch_embedding"
    r"|condition_embedder\..*|time_guidance_embed\..*|all_x_embedder\..*|cap_embedder\..*|t_embedder\..*"
    r"|(noise|context)_refiner\.0\.attention\.(to_q|to_k|to_v)|txt_in\..*|modulation\.1|norm_out\.linear"
    r"|transformer_blocks\.0\.attn2?\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)"
    r"|blocks\.0\.attn1\.(to_q|to_k|to_v)|blocks\.\d+\.attn2\.(to_k|to_v|add_k_proj|add_v_proj))$"
)


# With every weight trained, only the layers that read the raw model inputs skip the input gradient.
_READS_MODEL_INPUT = re.compile(
    r"^(pos_embed\.proj|x_embedder|context_embedder|time_text_embed\.\w+\.linear_1|img_in|patch_embedding"
    r"|time_guidance_embed\.\w+\.linear_1|all_x_embedder\.[\w-]+|t_embedder\.mlp\.0"
    r"|condition_embedder\.(time_embedder|text_embedder)\.linear_1)$"
)


# LTX-2 with a frozen base and LoRA on the video stream: besides the embedders, the text keys / values of every block
# read the projected caption, and in the first block the audio stream depends on no trained weight until the
# video-to-audio attention (audio self- and text attention, the audio keys / values of audio-to-video attention, the
# audio queries of video-to-audio attention).
_LTX2_NO_INPUT_GRAD = re.compile(
    r"^(proj_in|audio_proj_in|(audio_)?caption_projection\..*|(audio_)?time_embed\..*|av_cross_attn_\w+\..*"
    r"|(audio_)?prompt_adaln\..*|transformer_blocks\.\d+\.(audio_)?attn2\.(to_k|to_v)"
    r"|transformer_blocks\.0\.attn1\.(to_q|to_k|to_v|to_gate_logits)"
    r"|transformer_blocks\.0\.audio_attn1\.(to_q|to_k|to_v|to_gate_logits|to_out\.0)"
    r"|transformer_blocks\.0\.audio_attn2\.(to_q|to_gate_logits|to_out\.0)"
    r"|transformer_blocks\.0\.audio_to_video_attn\.(to_k|to_v)"
    r"|transformer_blocks\.0\.video_to_audio_attn\.(to_q|to_gate_logits))$"
)
_LTX2_READS_MODEL_INPUT = re.compile(
    r"^(proj_in|audio_proj_in|(audio_)?caption_projection\.linear_1|\w+\.emb\.timestep_embedder\.linear_1)$")
# HunyuanVideo 1.5 with a frozen base: the embedders and the first refiner block's and the first double block's image
# q/k/v (the first block's text projections read the refined tokens, which the refiner's LoRA changes).
_HUNYUANVIDEO15_NO_INPUT_GRAD = re.compile(
    r"^(x_embedder\.proj|time_embed\..*|context_embedder\.(time_text_embed\..*|proj_in)|context_embedder_2\..*"
    r"|image_embedder\..*|context_embedder\.token_refiner\.refiner_blocks\.0\.attn\.(to_q|to_k|to_v)"
    r"|transformer_blocks\.0\.attn\.(to_q|to_k|to_v))$"
)
# With every weight trained: the ByT5 and image projections start with a LayerNorm whose affine weights train.
_HUNYUANVIDEO15_READS_MODEL_INPUT = re.compile(
    r"^(x_embedder\.proj|time_embed\.timestep_embedder\.linear_1|context_embedder\.proj_in"
    r"|context_embedder\.time_text_embed\.(timestep_embedder|text_embedder)\.linear_1)$"
)
#: family -> (linears without an input gradient under LoRA, linears reading raw model inputs), where the shared
#: patterns above do not fit the family's module names.
_GRADIENT_RULES = {
    "ltx2": (_LTX2_NO_INPUT_GRAD, _LTX2_READS_MODEL_INPUT),
    "hunyuanvideo15": (_HUNYUANVIDEO15_NO_INPUT_GRAD, _HUNYUANVIDEO15_READS_MODEL_INPUT),
}


def _needs_input_grad(m: Matmul, no_input_grad: re.Pattern = _NO_INPUT_GRAD) -> bool:
    """Per-token linears whose input depends on trained weights (per-sample ones read the conditioning vector)."""
    return m.is_linear and m.rows > 1 and no_input_grad.match(m.name) is None


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one transformer forward for one sample, split into base linears, attention core and LoRA, with what
    its backward costs (see the module docstring).

    ``linear_input_grad`` is the part of ``linear`` whose input gradient a LoRA backward computes;
    ``attention_backward`` what the attention cores' backward costs there (``dQ`` and ``dK`` through ``Q K^T``, the
    attention weights' gradient and ``dV``, each half a forward, only where the queries, keys or values need a
    gradient). The ``*_full`` fields are the same for full fine-tuning (``linear_weight_grad``: every weight gradient).
    """

    linear: int
    attention: int
    lora: int = 0
    linear_input_grad: int = 0
    lora_backward: int = 0
    linear_input_grad_full: int = 0
    attention_backward: int = 0
    attention_backward_full: int = 0
    linear_weight_grad: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.lora

    @property
    def base(self) -> int:
        """Without the LoRA branches (the reference pass, adapters disabled)."""
        return self.linear + self.attention

    def backward(self, full_finetune: bool = False) -> int:
        """FLOPs of the backward of one forward: LoRA training (frozen base) or full fine-tuning."""
        if full_finetune:
            return self.linear_input_grad_full + self.linear_weight_grad + self.attention_backward_full \
                + self.lora_backward
        return self.linear_input_grad + self.attention_backward + self.lora_backward


def _attention_backward(m: Matmul, needs_grad: Callable[[str], bool]) -> int:
    """Backward of one attention core: ``dQ`` / ``dK`` (through ``Q K^T``), the attention weights' gradient (needed
    for either) and ``dV``, each costing half the core's forward, computed only where needed."""
    q, k, v = (any(needs_grad(name) for name in group) for group in m.sources)
    half = m.flops // 2
    return half * (int(q) + int(k) + int(q or k) + int(v))


def transformer_forward_flops(
    family: str, config: Mapping[str, Any], image_tokens: int, text_tokens: int, lora_rank: int = 0,
    lora_targets: str | Iterable[str] | None = None, audio_tokens: int = 0,
) -> ForwardFlops:
    """Matmul FLOPs of one forward of one sample of a ``family`` transformer (a key of the adapters' families).

    The backward counts assume that every layer after the first block's attention projections needs its input
    gradient: true for full fine-tuning and for LoRA on the attention projections of every block (the default
    targets); LoRA only on later layers makes autograd stop earlier than counted here.
    """
    if family not in _FAMILIES:
        raise ValueError(f"No FLOP model for family {family!r}; choose one of {', '.join(_FAMILIES)}.")
    if audio_tokens:
        if family != "ltx2":
            raise ValueError(f"audio_tokens={audio_tokens}: family {family!r} has no audio stream.")
        matmuls = _FAMILIES[family](config, image_tokens, text_tokens, audio_tokens=audio_tokens)
    else:
        matmuls = _FAMILIES[family](config, image_tokens, text_tokens)
    no_input_grad, reads_model_input = _GRADIENT_RULES.get(family, (_NO_INPUT_GRAD, _READS_MODEL_INPUT))
    live = [m for m in matmuls if not m.dead]
    linear = sum(m.flops for m in matmuls if m.is_linear)
    attention = sum(m.flops for m in matmuls if not m.is_linear)
    input_grad = sum(m.flops for m in live if _needs_input_grad(m, no_input_grad))
    targets = (lora_targets if isinstance(lora_targets, str) else list(lora_targets)) \
        if lora_rank and lora_targets else None
    lora = lora_backward = 0
    for m in matmuls:
        if targets is not None and m.is_linear and _lora_targets_match(m.name, targets):
            # forward: x A (in -> r), then B (r -> out); backward: both weight gradients, the gradient into
            # B's input, and the one into A's input only where the layer's input needs it.
            a, b = 2 * m.rows * lora_rank * m.in_features, 2 * m.rows * lora_rank * m.out_features
            lora += a + b
            if not m.dead:
                lora_backward += a + 2 * b + (a if _needs_input_grad(m, no_input_grad) else 0)
    by_name = {m.name: m for m in matmuls if m.is_linear}

    def output_needs_grad(name: str) -> bool:  # with a frozen base: a LoRA on the layer, or an input needing one
        m = by_name[name]
        trained = targets is not None and _lora_targets_match(name, targets)
        return trained or _needs_input_grad(m, no_input_grad)

    attention_backward = sum(_attention_backward(m, output_needs_grad) for m in live if not m.is_linear)
    attention_backward_full = sum(_attention_backward(m, lambda name: True) for m in live if not m.is_linear)
    input_grad_full = sum(m.flops for m in live if m.is_linear and reads_model_input.match(m.name) is None)
    return ForwardFlops(linear=linear, attention=attention, lora=lora, linear_input_grad=input_grad,
                        lora_backward=lora_backward, linear_input_grad_full=input_grad_full,
                        attention_backward=attention_backward, attention_backward_full=attention_backward_full,
                        linear_weight_grad=sum(m.flops for m in live if m.is_linear))


@dataclass
class StepFlops:
    """Transformer FLOPs of one optimizer step, by phase (see :func:`step_flops`)."""

    per_forward_sample: ForwardFlops
    rollout_forwards: int          # transformer calls during the rollout
    training_passes: int           # forward + backward transformer calls during training
    reference_forwards: int        # no-grad reference calls (beta > 0)
    batch_per_call: int            # samples per transformer call (CFG doubles the micro-batch)
    rollout: int = 0
    training: int = 0
    reference: int = 0
    old_policy_forwards: int = 0   # no-grad old-policy calls (DiffusionNFT)
    old_policy: int = 0

    @property
    def total(self) -> int:
        return self.rollout + self.training + self.reference + self.old_policy

    def as_dict(self) -> dict[str, Any]:
        f = self.per_forward_sample
        return {
            "forward_per_sample": f.total,
            "forward_per_sample_attention": f.attention,
            "forward_per_sample_lora": f.lora,
            "rollout_forwards": self.rollout_forwards,
            "training_passes": self.training_passes,
            "reference_forwards": self.reference_forwards,
            "batch_per_call": self.batch_per_call,
            "rollout": self.rollout,
            "training": self.training,
            "reference": self.reference,
            "old_policy_forwards": self.old_policy_forwards,
            "old_policy": self.old_policy,
            "total": self.total,
        }


def step_flops(
    forward: ForwardFlops, *, micro_batches: int, micro_batch_size: int, num_inference_steps: int,
    trained_steps: int, cfg: bool, beta: float = 0.0, full_finetune: bool = False,
    gradient_checkpointing: bool = False, old_policy: bool = False,
) -> StepFlops:
    """Transformer FLOPs of one optimizer step (one generation batch, ``num_iterations = 1``).

    Rollout: ``micro_batches x num_inference_steps`` calls. Training: ``micro_batches x trained_steps`` forward +
    backward calls (plus a recomputed forward with gradient checkpointing); with ``beta > 0`` as many no-grad
    reference calls without LoRA. Each call holds ``micro_batch_size`` samples, twice that with classifier-free
    guidance. Flow-GRPO trains the window's steps (``trained_steps``: the window size); DiffusionNFT trains
    ``num_trained_timesteps`` noise levels per sample and, with ``old_policy=True``, adds one no-grad forward of the
    old policy (with its LoRA) per trained noise level.
    """
    batch = micro_batch_size * (2 if cfg else 1)
    rollout_calls = micro_batches * num_inference_steps
    train_calls = micro_batches * trained_steps
    ref_calls = train_calls if beta > 0 else 0
    old_calls = train_calls if old_policy else 0
    per_train_call = forward.total * (2 if gradient_checkpointing else 1) + forward.backward(full_finetune)
    return StepFlops(
        per_forward_sample=forward, rollout_forwards=rollout_calls, training_passes=train_calls,
        reference_forwards=ref_calls, batch_per_call=batch,
        rollout=rollout_calls * batch * forward.total,
        training=train_calls * batch * per_train_call,
        reference=ref_calls * batch * forward.base,
        old_policy_forwards=old_calls, old_policy=old_calls * batch * forward.total,
    )


def count_flops(fn, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``fn(*args, **kwargs)`` as ``torch.utils.flop_counter.FlopCounterMode`` counts them (runs ``fn``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())
