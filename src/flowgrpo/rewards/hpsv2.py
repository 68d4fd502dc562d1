"""``hpsv2``: Human Preference Score v2 / v2.1 (Wu et al., 2023; ``xswu/HPSv2``), on transformers' CLIP.

Model: open_clip's ``ViT-H-14`` CLIP (vision: patch 14 at 224 px, width 1280, 32 blocks, 16 heads; text: width
1024, 24 blocks, 16 heads, context 77; joint embedding 1024; exact GELU), fine-tuned on human preferences. The
released checkpoints (``HPS_v2.1_compressed.pt``, default, and ``HPS_v2_compressed.pt`` for ``version="v2.0"``)
hold its open_clip state dict under ``state_dict`` in half precision. They are converted to `transformers.CLIPModel`
names by `open_clip_to_ours` (``in_proj_weight`` split into q/k/v, ``visual.proj`` / ``text_projection``
transposed into the projection layers) and loaded strictly: every weight must be present, and no key may be left
over.

Score (the official ``img_score``): the raw cosine between the image and prompt features, no logit scale::

    hps = <f_img / ||f_img||, f_txt / ||f_txt||>

where ``f_img`` is the projected, post-LayerNormed class token and ``f_txt`` the projected final-LayerNormed state at
the end-of-text token (the position of the highest token id, as open_clip). Real images score about 0.2-0.35.

Preprocessing (HPS's ``image_transform(224, is_train=False, resize_longest_max=True)``): RGB; ``ToTensor``
(``/ 255``); when the long side is not 224, a letterbox: resize the float tensor to ``(round(h * s), round(w * s))``
with ``s = 224 / max(h, w)`` (bicubic, antialiased, no clamping) and pad with zeros (black) to 224 x 224, with
``pad // 2`` on the left and top and the rest on the right and bottom; then OpenAI's CLIP mean/std. (A non-square
image whose long side is already 224 is padded too; the official transform leaves it unpadded and cannot score it.)

Text (open_clip's tokenizer): ``ftfy.fix_text``, HTML unescaped twice, whitespace runs collapsed to one space,
stripped, lower-cased; split with CLIP's pattern; byte-level BPE with the ``</w>`` end-of-word suffix; then
``[start] + tokens + [end]``, truncated to 77 with the end token kept last, padded with 0.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .hub_files import resolve_model_file
from .placement import ModelReward
from .registry import register_reward

__all__ = [
    "HPSv2",
    "OpenCLIPTokenizer",
    "build_hps_clip",
    "heads_from_open_clip_config",
    "hps_pixels",
    "hps_pixels_from_tensor",
    "load_hps_clip",
    "open_clip_to_ours",
    "ours_to_open_clip",
]

DEFAULT_HPS_REPO = "xswu/HPSv2"
HPS_CHECKPOINTS = {"v2.1": "HPS_v2.1_compressed.pt", "v2.0": "HPS_v2_compressed.pt"}
DEFAULT_HPS_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
HPS_IMAGE_SIZE = 224
HPS_CONTEXT_LENGTH = 77
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
#: open_clip buffers that are not weights (dropped if a checkpoint carries them)
IGNORED_OPEN_CLIP_KEYS = ("attn_mask", "visual.attn_mask")

_BLOCK_NAMES = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_TOP_NAMES = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_TOWERS = (("visual.transformer.resblocks.", "vision_model.encoder.layers."),
           ("transformer.resblocks.", "text_model.encoder.layers."))


# ---- key conversion -----------------------------------------------------------------------------------


def open_clip_to_ours(state: Mapping[str, Any]) -> dict[str, Any]:
    """open_clip ``CLIP`` names -> `transformers.CLIPModel` names (``in_proj`` split into q/k/v projections,
    ``visual.proj`` and ``text_projection`` transposed). A leading ``module.`` is removed.

    Raises:
        ValueError: a key of neither layout (e.g. a checkpoint of another architecture).
    """
    out: dict[str, Any] = {}
    unknown = []
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in IGNORED_OPEN_CLIP_KEYS:
            continue
        if key in _TOP_NAMES:
            out[_TOP_NAMES[key]] = value
            continue
        if key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
            continue
        for src, dst in _TOWERS:
            if key.startswith(src):
                index, _, rest = key.removeprefix(src).partition(".")
                name, _, leaf = rest.rpartition(".")
                if name == "attn" and leaf in ("in_proj_weight", "in_proj_bias"):
                    kind = "weight" if leaf == "in_proj_weight" else "bias"
                    q, k, v = value.chunk(3, dim=0)
                    for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                        out[f"{dst}{index}.self_attn.{proj}.{kind}"] = part.contiguous()
                elif name in _BLOCK_NAMES:
                    out[f"{dst}{index}.{_BLOCK_NAMES[name]}.{leaf}"] = value
                else:
                    unknown.append(key)
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"keys that are not part of an open_clip ViT CLIP: {unknown[:10]}"
                         f"{' ...' if len(unknown) > 10 else ''}")
    return out


def ours_to_open_clip(state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `open_clip_to_ours`: `transformers.CLIPModel` names -> open_clip ``CLIP`` names."""
    import torch

    top = {v: k for k, v in _TOP_NAMES.items()}
    transposed = {v: k for k, v in _TRANSPOSED.items()}
    block = {v: k for k, v in _BLOCK_NAMES.items()}
    out: dict[str, Any] = {}
    qkv: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in state.items():
        if key in top:
            out[top[key]] = value
            continue
        if key in transposed:
            out[transposed[key]] = value.t().contiguous()
            continue
        for src, dst in _TOWERS:
            if key.startswith(dst):
                index, _, rest = key.removeprefix(dst).partition(".")
                name, _, leaf = rest.rpartition(".")
                if name.startswith("self_attn.") and name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                    qkv.setdefault((f"{src}{index}.attn.in_proj_", leaf), {})[name.split(".")[1]] = value
                else:
                    out[f"{src}{index}.{block[name]}.{leaf}"] = value
                break
        else:
            raise ValueError(f"{key!r} is not a CLIPModel weight of the HPS architecture")
    for (prefix, leaf), parts in qkv.items():
        out[f"{prefix}{leaf}"] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]], dim=0)
    return out


