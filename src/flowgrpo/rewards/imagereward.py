"""``imagereward``: ImageReward v1.0 (Xu et al., 2023; ``THUDM/ImageReward``), built from transformers' BLIP parts.

Model (as the official ``ImageReward`` module): a BLIP ViT-L/16 image encoder at 224 px (24 pre-norm blocks, width
1024, 16 heads, LayerNorm eps 1e-6, a final LayerNorm) gives ``image_embeds``; a BERT-base text encoder with a
cross-attention block after every self-attention block (BLIP's "med" BERT: no token-type embeddings, bidirectional
self-attention, cross-attention over all image tokens) reads the prompt; its first-token ([CLS]) output goes through
the MLP head ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` (linear layers only; dropouts at indices 1, 3, 5, inactive at
inference). The score is the official ``ImageReward.score``::

    r = MLP(text_encoder(ids, mask, cross=vision(pixels))[:, 0]);      score = (r - 0.16717362830052426) / 1.0333394966054072

so real images score about -2..2 (mean 0, std 1 over the ImageReward training comparisons).

Built here from `transformers.BlipVisionModel` (the same ViT: fused ``qkv`` with bias, exact GELU, no pre-norm) and
`transformers.models.blip.modeling_blip_text.BlipTextModel` (a port of BLIP's med BERT with the same layer names)
called as an encoder (``is_decoder=False``). The official checkpoint's keys are converted by `official_to_ours`
(and back by `ours_to_official`); loading is strict: ``blip.text_encoder.embeddings.position_ids``,
``blip.vision_proj.*`` and ``blip.text_proj.*`` (unused by the score) are dropped, any other missing or unexpected
key is an error.

Preprocessing (the official ``_transform(224)``): PIL bicubic resize of the short side to 224 with the long side
``int(224 * long / short)``; centre crop 224 at ``int(round((s - 224) / 2))``; then RGB, ``/ 255`` and CLIP's
mean/std. Text: the ``bert-base-uncased`` tokenizer with ``[DEC]`` added as the bos token and ``[ENC]`` as an
additional special token (as BLIP's ``init_tokenizer``), ``padding="max_length"``, ``truncation=True``,
``max_length=35``; the input ids start with ``[CLS]`` (the official ``score`` keeps it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .hub_files import resolve_model_file
from .placement import ModelReward
from .registry import register_reward

__all__ = [
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_STD",
    "ImageReward",
    "build_imagereward_model",
    "imagereward_pixels",
    "imagereward_pixels_from_tensor",
    "load_imagereward_model",
    "load_imagereward_tokenizer",
    "official_to_ours",
    "ours_to_official",
]

DEFAULT_IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_CHECKPOINT = "ImageReward.pt"
IMAGEREWARD_MED_CONFIG = "med_config.json"
DEFAULT_IMAGEREWARD_TOKENIZER = "bert-base-uncased"
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGEREWARD_IMAGE_SIZE = 224
IMAGEREWARD_TEXT_MAX_LENGTH = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: the official names of the released model
IMAGEREWARD_NAMES = ("ImageReward-v1.0",)
#: official keys the score does not use: dropped on load
IGNORED_OFFICIAL_KEYS = ("blip.text_encoder.embeddings.position_ids",)
IGNORED_OFFICIAL_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
#: head dimension of BLIP's ViTs (base: 768 / 12, large: 1024 / 16)
BLIP_VIT_HEAD_DIM = 64

_VISION_BLOCK_NAMES = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_TOP_NAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}


# ---- preprocessing ------------------------------------------------------------------------------------


def imagereward_pixels(image: Any) -> Any:
    """The official ImageReward preprocessing of one image: a float32 tensor ``(3, 224, 224)``.

    Resize (PIL bicubic) so the short side is 224 and the long side ``int(224 * long / short)``; centre-crop 224 at
    ``(int(round((w - 224) / 2)), int(round((h - 224) / 2)))``; convert to RGB; ``/ 255``; CLIP mean/std. The RGB
    conversion comes after the resize and the crop, as in the official transform.
    """
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"imagereward needs PIL images (or HxWxC uint8 arrays), got {type(image).__name__}")
    size = IMAGEREWARD_IMAGE_SIZE
    w, h = image.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.BICUBIC)
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    image = image.crop((left, top, left + size, top + size)).convert("RGB")
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255.0)
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return (pixels - mean) / std


def imagereward_pixels_from_tensor(images: Any) -> Any:
    """`imagereward_pixels` of float images ``(N, 3, H, W)`` in [0, 1] in torch, differentiable: float32
    ``(N, 3, 224, 224)``.

    The same sizes, crop offsets and normalisation; PIL's bicubic resize of 8-bit pixels is
    `flowgrpo.rewards.differentiable.resize_bicubic_like_pil` (PIL's filter, clamped after each pass, without PIL's
    rounding to 8 bits), so on ``uint8 / 255`` images the pixels agree with the PIL path within 1.1 / 255 (module
    docstring of `flowgrpo.rewards.differentiable`; the scores' tolerance is in docs/rewards.md).
    """
    from .differentiable import center_crop, normalize, resize_bicubic_like_pil, shortest_side_size

    size = IMAGEREWARD_IMAGE_SIZE
    new_h, new_w = shortest_side_size(images.shape[-2], images.shape[-1], size)
    pixels = resize_bicubic_like_pil(images.float(), new_h, new_w)
    return normalize(center_crop(pixels, size, size, offsets="round"), CLIP_MEAN, CLIP_STD)


def load_imagereward_tokenizer(name_or_path: str | Path = DEFAULT_IMAGEREWARD_TOKENIZER) -> Any:
    """The BERT tokenizer with BLIP's special tokens: ``[DEC]`` as bos, ``[ENC]`` as an additional special token."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(str(name_or_path))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


# ---- model --------------------------------------------------------------------------------------------


def _mlp_head(sizes: list[int]) -> Any:
    """The official MLP head: ``Linear`` layers between ``sizes`` with ``Dropout`` at indices 1, 3, 5 (names
    ``layers.0`` ... ``layers.7``)."""
    from torch import nn

    if len(sizes) != 6:
        raise ValueError(f"the ImageReward MLP has 5 linear layers (6 sizes), got sizes {sizes}")
    dropouts = (0.2, 0.2, 0.1)
    layers: list[Any] = []
    for i in range(5):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < 3:
            layers.append(nn.Dropout(dropouts[i]))
    head = nn.Module()
    head.layers = nn.Sequential(*layers)
    return head


class _ImageRewardModule:
    """Namespace for the model class (built lazily so that importing this module does not import torch)."""

    cls: Any = None


def _model_class() -> Any:
    if _ImageRewardModule.cls is not None:
        return _ImageRewardModule.cls
    import torch
    from torch import nn

    class ImageRewardModel(nn.Module):
        """BLIP vision + BLIP med text encoder + MLP; ``forward`` gives the raw reward ``r`` (before normalising)."""

        def __init__(self, vision_config: Any, text_config: Any, mlp_sizes: list[int]):
            super().__init__()
            from transformers import BlipVisionModel
            from transformers.models.blip.modeling_blip_text import BlipTextModel

            self.vision = BlipVisionModel(vision_config)
            self.text = BlipTextModel(text_config, add_pooling_layer=False)
            self.mlp = _mlp_head(mlp_sizes)

        def forward(self, pixel_values: Any, input_ids: Any, attention_mask: Any) -> Any:
            image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state
            image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
            text_out = self.text(input_ids=input_ids, attention_mask=attention_mask,
                                 encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                 is_decoder=False)
            features = text_out.last_hidden_state[:, 0, :].float()
            head = self.mlp.layers
            return head(features.to(head[0].weight.dtype)).float().squeeze(-1)

    _ImageRewardModule.cls = ImageRewardModel
    return ImageRewardModel


def build_imagereward_model(
    med_config: Mapping[str, Any],
    vision_width: int = 1024,
    vision_layers: int = 24,
    vision_heads: int | None = None,
    vision_intermediate: int | None = None,
    patch_size: int = 16,
    mlp_sizes: list[int] | None = None,
) -> Any:
    """A new (randomly initialised) ImageReward model; the defaults are ImageReward v1.0's (ViT-L/16 at 224).

    Args:
        med_config: BLIP's med BERT configuration (the contents of ``med_config.json``): ``hidden_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``,
            ``max_position_embeddings``, ``layer_norm_eps``, ``hidden_act``, ``pad_token_id``. Its
            ``encoder_width`` is replaced by ``vision_width``, as the official model does.
        vision_width, vision_layers, vision_heads, vision_intermediate, patch_size: the ViT (heads default to
            ``vision_width // 64``, the MLP to ``4 * vision_width``).
        mlp_sizes: the head's sizes (default ``[hidden_size, 1024, 128, 64, 16, 1]``).
    """
    from transformers import BlipTextConfig, BlipVisionConfig

    heads = vision_heads or max(1, vision_width // BLIP_VIT_HEAD_DIM)
    vision_config = BlipVisionConfig(
        hidden_size=vision_width, intermediate_size=vision_intermediate or 4 * vision_width,
        num_hidden_layers=vision_layers, num_attention_heads=heads, image_size=IMAGEREWARD_IMAGE_SIZE,
        patch_size=patch_size, hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0,
    )
    med = dict(med_config)
    vocab_size = int(med.get("vocab_size", 30524))
    text_config = BlipTextConfig(
        vocab_size=vocab_size,
        hidden_size=int(med.get("hidden_size", 768)),
        encoder_hidden_size=vision_width,
        intermediate_size=int(med.get("intermediate_size", 3072)),
        num_hidden_layers=int(med.get("num_hidden_layers", 12)),
        num_attention_heads=int(med.get("num_attention_heads", 12)),
        max_position_embeddings=int(med.get("max_position_embeddings", 512)),
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
        hidden_dropout_prob=float(med.get("hidden_dropout_prob", 0.0)),
        attention_probs_dropout_prob=float(med.get("attention_probs_dropout_prob", 0.0)),
        pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None, eos_token_id=None, sep_token_id=None,
        is_decoder=True,  # builds the cross-attention blocks; forward runs as an encoder (is_decoder=False)
    )
    hidden = text_config.hidden_size
    sizes = list(mlp_sizes) if mlp_sizes is not None else [hidden, 1024, 128, 64, 16, 1]
    return _model_class()(vision_config, text_config, sizes)


def official_to_ours(state: Mapping[str, Any]) -> dict[str, Any]:
    """Convert an official ``ImageReward`` state dict (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
    ``mlp.layers.*``) to this module's names, dropping the keys the score does not use.

    Raises:
        ValueError: a key that belongs to neither layout.
    """
    out: dict[str, Any] = {}
    unknown = []
    for key, value in state.items():
        if key in IGNORED_OFFICIAL_KEYS or key.startswith(IGNORED_OFFICIAL_PREFIXES):
            continue
        if key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            if rest in _VISION_TOP_NAMES:
                out["vision." + _VISION_TOP_NAMES[rest]] = value
                continue
            parts = rest.split(".")
            if parts[0] == "blocks" and len(parts) >= 4:
                inner = ".".join(parts[2:-1])
                if inner in _VISION_BLOCK_NAMES:
                    out[f"vision.encoder.layers.{parts[1]}.{_VISION_BLOCK_NAMES[inner]}.{parts[-1]}"] = value
                    continue
            unknown.append(key)
        elif key.startswith("blip.text_encoder."):
            out["text." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"keys that are not part of an ImageReward checkpoint: {unknown[:10]}"
                         f"{' ...' if len(unknown) > 10 else ''}")
    return out


def ours_to_official(state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `official_to_ours` (without the dropped keys): this module's names to the official ones."""
    vision_top = {v: k for k, v in _VISION_TOP_NAMES.items()}
    vision_block = {v: k for k, v in _VISION_BLOCK_NAMES.items()}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key.startswith("vision."):
            rest = key.removeprefix("vision.")
            if rest in vision_top:
                out["blip.visual_encoder." + vision_top[rest]] = value
                continue
            parts = rest.split(".")  # encoder.layers.{i}.{name...}.{weight|bias}
            inner = ".".join(parts[3:-1])
            out[f"blip.visual_encoder.blocks.{parts[2]}.{vision_block[inner]}.{parts[-1]}"] = value
        elif key.startswith("text."):
            out["blip.text_encoder." + key.removeprefix("text.")] = value
        else:
            out[key] = value
    return out


def _architecture_from_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The ViT and MLP sizes of a converted state dict."""
    missing = [k for k in ("vision.embeddings.position_embedding", "vision.embeddings.patch_embedding.weight",
                           "mlp.layers.0.weight") if k not in state]
    if missing:
        raise ValueError(f"the ImageReward checkpoint lacks {missing}")
    pos = state["vision.embeddings.position_embedding"]
    patch = state["vision.embeddings.patch_embedding.weight"]
    width, patch_size = int(pos.shape[-1]), int(patch.shape[-1])
    grid = IMAGEREWARD_IMAGE_SIZE // patch_size
    if int(pos.shape[1]) != grid * grid + 1:
        raise ValueError(f"the checkpoint's ViT has {int(pos.shape[1]) - 1} patches; ImageReward runs at "
                         f"{IMAGEREWARD_IMAGE_SIZE} px ({grid * grid} patches of {patch_size})")
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("vision.encoder.layers."))
    inter = int(state["vision.encoder.layers.0.mlp.fc1.weight"].shape[0])
    mlp_sizes = [int(state["mlp.layers.0.weight"].shape[1])]
    for index in (0, 2, 4, 6, 7):
        key = f"mlp.layers.{index}.weight"
        if key not in state:
            raise ValueError(f"the ImageReward checkpoint lacks {key}")
        mlp_sizes.append(int(state[key].shape[0]))
    return dict(vision_width=width, vision_layers=layers, vision_intermediate=inter, patch_size=patch_size,
                mlp_sizes=mlp_sizes)


def load_imagereward_model(checkpoint: str | Path, med_config: str | Path | Mapping[str, Any],
                           vision_heads: int | None = None) -> Any:
    """The ImageReward model with the weights of an official checkpoint file (a ``torch.save``d state dict of the
    official ``ImageReward`` module), strictly: every weight must be there, and nothing else but the dropped keys.

    The ViT's width, depth and patch size and the head's sizes are read from the weights; the text encoder's from
    ``med_config`` (a path to ``med_config.json`` or its contents). The ViT's heads, which weights cannot tell, are
    ``vision_heads`` or, by default, ``width // 64`` (BLIP's ViT-B and ViT-L, 12 and 16 heads).
    """
    import torch

    if not isinstance(med_config, Mapping):
        med_config = json.loads(Path(med_config).read_text())
    raw = torch.load(Path(checkpoint), map_location="cpu", weights_only=True)
    if isinstance(raw, Mapping) and "state_dict" in raw and isinstance(raw["state_dict"], Mapping):
        raw = raw["state_dict"]
    if not isinstance(raw, Mapping):
        raise ValueError(f"{checkpoint} does not hold a state dict (got {type(raw).__name__})")
    state = official_to_ours({k.removeprefix("module."): v for k, v in raw.items()})
    model = build_imagereward_model(med_config, vision_heads=vision_heads, **_architecture_from_state(state))
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint} does not match the ImageReward architecture of its med_config: "
            f"missing {[ours_to_official({k: None}).popitem()[0] for k in missing[:10]]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
        )
    expected_shapes = model.state_dict()
    wrong = [f"{k}: {tuple(v.shape)} vs {tuple(expected_shapes[k].shape)}" for k, v in state.items()
             if tuple(v.shape) != tuple(expected_shapes[k].shape)]
    if wrong:
        raise ValueError(f"{checkpoint}: weights whose shapes do not match its med_config (checkpoint vs config): "
                         f"{wrong[:5]}; give the med_config.json released with the checkpoint")
    model.load_state_dict(state, strict=True)
    return model


# ---- the reward ---------------------------------------------------------------------------------------


@register_reward("imagereward")
class ImageReward(ModelReward):
    """ImageReward v1.0: ``(r - 0.16717) / 1.03334`` per (prompt, image), as the official ``score`` (see the
    module docstring for the model and the preprocessing). Differentiable: called with a float tensor ``(N, 3, H, W)``
    in [0, 1] it preprocesses in torch (`imagereward_pixels_from_tensor`) and returns scores that carry the gradient.

    Args:
        model_name_or_path: ``"THUDM/ImageReward"`` (default; any hub repo with ``ImageReward.pt``), the official
            name ``"ImageReward-v1.0"``, a local checkpoint file, or a local folder holding ``ImageReward.pt``.
        med_config: the text encoder's ``med_config.json`` (a file, or its contents as a dict). Default: the
            ``med_config.json`` beside the checkpoint (same folder or hub repo).
        tokenizer_name_or_path: the BERT tokenizer (default ``bert-base-uncased``); ``[DEC]`` and ``[ENC]`` are
            added as the official code does.
        device / reward_device, dtype, batch_size: placement (default CUDA when available, float32) and pairs per
            forward pass.
        vision_heads: the ViT's attention heads for a checkpoint other than BLIP's ViT-B / ViT-L (default
            ``width // 64``: 16 for ImageReward v1.0).
    """

    differentiable = True

    def __init__(
        self,
        model_name_or_path: str | Path = DEFAULT_IMAGEREWARD_REPO,
        med_config: str | Path | Mapping[str, Any] | None = None,
        tokenizer_name_or_path: str | Path = DEFAULT_IMAGEREWARD_TOKENIZER,
        device: Any = None,
        dtype: Any = None,
        batch_size: int = 32,
        reward_device: Any = None,
        vision_heads: int | None = None,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = (DEFAULT_IMAGEREWARD_REPO if str(model_name_or_path) in IMAGEREWARD_NAMES
                                   else model_name_or_path)
        self.med_config = med_config
        self.tokenizer_name_or_path = tokenizer_name_or_path
        self.vision_heads = vision_heads
        self.tokenizer: Any = None

    def _load(self, device: Any, dtype: Any) -> Any:
        checkpoint = resolve_model_file(self.model_name_or_path, IMAGEREWARD_CHECKPOINT, "imagereward checkpoint")
        med_config = self.med_config
        if med_config is None:
            source = self.model_name_or_path
            if Path(str(source)).expanduser().is_file():
                source = Path(str(source)).expanduser().parent
            med_config = resolve_model_file(source, IMAGEREWARD_MED_CONFIG, "imagereward med_config")
        model = load_imagereward_model(checkpoint, med_config, self.vision_heads)
        tokenizer = load_imagereward_tokenizer(self.tokenizer_name_or_path)
        vocab = model.text.config.vocab_size
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer {str(self.tokenizer_name_or_path)!r} has {len(tokenizer)} tokens (with "
                             f"[DEC]/[ENC]) but the text encoder's vocabulary has {vocab}; use the tokenizer the "
                             f"checkpoint was trained with (bert-base-uncased for ImageReward v1.0)")
        self.tokenizer = tokenizer
        model.to(device=device, dtype=dtype)
        model.mlp.float()  # the head runs in float32, as the official score (features cast with .float())
        return model

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        import torch

        return torch.cat([self._scores(prompts[sl], torch.stack([imagereward_pixels(im) for im in images[sl]]))
                          for sl in self.chunks(len(images))])

    def _score_tensor(self, prompts: list[str], images: Any, **columns: Any) -> Any:
        """The same score of float images ``(N, 3, H, W)`` in [0, 1] with gradient (`imagereward_pixels_from_tensor`)."""
        import torch

        return torch.cat([self._scores(prompts[sl], imagereward_pixels_from_tensor(images[sl]))
                          for sl in self.chunks(len(prompts))])

    def _scores(self, prompts: list[str], pixels: Any) -> Any:
        """The normalised score of each pair from preprocessed pixels ``(n, 3, 224, 224)``."""
        model = self.load()
        device = self.current_device
        dtype = model.vision.embeddings.patch_embedding.weight.dtype
        text = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=IMAGEREWARD_TEXT_MAX_LENGTH,
                              return_tensors="pt")
        raw = model(pixels.to(device, dtype), text["input_ids"].to(device), text["attention_mask"].to(device))
        return (raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
