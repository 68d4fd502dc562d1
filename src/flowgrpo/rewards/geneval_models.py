"""The models behind the `geneval` reward: an object detector (transformers) and a CLIP colour classifier.

Detector (`GenEvalDetector`), any transformers checkpoint, loaded lazily with ``from_pretrained`` (hub id or local
folder). Three kinds, chosen from the checkpoint's ``model_type``:

* **instance segmentation** (``mask2former``, ``maskformer``): GenEval's own setting. The image is resized as
  mmdet's Mask2Former test pipeline does (shortest edge 800, longest at most 1333, padded to a multiple of 32),
  and the outputs are post-processed as mmdet's ``MaskFormerFusionHead.instance_postprocess``: mask logits
  upsampled (bilinear) to the padded input, cropped to the resized image, upsampled to the original size;
  ``p = softmax(class logits)`` without the no-object class; the top 100 (query, class) pairs by ``p``; mask
  ``m = logits > 0``; score ``p * mean(sigmoid(logits) over m)``; box = the mask's extent
  ``(x_min, y_min, x_max + 1, y_max + 1)`` (zeros for an empty mask). Every one of the 100 is returned (the mask
  only for those above 0.3, the lowest threshold: the others can never be colour-checked);
  `flowgrpo.rewards.geneval.judge` does the thresholding. The transformers processor makes the resized size a
  multiple of 32 by resizing (mmdet pads instead): identical for square images such as GenEval's 512 x 512.
* **zero-shot detection** (``owlv2``, ``owlvit``, ``grounding-dino``, ``mm-grounding-dino``): the 80 GenEval names
  are the text queries (``"a photo of a {name}"`` for OWL; ``"name. name. ..."`` in chunks for Grounding DINO);
  boxes from the processor's ``post_process_grounded_object_detection``, no masks.
* **object detection** (anything ``AutoModelForObjectDetection`` loads: DETR, Deformable DETR, Conditional DETR,
  RT-DETR, YOLOS, ...): boxes from the image processor's ``post_process_object_detection``, no masks.

Detector label names are mapped onto GenEval's 80 names with `flowgrpo.rewards.geneval.geneval_label`; labels
GenEval does not use (``N/A``, stuff classes) are dropped.

Colour (`CLIPColourClassifier`), as GenEval's ``color_classification`` with open_clip ViT-L-14 (OpenAI weights),
here ``openai/clip-vit-large-patch14`` through transformers: the object is pasted on a ``#999`` grey image through
its mask (the whole image when there is no mask), cropped to its box (PIL rounds the box), resized so its
shorter side is the CLIP input size (bicubic), centre-cropped, scaled to [0, 1] and normalised with the CLIP mean
and std. For each colour c the text embedding is the normalised mean of the normalised embeddings of "a photo of a
{c} {object}", "a photo of a {c}-colored {object}" and "a photo of a {c} object"; the colour is the argmax of
``100 * image_embedding . text_embedding``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from .geneval_labels import GENEVAL_COLORS, GENEVAL_OBJECT_NAMES, THRESHOLD, Detection, geneval_label
from .placement import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

__all__ = ["CLIPColourClassifier", "GenEvalDetector", "crop_object", "mask_to_box"]

INSTANCE_SEGMENTATION_TYPES = ("mask2former", "maskformer")
ZERO_SHOT_TYPES = ("owlv2", "owlvit", "grounding-dino", "mm-grounding-dino")
COLOR_TEMPLATES = ("a photo of a {c} {object}", "a photo of a {c}-colored {object}", "a photo of a {c} object")
BACKGROUND = "#999"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def mask_to_box(masks: Any) -> Any:
    """Boxes ``(x_min, y_min, x_max + 1, y_max + 1)`` of boolean masks ``(N, H, W)`` (a float tensor ``(N, 4)``;
    zeros for an empty mask), as mmdet's ``mask2bbox``."""
    import torch

    n, h, w = masks.shape
    boxes = torch.zeros((n, 4), dtype=torch.float32, device=masks.device)
    if n == 0:
        return boxes
    cols = masks.any(dim=1)  # (N, W)
    rows = masks.any(dim=2)  # (N, H)
    nonempty = cols.any(dim=1) & rows.any(dim=1)
    xs = torch.arange(w, device=masks.device)
    ys = torch.arange(h, device=masks.device)
    x_min = torch.where(cols, xs, w).min(dim=1).values
    x_max = torch.where(cols, xs, -1).max(dim=1).values
    y_min = torch.where(rows, ys, h).min(dim=1).values
    y_max = torch.where(rows, ys, -1).max(dim=1).values
    stacked = torch.stack([x_min, y_min, x_max + 1, y_max + 1], dim=1).float()
    boxes[nonempty] = stacked[nonempty]
    return boxes


