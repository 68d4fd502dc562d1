"""`geneval`: GenEval's compositional rules (objects, counts, colours, positions) as a reward and as a benchmark
scorer, without mmdet.

Two parts:

* **The rules** (`judge`, pure Python + numpy) turn one image's detections and one line of GenEval's
  ``evaluation_metadata.jsonl`` into four fields:

  - ``correct``: the official verdict of ``evaluation/evaluate_images.py`` in djghosh13/geneval (read at commit
    ``af4902f24d3ca90ebbb446dd9891a59e0f82725f``);
  - ``strict_correct`` and ``score``: Flow-GRPO's training reward, ``evaluate_reward`` of its GenEval reward
    server (yifan123/reward-server ``reward_server/gen_eval.py`` at commit
    ``92ac29fb322c028f8840db8f93c950422931710d``), quirks included;
  - ``reason``: the official reason string (clauses that failed, one per line; ``""`` when correct).

* **The reward** `GenEvalReward` (registered as ``geneval``) detects objects with a transformers detector
  (Mask2Former Swin-S COCO instance segmentation by default), classifies the colour of the objects a clause asks
  a colour of with CLIP ViT-L/14, and applies the rules. See `flowgrpo.rewards.geneval_models` for the models.

Filtering (official, done by `judge` itself): for each of the 80 object classes, its detections are ordered by
``numpy.argsort(scores)[::-1]`` (descending; numpy's default sort, so ties come out as numpy orders them), kept
when ``score > 0.3`` (``> 0.9`` for every class when the tag is ``counting``), at most 16 per class, no NMS.

``correct`` (official). Include clauses are ANDed, exclude clauses ORed. For an include ``{class, count[,
color][, position]}``, take the top ``count`` kept detections of the class:

* fewer than ``count``: fails (``expected {class}>={count}, found {n}``);
* colour: fails unless at least ``count`` of them have the colour;
* position ``[rel, g]`` (only if the clause still holds): fails when include ``g`` failed
  (``no target for ...``), else every (object, target) pair is checked with `relative_position`; the first pair
  without ``rel`` fails the clause.

An exclude ``{class, count}`` fails when the kept detections of the class number ``>= count``.

`relative_position(a, b)` (of box a against box b, boxes ``(x0, y0, x1, y1)`` in pixels, y down): ``o`` the
offset of the box centres, ``d = 0.1 * (size_a + size_b)`` per axis, ``r = max(|o| - d, 0) * sign(o)``. No
relation when both ``|r| < 1e-3``; else ``(dx, dy) = r / ||o||`` (divided by the norm of the *original* offset)
and ``dx < -0.5`` is "left of", ``dx > 0.5`` "right of", ``dy < -0.5`` "above", ``dy > 0.5`` "below".

``strict_correct`` and ``score`` (Flow-GRPO's ``evaluate_reward``; excludes are ignored). For each include,
with ``n`` the number of kept detections of its class (all of them, up to 16, not the top ``count``) and
``c = count``, terms are appended to a list whose mean is ``score``:

* ``1 - |c - n| / c`` (not clipped: 16 detections of a class asked once give -14);
* if ``n != c``: the clause fails and, if it has a colour or a position, one more term ``0.0``;
* else colour: ``1 - |c - k| / c`` with ``k`` the objects of the colour; fails unless ``k == c``;
* else position (only if the clause still holds): target include failed -> ``0.0``; else the pairs are checked
  as above and the first failing pair appends ``0.0``; then ``1.0`` is appended whether a pair failed or not
  (a pass adds ``[1.0]``, a failure ``[0.0, 1.0]``).

``strict_correct`` holds when every include holds. No include: ``score`` 0.

``partial_credit="corrected"`` changes two things in ``score`` (``strict_correct`` is the same): the count term is
clipped at 0 (``max(0, 1 - |c - n| / c)``), and a failed position check adds only ``0.0`` (a pass adds ``1.0``).
The default ``"reference"`` reproduces the published recipes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .geneval_labels import (  # noqa: F401  (part of this module's interface)
    COCO_OBJECT_NAMES,
    COUNTING_THRESHOLD,
    GENEVAL_COLORS,
    GENEVAL_COMMIT,
    GENEVAL_OBJECT_NAMES,
    GENEVAL_TAGS,
    MAX_OBJECTS,
    PARTIAL_CREDIT_MODES,
    POSITION_THRESHOLD,
    RELATIONS,
    THRESHOLD,
    Detection,
    geneval_label,
)
from .registry import register_reward

logger = logging.getLogger(__name__)

__all__ = [
    "RESULT_FIELDS",
    "GENEVAL_COLORS",
    "GENEVAL_COMMIT",
    "GENEVAL_OBJECT_NAMES",
    "GENEVAL_TAGS",
    "COCO_OBJECT_NAMES",
    "Detection",
    "GenEvalReward",
    "Judgement",
    "filter_detections",
    "format_geneval_summary",
    "geneval_label",
    "judge",
    "normalize_metadata",
    "relative_position",
    "summarize_geneval",
]

@dataclass(frozen=True)
class Judgement:
    """The verdict on one image (see the module docstring).

    ``reason`` is the official reason (``evaluate_images.py``); ``strict_reason`` the one of Flow-GRPO's
    ``evaluate_reward`` (the same clauses judged by the strict rules). ``details`` are the kept boxes per class as
    the official ``results.jsonl`` stores them: ``{class: [[x0, y0, x1, y1, score], ...]}``."""

    correct: bool
    strict_correct: bool
    score: float
    reason: str
    strict_reason: str = ""
    details: dict[str, list[list[float]]] = field(default_factory=dict)


def _parse_json_value(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"GenEval metadata {what} is a string but not JSON: {value[:80]!r}") from None
    return value


def _clean_clause(clause: Any, kind: str, index: int) -> dict:
    clause = _parse_json_value(clause, f"{kind}[{index}]")
    if not isinstance(clause, Mapping):
        raise ValueError(f"GenEval metadata {kind}[{index}] must be an object like {{'class': 'dog', 'count': 1}}, "
                         f"got {clause!r}")
    # Tables (datasets/Arrow) give every clause every key, None where a line had none: drop those.
    out = {k: v for k, v in clause.items() if v is not None}
    cls, count = out.get("class"), out.get("count")
    if not isinstance(cls, str):
        raise ValueError(f"GenEval metadata {kind}[{index}] needs a 'class' name, got {clause!r}")
    if isinstance(count, float) and count.is_integer():
        out["count"] = count = int(count)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"GenEval metadata {kind}[{index}] needs a positive integer 'count', got {clause!r}")
    if "color" in out and out["color"] not in GENEVAL_COLORS:
        raise ValueError(f"GenEval metadata {kind}[{index}] has colour {out['color']!r}; GenEval's colours are "
                         f"{list(GENEVAL_COLORS)}")
    if "position" in out:
        pos = out["position"]
        if (not isinstance(pos, (list, tuple)) or len(pos) != 2 or pos[0] not in RELATIONS
                or isinstance(pos[1], bool) or not isinstance(pos[1], (int, float)) or int(pos[1]) != pos[1]
                or not 0 <= int(pos[1]) < index):
            raise ValueError(f"GenEval metadata {kind}[{index}] has position {pos!r}; expected [relation, index of "
                             f"an earlier include] with relation one of {list(RELATIONS)}")
        out["position"] = [pos[0], int(pos[1])]
    return out


def normalize_metadata(metadata: Mapping[str, Any]) -> dict:
    """One GenEval metadata line as the rules read it, checked.

    Accepts the dict of a line of ``evaluation_metadata.jsonl`` as is, and also what tables make of it: ``include``
    / ``exclude`` given as JSON strings, ``None`` for a missing ``exclude``, and clauses padded with ``None``-valued
    keys (dropped). Key order is kept, so ``json.dumps`` of a clean line is unchanged.

    Raises:
        ValueError: not a mapping, no ``tag``, or a malformed clause (the message names it).
    """
    if not isinstance(metadata, Mapping):
        raise ValueError(f"GenEval metadata must be a dict (one line of evaluation_metadata.jsonl), got "
                         f"{type(metadata).__name__}")
    if not isinstance(metadata.get("tag"), str):
        raise ValueError(f"GenEval metadata needs a 'tag' (one of {list(GENEVAL_TAGS)}), got {dict(metadata)!r}")
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if key in ("include", "exclude"):
            if value is None:
                continue
            value = _parse_json_value(value, key)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"GenEval metadata {key!r} must be a list of clauses, got {value!r}")
            out[key] = [_clean_clause(c, key, i) for i, c in enumerate(value)]
        else:
            out[key] = value
    return out


def _as_detection(det: Any, index: int) -> Detection:
    if not isinstance(det, Detection):
        raise TypeError(f"detection {index} is a {type(det).__name__}; build it as Detection(label=, box=, score=)")
    if det.label not in _CLASS_INDEX:
        hint = geneval_label(det.label)
        fix = f" (GenEval calls it {hint!r})" if hint else ""
        raise ValueError(f"detection {index} has label {det.label!r}, which is not one of GenEval's 80 object "
                         f"names{fix}; map detector labels with flowgrpo.rewards.geneval.geneval_label")
    if det.color is not None and det.color not in GENEVAL_COLORS:
        raise ValueError(f"detection {index} has colour {det.color!r}; use one of {list(GENEVAL_COLORS)} or None")
    if len(det.box) != 4:
        raise ValueError(f"detection {index} has box {det.box!r}; expected (x0, y0, x1, y1)")
    return det


_CLASS_INDEX = {name: i for i, name in enumerate(GENEVAL_OBJECT_NAMES)}


def filter_detections(detections: Iterable[Detection], tag: str) -> dict[str, list[Detection]]:
    """The official filtering: per class (in GenEval's class order; classes with nothing kept are absent), the
    detections ordered by ``numpy.argsort(score)[::-1]``, those with ``score > 0.3`` (``> 0.9`` when ``tag`` is
    ``"counting"``), at most 16. Detections of a class keep their input order before sorting, which decides ties."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    per_class: dict[str, list[Detection]] = {}
    for i, det in enumerate(detections):
        det = _as_detection(det, i)
        per_class.setdefault(det.label, []).append(det)
    kept: dict[str, list[Detection]] = {}
    for name in GENEVAL_OBJECT_NAMES:
        dets = per_class.get(name)
        if not dets:
            continue
        # One row per detection, the score in column 4, as the official per-class arrays.
        rows = np.array([[*map(float, d.box), float(d.score)] for d in dets], dtype=np.float64)
        ordering = np.argsort(rows[:, 4])[::-1]
        ordering = ordering[rows[ordering, 4] > threshold]
        ordering = ordering[:MAX_OBJECTS].tolist()
        if ordering:
            kept[name] = [dets[j] for j in ordering]
    return kept


def relative_position(box_a: Sequence[float], box_b: Sequence[float]) -> set[str]:
    """Relations of box a to box b (subset of ``{"left of", "right of", "above", "below"}``); see the module
    docstring for the formula (shrink 0.1, dead zone 1e-3, threshold 0.5 of the original offset's norm)."""
    boxes = np.array([list(box_a)[:4], list(box_b)[:4]], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    # Built in this order so that the set (and a reason joining it) iterates exactly like the official one.
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _colour_failure(clause: dict, colors: list) -> str:
    wanted = clause["color"]
    found = colors.count(wanted)
    others = ", ".join(f"{colors.count(c)} {c}" for c in GENEVAL_COLORS if c in colors)
    return f"expected {wanted} {clause['class']}>={clause['count']}, found {found} {wanted}; and {others}"


def _first_failed_pair(objects: list[Detection], targets: list[Detection], relation: str) -> str | None:
    """The reason for the first (object, target) pair lacking ``relation``, or None when all pairs have it."""
    for obj in objects:
        for target in targets:
            relations = relative_position(obj.box, target.box)
            if relation not in relations:
                return f"{' and '.join(relations)}"
    return None


def _official_verdict(kept: dict[str, list[Detection]], metadata: dict) -> tuple[bool, str]:
    """``evaluate`` of ``evaluate_images.py``: (correct, reason)."""
    correct = True
    reasons: list[str] = []
    groups: list[list[Detection] | None] = []
    for clause in metadata.get("include", []):
        name, count = clause["class"], clause["count"]
        holds = True
        found = kept.get(name, [])[:count]
        if len(found) < count:
            correct = holds = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                colors = [d.color for d in found]
                if colors.count(clause["color"]) < count:
                    correct = holds = False
                    reasons.append(_colour_failure(clause, colors))
            if "position" in clause and holds:
                relation, target = clause["position"]
                if groups[target] is None:
                    correct = holds = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    got = _first_failed_pair(found, groups[target], relation)
                    if got is not None:
                        correct = holds = False
                        reasons.append(f"expected {name} {relation} target, found {got} target")
        groups.append(found if holds else None)
    for clause in metadata.get("exclude", []):
        name, count = clause["class"], clause["count"]
        if len(kept.get(name, [])) >= count:
            correct = False
            reasons.append(f"expected {name}<{count}, found {len(kept[name])}")
    return correct, "\n".join(reasons)


def _training_verdict(kept: dict[str, list[Detection]], metadata: dict, partial_credit: str) -> tuple[bool, float, str]:
    """``evaluate_reward`` of Flow-GRPO's GenEval server: (strict_correct, score, reason)."""
    corrected = partial_credit == "corrected"
    correct = True
    reasons: list[str] = []
    terms: list[float] = []
    groups: list[list[Detection] | None] = []
    for clause in metadata.get("include", []):
        name, count = clause["class"], clause["count"]
        holds = True
        found = kept.get(name, [])
        credit = 1 - abs(count - len(found)) / count
        terms.append(max(credit, 0.0) if corrected else credit)
        if len(found) != count:
            correct = holds = False
            reasons.append(f"expected {name}=={count}, found {len(found)}")
            if "color" in clause or "position" in clause:
                terms.append(0.0)
        else:
            if "color" in clause:
                colors = [d.color for d in found]
                right = colors.count(clause["color"])
                terms.append(1 - abs(count - right) / count)
                if right != count:
                    correct = holds = False
                    reasons.append(_colour_failure(clause, colors))
            if "position" in clause and holds:
                relation, target = clause["position"]
                if groups[target] is None:
                    correct = holds = False
                    reasons.append(f"no target for {name} to be {relation}")
                    terms.append(0.0)
                else:
                    got = _first_failed_pair(found, groups[target], relation)
                    if got is not None:
                        correct = holds = False
                        reasons.append(f"expected {name} {relation} target, found {got} target")
                        terms.append(0.0)
                    if got is None or not corrected:
                        terms.append(1.0)
        groups.append(found if holds else None)
    score = sum(terms) / len(terms) if terms else 0.0
    return correct, float(score), "\n".join(reasons)


def judge(metadata: Mapping[str, Any], detections: Iterable[Detection], *,
          partial_credit: str = "reference") -> Judgement:
    """Judge one image: ``metadata`` is one line of GenEval's ``evaluation_metadata.jsonl`` (a dict), ``detections``
    every detection of the image, unfiltered, in any order (`judge` filters them as the official code does).

    Returns a `Judgement` with ``correct`` (official), ``strict_correct`` and ``score`` (Flow-GRPO's training
    reward; ``partial_credit`` = ``"reference"`` or ``"corrected"``, see the module docstring) and ``reason``.
    """
    if partial_credit not in PARTIAL_CREDIT_MODES:
        raise ValueError(f"partial_credit={partial_credit!r}; use one of {list(PARTIAL_CREDIT_MODES)}")
    meta = normalize_metadata(metadata)
    kept = filter_detections(detections, meta["tag"])
    correct, reason = _official_verdict(kept, meta)
    strict, score, strict_reason = _training_verdict(kept, meta, partial_credit)
    details = {name: [[*map(float, d.box), float(d.score)] for d in dets] for name, dets in kept.items()}
    return Judgement(correct=bool(correct), strict_correct=bool(strict), score=float(score), reason=reason,
                     strict_reason=strict_reason, details=details)


# ---- the summary of a results file ---------------------------------------------------------------------

def summarize_geneval(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The numbers of GenEval's ``evaluation/summary_scores.py`` from per-image records (``tag``, ``correct``,
    ``metadata``: the rows of ``results.jsonl``).

    Returns ``{"total_images", "total_prompts", "correct_images", "correct_prompts", "tasks", "overall"}``:
    ``correct_images`` is the fraction of correct images, ``correct_prompts`` the fraction of prompts (distinct
    ``metadata``) with at least one correct image, ``tasks`` maps each tag (in order of first appearance) to
    ``{"accuracy", "correct", "total"}``, and ``overall`` is the mean of the tasks' accuracies (GenEval's score
    when all six tasks are present).
    """
    if not records:
        raise ValueError("summarize_geneval needs at least one record")
    tasks: dict[str, list[int]] = {}
    prompts: dict[str, bool] = {}
    n_correct = 0
    for i, rec in enumerate(records):
        for key in ("tag", "correct", "metadata"):
            if key not in rec:
                raise ValueError(f"record {i} has no {key!r} field (fields: {sorted(rec)}); pass the rows of "
                                 f"results.jsonl")
        ok = bool(rec["correct"])
        meta = rec["metadata"] if isinstance(rec["metadata"], str) else json.dumps(rec["metadata"])
        n_correct += ok
        prompts[meta] = prompts.get(meta, False) or ok
        counts = tasks.setdefault(str(rec["tag"]), [0, 0])
        counts[0] += ok
        counts[1] += 1
    task_table = {tag: {"accuracy": c / t, "correct": c, "total": t} for tag, (c, t) in tasks.items()}
    return {
        "total_images": len(records),
        "total_prompts": len(prompts),
        "correct_images": n_correct / len(records),
        "correct_prompts": sum(prompts.values()) / len(prompts),
        "tasks": task_table,
        "overall": float(np.mean([t["accuracy"] for t in task_table.values()])),
    }


def format_geneval_summary(summary: Mapping[str, Any]) -> str:
    """`summarize_geneval`'s numbers laid out as ``summary_scores.py`` prints them."""
    lines = [
        "Summary", "=======",
        f"Total images: {summary['total_images']}",
        f"Total prompts: {summary['total_prompts']}",
        f"% correct images: {summary['correct_images']:.2%}",
        f"% correct prompts: {summary['correct_prompts']:.2%}",
        "",
        "Task breakdown", "==============",
    ]
    for tag, t in summary["tasks"].items():
        lines.append(f"{tag:<16} = {t['accuracy']:.2%} ({t['correct']} / {t['total']})")
    lines += ["", f"Overall score (avg. over tasks): {summary['overall']:.5f}"]
    return "\n".join(lines)


# ---- the reward ------------------------------------------------------------------------------------------

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"
OUTPUTS = ("score", "correct", "strict_correct")
RESULT_FIELDS = ("filename", "tag", "prompt", "correct", "reason", "metadata", "details")


def _load_image(image: Any) -> Any:
    from PIL import Image, ImageOps

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    if isinstance(image, str) or hasattr(image, "__fspath__"):
        with Image.open(image) as opened:
            return ImageOps.exif_transpose(opened).copy()
    raise TypeError(f"GenEval scores PIL images, HxWxC uint8 arrays or image paths, got {type(image).__name__}")


def _jpeg_roundtrip(image: Any, quality: int) -> Any:
    import io

    from PIL import Image

    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    with Image.open(buf) as decoded:
        return decoded.convert("RGB")


@register_reward("geneval")
class GenEvalReward:
    """GenEval as a reward: detect, classify colours, apply the rules (see the module docstring).

    The metadata of each image comes from the dataset's columns: ``tag``, ``include`` and (optionally)
    ``exclude``, as in GenEval's ``evaluation_metadata.jsonl`` and Flow-GRPO's ``train_metadata.jsonl`` (a table's
    ``None`` padding and JSON-string columns are accepted), or one ``metadata`` column holding each line as a dict
    or JSON string.

    Args:
        detector: a transformers detector (hub id or local folder): Mask2Former/MaskFormer instance segmentation
            (masks, the default ``facebook/mask2former-swin-small-coco-instance``), an object detector (DETR,
            RT-DETR, ...) or a zero-shot one (OWLv2, Grounding DINO); see `flowgrpo.rewards.geneval_models`.
        clip_model: the CLIP model of the colour classifier (default ``openai/clip-vit-large-patch14``).
        reward_device: where both models run (default: CUDA when available, else CPU).
        dtype: their precision (``"float32"`` default, ``"bfloat16"``/``"bf16"``, ``"float16"``).
        batch_size: images per detector forward; ``clip_batch_size``: object crops per CLIP forward.
        geneval_output: what the reward returns per image: ``"score"`` (Flow-GRPO's partial credit, default),
            ``"correct"`` (official verdict, 1.0 / 0.0) or ``"strict_correct"`` (Flow-GRPO's strict verdict).
        partial_credit: ``"reference"`` (Flow-GRPO's score, quirks included) or ``"corrected"``.
        detector_image_size: shortest edge for instance segmentation inputs (800 as mmdet; ``None``: the
            processor's own).
        jpeg_quality: when set, each image goes through JPEG at this quality before scoring, as Flow-GRPO's client
            sends them to its GenEval server (PIL's default quality, 75); ``None`` (default) scores the image as is.

    Besides the scores, each call returns (as a `flowgrpo.rewards.RewardOutput`) the reason of each image and the
    metrics ``<tag>`` (official accuracy per task), ``accuracy`` and ``strict_accuracy``, logged as
    ``rewards/geneval/<key>`` in training.
    """

    def __init__(
        self,
        detector: str = DEFAULT_DETECTOR,
        clip_model: str = DEFAULT_CLIP,
        reward_device: str | None = None,
        dtype: Any = None,
        batch_size: int = 8,
        clip_batch_size: int = 16,
        geneval_output: str = "score",
        partial_credit: str = "reference",
        detector_image_size: int | None = 800,
        jpeg_quality: int | None = None,
    ):
        if geneval_output not in OUTPUTS:
            raise ValueError(f"geneval_output={geneval_output!r}; use one of {list(OUTPUTS)}")
        if partial_credit not in PARTIAL_CREDIT_MODES:
            raise ValueError(f"partial_credit={partial_credit!r}; use one of {list(PARTIAL_CREDIT_MODES)}")
        if jpeg_quality is not None and not 1 <= int(jpeg_quality) <= 100:
            raise ValueError(f"jpeg_quality={jpeg_quality!r}; use an integer in 1..100, or None")
        if detector_image_size is not None and int(detector_image_size) < 1:
            raise ValueError(f"detector_image_size={detector_image_size!r}; use a positive integer or None")
        from .placement import resolve_dtype

        resolve_dtype(dtype)  # a bad dtype fails here, before any model loads
        from .geneval_models import CLIPColourClassifier, GenEvalDetector

        self.geneval_output = geneval_output
        self.partial_credit = partial_credit
        self.jpeg_quality = None if jpeg_quality is None else int(jpeg_quality)
        self.detector = GenEvalDetector(detector, device=reward_device, dtype=dtype, batch_size=batch_size,
                                        image_size=detector_image_size)
        self.colour_classifier = CLIPColourClassifier(clip_model, device=reward_device, dtype=dtype,
                                                      batch_size=clip_batch_size)
        self._lock = threading.Lock()
        self.__name__ = "geneval"

    # ---- scoring ----------------------------------------------------------------------------------------

    def detect(self, images: Sequence[Any], metadatas: Sequence[Mapping[str, Any]]) -> list[list[Detection]]:
        """Every detection of each image, with the colour filled in where a clause of its metadata needs it (the
        top ``count`` kept objects of a class the clause asks a colour of; the others keep ``color=None``)."""
        from .geneval_models import crop_object

        images = [_load_image(im) for im in images]
        if self.jpeg_quality is not None:
            images = [_jpeg_roundtrip(im, self.jpeg_quality) for im in images]
        metas = [normalize_metadata(m) for m in metadatas]
        all_dets = self.detector(images)
        wanted: list[tuple[int, int]] = []  # (image, detection index) needing a colour
        for i, (dets, meta) in enumerate(zip(all_dets, metas)):
            colour_counts: dict[str, int] = {}
            for clause in meta.get("include", []):
                if "color" in clause:
                    colour_counts[clause["class"]] = max(colour_counts.get(clause["class"], 0), clause["count"])
            if not colour_counts:
                continue
            kept = filter_detections(dets, meta["tag"])
            position = {id(d): j for j, d in enumerate(dets)}
            for name, count in colour_counts.items():
                wanted.extend((i, position[id(d)]) for d in kept.get(name, [])[:count])
        if wanted:
            crops = [crop_object(images[i], all_dets[i][j].box, all_dets[i][j].mask) for i, j in wanted]
            colors = self.colour_classifier(crops, [all_dets[i][j].label for i, j in wanted])
            for (i, j), color in zip(wanted, colors):
                d = all_dets[i][j]
                all_dets[i][j] = Detection(label=d.label, box=d.box, score=d.score, color=color, mask=d.mask)
        return all_dets

    def judge_images(self, images: Sequence[Any], metadatas: Sequence[Mapping[str, Any]]) -> list[Judgement]:
        """`judge` of each image against its metadata (one line of ``evaluation_metadata.jsonl`` per image)."""
        if len(images) != len(metadatas):
            raise ValueError(f"{len(images)} images but {len(metadatas)} metadata lines; give one per image")
        metas = [normalize_metadata(m) for m in metadatas]  # malformed metadata fails before the models load
        if not metas:
            return []
        with self._lock:
            detections = self.detect(images, metas)
        return [judge(m, d, partial_credit=self.partial_credit) for m, d in zip(metas, detections)]

    def score_images(self, images: Sequence[Any], metadatas: Sequence[Mapping[str, Any]],
                     filenames: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per-image records with exactly the fields of the official ``results.jsonl``, in its order:
        ``filename``, ``tag``, ``prompt``, ``correct`` (bool), ``reason`` (str), ``metadata`` (``json.dumps`` of the
        metadata line) and ``details`` (``json.dumps`` of ``{class: [[x0, y0, x1, y1, score], ...]}``, the kept
        detections). ``filenames`` default to the image paths when images are given as paths, else ``None``."""
        if filenames is not None and len(filenames) != len(images):
            raise ValueError(f"{len(filenames)} filenames for {len(images)} images")
        if filenames is None:
            filenames = [str(im) if isinstance(im, str) or hasattr(im, "__fspath__") else None for im in images]
        verdicts = self.judge_images(images, metadatas)
        records = []
        for name, meta, v in zip(filenames, metadatas, verdicts):
            meta = normalize_metadata(meta)
            records.append({
                "filename": None if name is None else str(name),
                "tag": meta["tag"],
                "prompt": meta.get("prompt"),
                "correct": v.correct,
                "reason": v.reason,
                "metadata": json.dumps(meta),
                "details": json.dumps(v.details),
            })
        return records

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> Any:
        from .composition import RewardOutput

        if len(prompts) != len(images):
            raise ValueError(f"geneval got {len(prompts)} prompts and {len(images)} images")
        metadatas = self.metadata_from_columns(prompts, columns)
        verdicts = self.judge_images(images, metadatas)
        if self.geneval_output == "score":
            scores = [v.score for v in verdicts]
        else:
            scores = [float(getattr(v, self.geneval_output)) for v in verdicts]
        notes = []
        for meta, v in zip(metadatas, verdicts):
            reason = v.reason if self.geneval_output == "correct" else v.strict_reason
            notes.append(f"{meta['tag']}: " + ("ok" if not reason else reason.replace("\n", "; ")))
        tags = [m["tag"] for m in metadatas]
        metrics: dict[str, list[float | None]] = {
            "accuracy": [float(v.correct) for v in verdicts],
            "strict_accuracy": [float(v.strict_correct) for v in verdicts],
        }
        for tag in dict.fromkeys(tags):
            metrics[tag] = [float(v.correct) if t == tag else None for t, v in zip(tags, verdicts)]
        return RewardOutput(scores, notes=notes, metrics=metrics)

    @staticmethod
    def metadata_from_columns(prompts: Sequence[str], columns: Mapping[str, Sequence[Any]]) -> list[dict]:
        """One GenEval metadata dict per prompt from the dataset's columns (see the class docstring)."""
        n = len(prompts)
        if "metadata" in columns:
            out = []
            for i, meta in enumerate(columns["metadata"]):
                meta = _parse_json_value(meta, f"metadata[{i}]")
                meta = dict(meta) if isinstance(meta, Mapping) else meta
                if isinstance(meta, dict):
                    meta.setdefault("prompt", prompts[i])
                out.append(normalize_metadata(meta))
            return out
        missing = [k for k in ("tag", "include") if k not in columns]
        if missing:
            raise ValueError(
                f"the geneval reward needs the GenEval metadata columns 'tag' and 'include' (and optionally 'exclude'), "
                f"or one 'metadata' column; the dataset lacks {missing} (columns: {sorted(columns)}). Train on GenEval "
                f"metadata files such as data/geneval/train_metadata.jsonl (scripts/prepare_data.py geneval).")
        out = []
        for i in range(n):
            meta: dict[str, Any] = {"tag": columns["tag"][i], "include": columns["include"][i]}
            if columns.get("exclude") is not None and columns["exclude"][i] is not None:
                meta["exclude"] = columns["exclude"][i]
            meta["prompt"] = prompts[i]
            out.append(normalize_metadata(meta))
        return out
