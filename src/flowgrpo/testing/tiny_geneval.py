"""Tiny random GenEval models, built offline: a Mask2Former instance-segmentation detector (tiny Swin backbone, the
80 COCO classes with COCO's label names) and a CLIP model with a locally learned tokenizer.

They have the architectures of ``facebook/mask2former-swin-small-coco-instance`` and ``openai/clip-vit-large-patch14``
at a few hundred kB, and are saved with ``save_pretrained`` so that the `geneval` reward loads them by path exactly as
it loads the real checkpoints::

    from flowgrpo.testing.tiny_geneval import save_tiny_geneval_models

    paths = save_tiny_geneval_models("/tmp/geneval-models")
    reward = get_reward("geneval", detector=paths["detector"], clip_model=paths["clip"], detector_image_size=64)

Random weights detect nothing meaningful; the detector's class bias can be set (``person_bias``) so that its queries
favour one class with a high score, which lets a test reach the colour and position paths.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["save_tiny_clip", "save_tiny_detr", "save_tiny_geneval_models", "save_tiny_mask2former", "save_tiny_owlv2"]


def save_tiny_mask2former(folder: str | os.PathLike[str], seed: int = 0, favoured_class: int | None = None,
                          num_queries: int = 12) -> str:
    """A random Mask2Former (Swin backbone, 80 COCO labels) with its image processor, saved to ``folder``.

    ``favoured_class``: when given, the class head's bias makes every query predict this COCO class index with
    a probability near 1 (so that the detections pass GenEval's thresholds)."""
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig
    from transformers.models.mask2former.image_processing_pil_mask2former import Mask2FormerImageProcessorPil

    from ..rewards.geneval import COCO_OBJECT_NAMES

    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(
        backbone_config=backbone, num_labels=len(COCO_OBJECT_NAMES), num_queries=num_queries, hidden_dim=32,
        mask_feature_size=32, feature_size=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
        dim_feedforward=32, encoder_feedforward_dim=32, common_stride=4,
        id2label=dict(enumerate(COCO_OBJECT_NAMES)), label2id={n: i for i, n in enumerate(COCO_OBJECT_NAMES)},
    )
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    if favoured_class is not None:
        with torch.no_grad():
            head = model.class_predictor
            head.weight.mul_(0.01)
            head.bias.fill_(-10.0)
            head.bias[favoured_class] = 10.0
    folder = Path(folder)
    model.save_pretrained(folder)
    Mask2FormerImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 128}, size_divisor=32).save_pretrained(folder)
    return str(folder)


def save_tiny_clip(folder: str | os.PathLike[str], seed: int = 0) -> str:
    """A random CLIP (32 px input) with a locally learned CLIP tokenizer and image processor, saved to ``folder``."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from .tiny_tokenizers import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    vocab = tokenizer.get_vocab()
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return str(folder)


def save_tiny_geneval_models(folder: str | os.PathLike[str], seed: int = 0,
                             favoured_class: int | None = None) -> dict[str, str]:
    """Both tiny models under ``folder`` (``detector/`` and ``clip/``); returns ``{"detector": path, "clip": path}``."""
    folder = Path(folder)
    return {
        "detector": save_tiny_mask2former(folder / "detector", seed=seed, favoured_class=favoured_class),
        "clip": save_tiny_clip(folder / "clip", seed=seed),
    }


def save_tiny_detr(folder: str | os.PathLike[str], seed: int = 0, favoured_class: int | None = None) -> str:
    """A random DETR (tiny ResNet backbone) with COCO's 91-id label map (``N/A`` gaps included, as
    ``facebook/detr-resnet-50``) and its image processor: a box-only detector. ``favoured_class``: a COCO class
    index (0..79) every query then predicts with a probability near 1."""
    import torch
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig
    from transformers.models.detr.image_processing_pil_detr import DetrImageProcessorPil

    from ..rewards.geneval import COCO_OBJECT_NAMES

    labels = dict(enumerate(("N/A",) + COCO_OBJECT_NAMES))
    config = DetrConfig(
        use_timm_backbone=False,
        backbone_config=ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
                                     layer_type="basic", out_features=["stage4"]),
        num_queries=10, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
        id2label=labels, label2id={name: i for i, name in labels.items()},
    )
    torch.manual_seed(seed)
    model = DetrForObjectDetection(config).eval()
    if favoured_class is not None:
        with torch.no_grad():
            head = model.class_labels_classifier
            head.weight.mul_(0.01)
            head.bias.fill_(-10.0)
            head.bias[favoured_class + 1] = 10.0  # id 0 is "N/A"
    folder = Path(folder)
    model.save_pretrained(folder)
    DetrImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(folder)
    return str(folder)


def save_tiny_owlv2(folder: str | os.PathLike[str], seed: int = 0) -> str:
    """A random OWLv2 (zero-shot detector, 32 px input) with a locally learned CLIP tokenizer, saved to ``folder``."""
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2Processor
    from transformers.models.owlv2.image_processing_pil_owlv2 import Owlv2ImageProcessorPil

    from .tiny_tokenizers import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    vocab = tokenizer.get_vocab()
    eos = vocab["<|endoftext|>"]
    config = Owlv2Config(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = Owlv2ForObjectDetection(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    Owlv2Processor(image_processor=Owlv2ImageProcessorPil(size={"height": 32, "width": 32}),
                   tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)