def crop_object(image: Image.Image, box: Sequence[float], mask: Any = None, background: str = BACKGROUND
                ) -> Image.Image:
    """The object as GenEval's colour classifier sees it: ``image`` pasted on a ``background`` image through
    ``mask`` (``(H, W)`` booleans; ``None`` keeps the whole image), then cropped to ``box`` (PIL rounds it)."""
    image = image.convert("RGB")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (image.height, image.width):
            raise ValueError(f"mask of shape {mask.shape} for an image of {image.width}x{image.height}; masks must be "
                             f"(height, width) of the image")
        blank = Image.new("RGB", image.size, color=background)
        image = Image.composite(image, blank, Image.fromarray(mask))
    # PIL's crop rounds the box; an object under half a pixel wide would give an empty crop: keep one pixel.
    x0, y0, x1, y1 = (int(round(float(v))) for v in list(box)[:4])
    return image.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)))


class GenEvalDetector:
    """A transformers detector returning, for each image, its detections as `Detection` objects (GenEval labels,
    boxes in pixels, masks where the detector gives them); see the module docstring.

    Args:
        model_id: hub id or local folder of the detector (and its processor).
        device, dtype: where and in which precision the detector runs (post-processing runs in float32).
        batch_size: images per forward pass.
        image_size: shortest edge the images are resized to for instance segmentation models (longest edge at most
            ``image_size * 1333 / 800``), as mmdet's Mask2Former test pipeline (800); ``None`` keeps the
            processor's own setting.
        max_per_image: (query, class) pairs kept per image by instance segmentation (mmdet's ``max_per_image``).
        threshold: score threshold passed to the post-processing of the other detectors (the rules threshold
            again at 0.3 / 0.9).
    """

    def __init__(self, model_id: str, device: Any = None, dtype: Any = None, batch_size: int = 8,
                 image_size: int | None = 800, max_per_image: int = 100, threshold: float = 0.05):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_id = str(model_id)
        self.device_name = device
        self.dtype_name = dtype
        self.batch_size = int(batch_size)
        self.image_size = image_size
        self.max_per_image = int(max_per_image)
        self.threshold = float(threshold)
        self.kind: str | None = None
        self._model: Any = None
        self._processor: Any = None
        self._labels: list[str | None] = []
        self._lock = threading.Lock()

    # ---- loading ----------------------------------------------------------------------------------------

    def load(self) -> GenEvalDetector:
        """Load the model and processor (once)."""
        with self._lock:
            if self._model is not None:
                return self
            import transformers

            config = transformers.AutoConfig.from_pretrained(self.model_id)
            model_type = getattr(config, "model_type", "")
            device, dtype = resolve_device(self.device_name), resolve_dtype(self.dtype_name)
            if model_type in INSTANCE_SEGMENTATION_TYPES:
                import importlib.util

                if importlib.util.find_spec("scipy") is None:
                    raise ImportError(f"the {model_type} detector of the geneval reward needs scipy (transformers builds "
                                      f"its matcher with it): pip install 'flowgrpo[geneval]'")
                kind = "instance"
                model_cls = transformers.AutoModelForUniversalSegmentation
                processor = transformers.AutoImageProcessor.from_pretrained(self.model_id)
            elif model_type in ZERO_SHOT_TYPES:
                kind = "zero_shot"
                model_cls = transformers.AutoModelForZeroShotObjectDetection
                processor = transformers.AutoProcessor.from_pretrained(self.model_id)
            else:
                kind = "detection"
                model_cls = transformers.AutoModelForObjectDetection
                processor = transformers.AutoImageProcessor.from_pretrained(self.model_id)
            model = model_cls.from_pretrained(self.model_id, dtype=dtype)
            model.to(device).eval().requires_grad_(False)
            if kind != "zero_shot":
                id2label = dict(getattr(model.config, "id2label", {}) or {})
                n = max((int(k) for k in id2label), default=-1) + 1
                self._labels = [geneval_label(str(id2label.get(i, id2label.get(str(i), "")))) for i in range(n)]
                missing = sorted(set(GENEVAL_OBJECT_NAMES) - {lab for lab in self._labels if lab})
                if len(missing) == len(GENEVAL_OBJECT_NAMES):
                    raise ValueError(
                        f"detector {self.model_id!r} has no label GenEval knows (its labels: "
                        f"{list(id2label.values())[:10]}...); use a COCO detector or a zero-shot one (OWLv2, Grounding "
                        f"DINO)")
                if missing:
                    logger.warning("detector %r cannot detect %d of GenEval's objects (%s): clauses about them fail",
                                   self.model_id, len(missing), ", ".join(missing[:10]))
            self.kind, self._model, self._processor = kind, model, processor
        return self

    @property
    def model(self) -> Any:
        return self.load()._model

    # ---- detection ----------------------------------------------------------------------------------------

    def __call__(self, images: Sequence[Image.Image]) -> list[list[Detection]]:
        """Every detection of every image (unfiltered: `judge` thresholds them)."""
        import torch

        self.load()
        images = [im.convert("RGB") for im in images]
        out: list[list[Detection]] = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                batch = images[start:start + self.batch_size]
                if self.kind == "instance":
                    out.extend(self._detect_instances(batch))
                elif self.kind == "zero_shot":
                    out.extend(self._detect_zero_shot(batch))
                else:
                    out.extend(self._detect_boxes(batch))
        return out

    def _detect_instances(self, images: list[Image.Image]) -> list[list[Detection]]:
        import torch
        import torch.nn.functional as F

        model, processor = self._model, self._processor
        kwargs = {}
        if self.image_size is not None:
            kwargs["size"] = {"shortest_edge": int(self.image_size),
                              "longest_edge": int(round(self.image_size * 1333 / 800))}
        inputs = processor(images=images, return_tensors="pt", **kwargs)
        pixel_values = inputs["pixel_values"].to(model.device, model.dtype)
        pixel_mask = inputs.get("pixel_mask")
        outputs = model(pixel_values=pixel_values,
                        pixel_mask=pixel_mask.to(model.device) if pixel_mask is not None else None)
        class_logits = outputs.class_queries_logits.float()
        num_classes = class_logits.shape[-1] - 1
        results = []
        for i, image in enumerate(images):
            if pixel_mask is not None:
                valid = pixel_mask[i].bool()
                h = int(valid.any(dim=1).sum())
                w = int(valid.any(dim=0).sum())
            else:
                h, w = pixel_values.shape[-2:]
            # One image at a time: 100 masks at the padded input size are large.
            logits = F.interpolate(outputs.masks_queries_logits[i:i + 1].float(), size=pixel_values.shape[-2:],
                                   mode="bilinear", align_corners=False)[0, :, :h, :w]
            logits = F.interpolate(logits[None], size=(image.height, image.width), mode="bilinear",
                                   align_corners=False)[0]
            probs = class_logits[i].softmax(dim=-1)[:, :-1]
            k = min(self.max_per_image, probs.numel())
            top_scores, top_index = probs.flatten().topk(k, sorted=False)
            labels = top_index % num_classes
            queries = torch.div(top_index, num_classes, rounding_mode="floor")
            logits = logits[queries]
            masks = logits > 0
            mask_scores = (logits.sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)
            scores = top_scores * mask_scores
            boxes = mask_to_box(masks)
            dets = []
            for j, (label, box, score) in enumerate(zip(labels.tolist(), boxes.cpu().tolist(), scores.cpu().tolist())):
                name = self._labels[label] if label < len(self._labels) else None
                if name is not None:
                    # Only a detection above the lowest threshold can be colour-checked: keep its mask alone.
                    mask = masks[j].cpu().numpy() if score > THRESHOLD else None
                    dets.append(Detection(label=name, box=tuple(box), score=float(score), mask=mask))
            results.append(dets)
        return results

    def _detect_boxes(self, images: list[Image.Image]) -> list[list[Detection]]:
        model, processor = self._model, self._processor
        inputs = processor(images=images, return_tensors="pt")
        inputs = {k: (v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device))
                  for k, v in inputs.items() if hasattr(v, "to")}
        outputs = model(**inputs)
        for name in ("logits", "pred_boxes"):
            if getattr(outputs, name, None) is not None:
                setattr(outputs, name, getattr(outputs, name).float())
        processed = processor.post_process_object_detection(
            outputs, threshold=self.threshold, target_sizes=[(im.height, im.width) for im in images])
        results = []
        for res in processed:
            dets = []
            for label, box, score in zip(res["labels"].tolist(), res["boxes"].tolist(), res["scores"].tolist()):
                name = self._labels[label] if 0 <= label < len(self._labels) else None
                if name is not None:
                    dets.append(Detection(label=name, box=tuple(box), score=float(score)))
            results.append(dets)
        return results

    def _detect_zero_shot(self, images: list[Image.Image]) -> list[list[Detection]]:
        model, processor = self._model, self._processor
        model_type = str(getattr(model.config, "model_type", ""))
        grounding = "grounding" in model_type
        # OWLv2 pads each image to a square before predicting: its boxes are relative to that square.
        sizes = [(max(im.size),) * 2 if model_type == "owlv2" else (im.height, im.width) for im in images]
        results: list[list[Detection]] = [[] for _ in images]
        # Grounding DINO reads one caption of at most 256 tokens: the names go in chunks. OWL takes them all at once.
        chunks = ([list(GENEVAL_OBJECT_NAMES[s:s + 20]) for s in range(0, len(GENEVAL_OBJECT_NAMES), 20)]
                  if grounding else [list(GENEVAL_OBJECT_NAMES)])
        for names in chunks:
            if grounding:
                text = [". ".join(names) + "." for _ in images]
            else:
                text = [[f"a photo of a {n}" for n in names] for _ in images]
            inputs = processor(images=images, text=text, return_tensors="pt", padding=True)
            inputs = {k: (v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device))
                      for k, v in inputs.items() if hasattr(v, "to")}
            outputs = model(**inputs)
            if grounding:
                processed = processor.post_process_grounded_object_detection(
                    outputs, inputs["input_ids"], threshold=self.threshold, text_threshold=self.threshold,
                    target_sizes=sizes)
            else:
                processed = processor.post_process_grounded_object_detection(
                    outputs, threshold=self.threshold, target_sizes=sizes)
            for i, res in enumerate(processed):
                text_labels = res.get("text_labels")
                for j, (box, score) in enumerate(zip(res["boxes"].tolist(), res["scores"].tolist())):
                    if grounding:
                        name = geneval_label(text_labels[j]) if text_labels is not None else None
                    else:
                        label = int(res["labels"][j])
                        name = names[label] if 0 <= label < len(names) else None
                    if name is not None:
                        results[i].append(Detection(label=name, box=tuple(box), score=float(score)))
        return results