# ---- model --------------------------------------------------------------------------------------------


def build_hps_clip(
    vision_width: int = 1280,
    vision_layers: int = 32,
    vision_heads: int = 16,
    text_width: int = 1024,
    text_layers: int = 24,
    text_heads: int = 16,
    embed_dim: int = 1024,
    vocab_size: int = 49408,
    context_length: int = HPS_CONTEXT_LENGTH,
    patch_size: int = 14,
    mlp_ratio: float = 4.0,
) -> Any:
    """A new (random) `transformers.CLIPModel` shaped like open_clip's CLIP; the defaults are ``ViT-H-14``."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=text_width, intermediate_size=int(text_width * mlp_ratio),
            num_hidden_layers=text_layers, num_attention_heads=text_heads, max_position_embeddings=context_length,
            hidden_act="gelu", layer_norm_eps=1e-5, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=vision_width, intermediate_size=int(vision_width * mlp_ratio), num_hidden_layers=vision_layers,
            num_attention_heads=vision_heads, image_size=HPS_IMAGE_SIZE, patch_size=patch_size, hidden_act="gelu",
            layer_norm_eps=1e-5,
        ),
        projection_dim=embed_dim,
    )
    return CLIPModel(config)


def _architecture(state: Mapping[str, Any]) -> dict[str, Any]:
    """Sizes of an open_clip CLIP from its (converted) weights; heads follow ViT-H-14's head widths (80 and 64)."""
    need = ("vision_model.embeddings.patch_embedding.weight", "vision_model.embeddings.position_embedding.weight",
            "text_model.embeddings.token_embedding.weight", "text_model.embeddings.position_embedding.weight",
            "visual_projection.weight", "vision_model.encoder.layers.0.mlp.fc1.weight")
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"the HPS checkpoint lacks {missing}")
    patch = state["vision_model.embeddings.patch_embedding.weight"]
    vision_width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    grid = HPS_IMAGE_SIZE // patch_size
    positions = int(state["vision_model.embeddings.position_embedding.weight"].shape[0])
    if positions != grid * grid + 1:
        raise ValueError(f"the checkpoint's ViT has {positions - 1} patches; HPS runs at {HPS_IMAGE_SIZE} px "
                         f"({grid * grid} patches of {patch_size})")
    vocab_size, text_width = (int(s) for s in state["text_model.embeddings.token_embedding.weight"].shape)

    def depth(prefix: str) -> int:
        return 1 + max(int(k.removeprefix(prefix).split(".")[0]) for k in state if k.startswith(prefix))

    return dict(
        vision_width=vision_width, vision_layers=depth("vision_model.encoder.layers."),
        vision_heads=max(1, vision_width // 80) if vision_width % 80 == 0 else max(1, vision_width // 64),
        text_width=text_width, text_layers=depth("text_model.encoder.layers."), text_heads=max(1, text_width // 64),
        embed_dim=int(state["visual_projection.weight"].shape[0]), vocab_size=vocab_size,
        context_length=int(state["text_model.embeddings.position_embedding.weight"].shape[0]),
        patch_size=patch_size,
        mlp_ratio=int(state["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0]) / vision_width,
    )


def heads_from_open_clip_config(folder: str | Path, vision_width: int) -> tuple[int | None, int | None]:
    """``(vision_heads, text_heads)`` from an ``open_clip_config.json`` in ``folder`` (open_clip's hub format:
    ``model_cfg.vision_cfg.head_width``, default 64, and ``model_cfg.text_cfg.heads``, default 8); ``(None, None)``
    without one."""
    file = Path(folder) / "open_clip_config.json"
    if not file.is_file():
        return None, None
    cfg = json.loads(file.read_text())
    cfg = cfg.get("model_cfg", cfg)
    head_width = int(cfg.get("vision_cfg", {}).get("head_width", 64))
    return max(1, vision_width // head_width), int(cfg.get("text_cfg", {}).get("heads", 8))


def load_hps_clip(checkpoint: str | Path, heads: tuple[int | None, int | None] | None = None) -> Any:
    """The CLIP of an HPS checkpoint file (``torch.save({"state_dict": ...})`` of an open_clip CLIP), strictly.

    Head counts cannot be read from weights. They come from ``heads`` = ``(vision_heads, text_heads)`` where given,
    else from an ``open_clip_config.json`` beside the checkpoint, else from ViT-H-14's head widths: 80 in the ViT
    when it divides the width (else 64), 64 in the text tower.
    """
    import torch

    raw = torch.load(Path(checkpoint), map_location="cpu", weights_only=True)
    if isinstance(raw, Mapping) and isinstance(raw.get("state_dict"), Mapping):
        raw = raw["state_dict"]
    if not isinstance(raw, Mapping):
        raise ValueError(f"{checkpoint} does not hold a state dict (got {type(raw).__name__})")
    state = open_clip_to_ours(raw)
    arch = _architecture(state)
    found = heads_from_open_clip_config(Path(checkpoint).parent, arch["vision_width"])
    given = heads if heads is not None else (None, None)
    for key, value, fallback in zip(("vision_heads", "text_heads"), given, found):
        if value is not None or fallback is not None:
            arch[key] = int(value if value is not None else fallback)
    model = build_hps_clip(**arch)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{checkpoint} lacks weights of the HPS CLIP (open_clip names): "
                         f"{sorted(ours_to_open_clip({k: expected[k] for k in missing}))[:10]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{checkpoint} has weights the HPS CLIP does not use: {unexpected[:10]}")
    wrong = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state.items()
             if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise ValueError(f"{checkpoint}: weights of unexpected shapes: {wrong[:5]}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


# ---- preprocessing ------------------------------------------------------------------------------------


def hps_pixels(image: Any) -> Any:
    """HPS's evaluation transform of one image: a float32 tensor ``(3, 224, 224)`` (see the module docstring)."""
    from .differentiable import pil_to_tensor

    try:
        pixels = pil_to_tensor(image)
    except TypeError:
        raise TypeError(f"hpsv2 needs PIL images (or HxWxC uint8 arrays), got {type(image).__name__}") from None
    return hps_pixels_from_tensor(pixels[None])[0]


def hps_pixels_from_tensor(images: Any) -> Any:
    """HPS's evaluation transform of float images ``(N, 3, H, W)`` in [0, 1] (the module docstring's letterbox and
    normalisation), differentiable: float32 ``(N, 3, 224, 224)``. The PIL path is this function on ``uint8 / 255``,
    so the two paths compute the same operations."""
    import torch.nn.functional as F

    from .differentiable import normalize, resize_bicubic

    pixels = images.float()
    height, width = pixels.shape[-2:]
    size = HPS_IMAGE_SIZE
    scale = size / float(max(height, width))
    if scale != 1.0 or height != width:
        new_h, new_w = round(height * scale), round(width * scale)
        pixels = resize_bicubic(pixels, new_h, new_w)
        pad_h, pad_w = size - new_h, size - new_w
        pixels = F.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    return normalize(pixels, OPENAI_MEAN, OPENAI_STD)


# ---- tokenizer ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """CLIP's reversible byte -> printable character table."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars = kept[:]
    extra = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(kept, (chr(c) for c in chars)))


class OpenCLIPTokenizer:
    """open_clip's CLIP tokenizer (``SimpleTokenizer`` + ``tokenize``) over a vocabulary and merge list.

    Args:
        vocab: token -> id (``vocab.json`` of a transformers CLIP tokenizer).
        merges: the BPE merges in rank order, ``"left right"`` each.
        context_length: sequence length (77).
    """

    START, END = "<|startoftext|>", "<|endoftext|>"

    def __init__(self, vocab: Mapping[str, int], merges: Sequence[str], context_length: int = HPS_CONTEXT_LENGTH):
        import regex

        self.encoder = dict(vocab)
        for token in (self.START, self.END):
            if token not in self.encoder:
                raise ValueError(f"the CLIP vocabulary has no {token!r} token")
        self.ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
        self.context_length = int(context_length)
        self.byte_encoder = byte_to_unicode()
        # open_clip names its special tokens <start_of_text> / <end_of_text>: written in a prompt, they are single
        # tokens (and "<|endoftext|>" is plain text), as in open_clip
        self.encoder["<start_of_text>"] = self.encoder[self.START]
        self.encoder["<end_of_text>"] = self.encoder[self.END]
        self.cache = {"<start_of_text>": "<start_of_text>", "<end_of_text>": "<end_of_text>"}
        specials = "<start_of_text>|<end_of_text>"
        self.pattern = regex.compile(specials + r"""|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
                                     regex.IGNORECASE)
        self.whitespace = regex.compile(r"\s+")

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, context_length: int = HPS_CONTEXT_LENGTH) -> OpenCLIPTokenizer:
        """From a transformers CLIP tokenizer folder or hub repo: ``vocab.json`` + ``merges.txt`` (or, for a local
        folder without them, the BPE model of ``tokenizer.json``)."""
        local = Path(name_or_path).expanduser()
        if local.is_dir() and not (local / "vocab.json").is_file() and (local / "tokenizer.json").is_file():
            model = json.loads((local / "tokenizer.json").read_text(encoding="utf-8"))["model"]
            merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
            return cls(model["vocab"], merges, context_length)
        vocab_file = resolve_model_file(name_or_path, "vocab.json", "hpsv2 tokenizer")
        merges_file = resolve_model_file(name_or_path, "merges.txt", "hpsv2 tokenizer")
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        lines = Path(merges_file).read_text(encoding="utf-8").split("\n")
        merges = [line for line in lines if line.strip() and not line.startswith("#version")]
        return cls(vocab, merges, context_length)

    def clean(self, text: str) -> str:
        """ftfy, HTML unescaped twice, stripped; whitespace runs collapsed; lower case (open_clip)."""
        import ftfy

        text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
        return self.whitespace.sub(" ", text).strip().lower()

    def _bpe(self, token: str) -> list[str]:
        cached = self.cache.get(token)
        if cached is not None:
            return cached.split(" ")
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        self.cache[token] = " ".join(word)
        return list(word)

    def encode(self, text: str) -> list[int]:
        """Token ids of the cleaned text, without the start and end tokens."""
        ids = []
        for piece in self.pattern.findall(self.clean(text)):
            piece = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self._bpe(piece))
        return ids

    def __call__(self, texts: Sequence[str]) -> Any:
        """``(len(texts), context_length)`` long tensor: start, tokens, end; truncated with the end token kept last;
        padded with 0."""
        import torch

        start, end = self.encoder[self.START], self.encoder[self.END]
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            tokens = [start] + self.encode(text) + [end]
            if len(tokens) > self.context_length:
                tokens = tokens[: self.context_length]
                tokens[-1] = end
            out[i, : len(tokens)] = torch.tensor(tokens)
        return out


# ---- the reward ---------------------------------------------------------------------------------------


@register_reward("hpsv2")
class HPSv2(ModelReward):
    """HPS v2.1 (default) or v2.0: the raw cosine between CLIP image and prompt features (see the module
    docstring for the model, the preprocessing and the tokenizer). Differentiable: called with a float tensor
    ``(N, 3, H, W)`` in [0, 1] it returns the scores as a tensor that carries the gradient (the same operations as
    the PIL path, `hps_pixels_from_tensor`).

    Args:
        model_name_or_path: a hub repo holding the checkpoint (default ``xswu/HPSv2``), a local checkpoint file,
            or a local folder holding it.
        version: ``"v2.1"`` (``HPS_v2.1_compressed.pt``, default) or ``"v2.0"`` (``HPS_v2_compressed.pt``): the file
            taken from a repo or folder.
        tokenizer_name_or_path: a transformers CLIP tokenizer folder or repo (``vocab.json``, ``merges.txt``);
            default ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (the open_clip BPE of ViT-H-14).
        device / reward_device, dtype, batch_size: placement (default CUDA when available, float32) and pairs per
            forward pass.
        vision_heads, text_heads: attention heads of a checkpoint that is not ViT-H-14-shaped (see `load_hps_clip`;
            the released checkpoints need neither).
    """

    differentiable = True

    def __init__(
        self,
        model_name_or_path: str | Path = DEFAULT_HPS_REPO,
        tokenizer_name_or_path: str | Path = DEFAULT_HPS_TOKENIZER,
        version: str = "v2.1",
        device: Any = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: Any = None,
        vision_heads: int | None = None,
        text_heads: int | None = None,
    ):
        if version not in HPS_CHECKPOINTS:
            raise ValueError(f"hpsv2 version must be one of {sorted(HPS_CHECKPOINTS)}, got {version!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = model_name_or_path
        self.tokenizer_name_or_path = tokenizer_name_or_path
        self.version = version
        self.heads = (vision_heads, text_heads)
        self.tokenizer: OpenCLIPTokenizer | None = None

    def _load(self, device: Any, dtype: Any) -> Any:
        checkpoint = resolve_model_file(self.model_name_or_path, HPS_CHECKPOINTS[self.version], "hpsv2 checkpoint")
        model = load_hps_clip(checkpoint, self.heads)
        tokenizer = OpenCLIPTokenizer.from_pretrained(self.tokenizer_name_or_path,
                                                      model.config.text_config.max_position_embeddings)
        vocab = model.config.text_config.vocab_size
        if max(tokenizer.encoder.values()) >= vocab:
            raise ValueError(f"the tokenizer {str(self.tokenizer_name_or_path)!r} has ids up to "
                             f"{max(tokenizer.encoder.values())} but the text encoder's vocabulary has {vocab}; use "
                             f"the open_clip ViT-H-14 tokenizer")
        self.tokenizer = tokenizer
        return model.to(device=device, dtype=dtype)

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        import torch

        out = []
        for sl in self.chunks(len(images)):
            pixels = torch.stack([hps_pixels(im) for im in images[sl]])
            out.append(self._cosines(prompts[sl], pixels))
        return torch.cat(out)

    def _score_tensor(self, prompts: list[str], images: Any, **columns: Any) -> Any:
        """The same score of float images ``(N, 3, H, W)`` in [0, 1] with gradient: `hps_pixels_from_tensor`, then
        the model (the text features carry none)."""
        import torch

        return torch.cat([self._cosines(prompts[sl], hps_pixels_from_tensor(images[sl]))
                          for sl in self.chunks(len(prompts))])

    def _cosines(self, prompts: list[str], pixels: Any) -> Any:
        """The cosine of each pair from preprocessed pixels ``(n, 3, 224, 224)``."""
        import torch

        model = self.load()
        device = self.current_device
        dtype = model.visual_projection.weight.dtype
        pixels = pixels.to(device, dtype)
        image = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output).float()
        with torch.no_grad():
            ids = self.tokenizer(prompts).to(device)
            hidden = model.text_model(input_ids=ids).last_hidden_state
            eot = hidden[torch.arange(hidden.shape[0], device=device), ids.argmax(dim=-1)]
            text = model.text_projection(eot).float()
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        return (image * text).sum(-1)
