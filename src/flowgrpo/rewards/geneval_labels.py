"""GenEval's vocabulary: its 80 object names (and COCO's spelling of them), colours, tasks, thresholds, the mapping of
detector labels to its names, and `Detection`, one detected object. Shared by the rules (`geneval`) and the models
that detect and colour objects (`geneval_models`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["COCO_OBJECT_NAMES", "COUNTING_THRESHOLD", "Detection", "GENEVAL_COLORS", "GENEVAL_COMMIT",
           "GENEVAL_OBJECT_NAMES", "GENEVAL_TAGS", "MAX_OBJECTS", "PARTIAL_CREDIT_MODES",
           "POSITION_THRESHOLD", "RELATIONS", "THRESHOLD", "geneval_label"]

#: The djghosh13/geneval commit whose ``evaluation/evaluate_images.py`` and ``prompts/evaluation_metadata.jsonl``
#: these rules and `scripts/prepare_data.py` follow.
GENEVAL_COMMIT = "af4902f24d3ca90ebbb446dd9891a59e0f82725f"

#: GenEval's 80 object names (``evaluation/object_names.txt``), in the detector's class order.
GENEVAL_OBJECT_NAMES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)

#: The same 80 classes as COCO (and the transformers COCO checkpoints' ``id2label``) spell them.
COCO_OBJECT_NAMES: tuple[str, ...] = tuple(
    {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(n, n)
    for n in GENEVAL_OBJECT_NAMES
)

#: GenEval's colours, in the official order (the order of the colour counts in a reason string).
GENEVAL_COLORS: tuple[str, ...] = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
)

#: The six tasks of GenEval, in the order of ``evaluation_metadata.jsonl``.
GENEVAL_TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
POSITION_THRESHOLD = 0.1
PARTIAL_CREDIT_MODES = ("reference", "corrected")
RELATIONS = ("left of", "right of", "above", "below")


# ---- label names -----------------------------------------------------------------------------------

def _squash(name: str) -> str:
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


# Other spellings of GenEval's classes used by detectors' label sets (COCO, Pascal VOC, LVIS-style, Objects365-
# style and common English variants).
_SYNONYMS: dict[str, str] = {
    "motorbike": "motorcycle", "motor bike": "motorcycle",
    "aeroplane": "airplane", "plane": "airplane", "aircraft": "airplane",
    "bike": "bicycle",
    "sofa": "couch",
    "tvmonitor": "tv", "tv monitor": "tv", "television": "tv", "television set": "tv", "tv set": "tv",
    "monitor": "tv",
    "diningtable": "dining table", "table": "dining table",
    "pottedplant": "potted plant", "houseplant": "potted plant", "potted plant": "potted plant",
    "mouse": "computer mouse", "computer mouse": "computer mouse",
    "remote": "tv remote", "remote control": "tv remote",
    "keyboard": "computer keyboard",
    "cellphone": "cell phone", "mobile phone": "cell phone", "phone": "cell phone", "cellular telephone": "cell phone",
    "hair dryer": "hair drier", "hairdryer": "hair drier", "hairdrier": "hair drier",
    "doughnut": "donut",
    "hotdog": "hot dog",
    "fridge": "refrigerator",
    "ball": "sports ball",
    "ski": "skis",
    "racket": "tennis racket", "tennis racquet": "tennis racket",
    "wineglass": "wine glass",
    "teddy": "teddy bear", "teddybear": "teddy bear",
    "motor vehicle": "car",
    "people": "person", "man": "person", "woman": "person",
}

_LABELS: dict[str, str] = {}
for _name in GENEVAL_OBJECT_NAMES:
    _LABELS[_name] = _name
    _LABELS[_name.replace(" ", "")] = _name
for _alias, _name in _SYNONYMS.items():
    _LABELS.setdefault(_alias, _name)
del _name, _alias


def geneval_label(name: str) -> str | None:
    """GenEval's name of a detector label (``"motorbike"`` -> ``"motorcycle"``, ``"mouse"`` -> ``"computer mouse"``,
    ``"tvmonitor"`` -> ``"tv"``, ...), or ``None`` for a label GenEval does not use (``"N/A"``, stuff classes).

    Case, ``_``/``-`` and repeated spaces are ignored."""
    return _LABELS.get(_squash(name))


# ---- detections and metadata -----------------------------------------------------------------------

@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        label: one of GenEval's 80 object names (`GENEVAL_OBJECT_NAMES`; map detector labels with `geneval_label`).
        box: ``(x0, y0, x1, y1)`` in pixels, y pointing down.
        score: the detector's confidence.
        color: one of `GENEVAL_COLORS`, or ``None`` (not classified: never matches a required colour).
        mask: optional ``(H, W)`` boolean instance mask (used to crop the object for colour classification; the
            rules never read it).
    """

    label: str
    box: tuple[float, float, float, float]
    score: float
    color: str | None = None
    mask: Any = field(default=None, repr=False, compare=False)