class CLIPColourClassifier:
    """Zero-shot colour of object crops with a transformers CLIP model (see the module docstring).

    Args:
        model_id: hub id or local folder of a ``CLIPModel`` with its tokenizer (and image processor config for the
            mean, std and input size; OpenAI CLIP's values otherwise).
        device, dtype: placement and precision.
        batch_size: crops per forward pass (16, as GenEval).
    """

    def __init__(self, model_id: str, device: Any = None, dtype: Any = None, batch_size: int = 16):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_id = str(model_id)
        self.device_name = device
        self.dtype_name = dtype
        self.batch_size = int(batch_size)
        self._model: Any = None
        self._tokenizer: Any = None
        self._mean = np.asarray(OPENAI_CLIP_MEAN, dtype=np.float32)
        self._std = np.asarray(OPENAI_CLIP_STD, dtype=np.float32)
        self._size = 224
        self._text_weights: dict[str, Any] = {}
        self._lock = threading.Lock()

    def load(self) -> CLIPColourClassifier:
        with self._lock:
            if self._model is not None:
                return self
            from transformers import AutoTokenizer, CLIPModel

            model = CLIPModel.from_pretrained(self.model_id, dtype=resolve_dtype(self.dtype_name))
            model.to(resolve_device(self.device_name)).eval().requires_grad_(False)
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_id)
            self._size = int(model.config.vision_config.image_size)
            try:
                from transformers import AutoImageProcessor

                processor = AutoImageProcessor.from_pretrained(self.model_id)
                if getattr(processor, "image_mean", None) is not None:
                    self._mean = np.asarray(processor.image_mean, dtype=np.float32)
                    self._std = np.asarray(processor.image_std, dtype=np.float32)
            except (OSError, ValueError):  # no image processor saved: OpenAI CLIP's normalisation
                pass
            self._model = model
        return self

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """``(3, S, S)`` float32: shorter side resized to S (bicubic), centre crop S, [0, 1], normalised."""
        size = self._size
        image = image.convert("RGB")
        w, h = image.size
        if w <= h:
            new_w, new_h = size, int(size * h / w)
        else:
            new_w, new_h = int(size * w / h), size
        image = image.resize((new_w, new_h), Image.BICUBIC)
        top = int(round((new_h - size) / 2.0))
        left = int(round((new_w - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
        array = np.asarray(image, dtype=np.float32) / 255.0
        array = (array - self._mean) / self._std
        return array.transpose(2, 0, 1)

    def _class_weights(self, classname: str) -> Any:
        """``(D, 10)``: per colour the normalised mean of the normalised template embeddings."""
        import torch

        if classname in self._text_weights:
            return self._text_weights[classname]
        model = self._model
        columns = []
        for color in GENEVAL_COLORS:
            texts = [t.format(c=color, object=classname) for t in COLOR_TEMPLATES]
            tokens = self._tokenizer(texts, padding=True, truncation=True, return_tensors="pt",
                                     max_length=model.config.text_config.max_position_embeddings)
            feats = _features(model.get_text_features(input_ids=tokens["input_ids"].to(model.device),
                                                      attention_mask=tokens["attention_mask"].to(model.device)))
            feats = torch.nn.functional.normalize(feats.float(), dim=-1).mean(dim=0)
            columns.append(feats / feats.norm())
        weights = torch.stack(columns, dim=1)
        self._text_weights[classname] = weights
        return weights

    def __call__(self, crops: Sequence[Image.Image], classnames: Sequence[str]) -> list[str]:
        """The colour of each crop (an object of class ``classnames[i]``), one of `GENEVAL_COLORS`."""
        import torch

        if len(crops) != len(classnames):
            raise ValueError(f"{len(crops)} crops for {len(classnames)} class names")
        self.load()
        model = self._model
        colors: list[str] = []
        with torch.inference_mode():
            for start in range(0, len(crops), self.batch_size):
                chunk = crops[start:start + self.batch_size]
                names = classnames[start:start + self.batch_size]
                pixels = torch.from_numpy(np.stack([self.preprocess(c) for c in chunk])).to(model.device, model.dtype)
                feats = torch.nn.functional.normalize(_features(model.get_image_features(pixel_values=pixels)).float(),
                                                      dim=-1)
                for feat, name in zip(feats, names):
                    logits = 100.0 * feat @ self._class_weights(name)
                    colors.append(GENEVAL_COLORS[int(logits.argmax())])
        return colors


def _features(output: Any) -> Any:
    from .clip_scorers import model_features as features

    return features(output)
