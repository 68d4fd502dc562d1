"""`ocr`: does the image contain the text the prompt asked for?

Targets: every double-quoted span of the prompt, straight (``"OPEN 24/7"``) or curly (``“OPEN 24/7”``), or,
when the dataset has an ``ocr_text`` column, that column's value for the row (a string or a list of
strings; a row whose value is ``None`` falls back to the prompt's quotes).

Score of one target t against the recognised text r (all text boxes of the image joined in reading order),
both lowercased with every whitespace character removed::

    1                                                if t is a substring of r
    1 - min(Levenshtein(t, r), len(t)) / len(t)      otherwise

The reward of an image is the mean over its targets, in [0, 1]. A prompt without any target scores 0.0
(logged once per reward instance, no exception). When the OCR engine fails on an image, that image scores
0.0 with a logged warning and the rest of the batch is scored normally.

Backends:

* ``"rapidocr"`` (default): the ``rapidocr`` wheel bundles PaddleOCR's PP-OCR detection and recognition
  models as ONNX files and runs them with onnxruntime, offline, on CPU (``pip install flowgrpo[ocr]``).
  The engine is pointed at the bundled model files explicitly, so it never downloads anything.
* ``"paddleocr"``: PaddleOCR itself (``pip install flowgrpo[paddle]``; it downloads its models on first use).

Engines are created on the first call and cached per process (one per backend and configuration), shared
by every `OCRReward` instance with the same settings. Calls into an engine are serialised by a lock, so a
reward may be called from several threads (e.g. `RewardSet.submit`'s pool) at once.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .registry import register_reward

logger = logging.getLogger(__name__)

__all__ = ["OCRReward", "extract_quoted_targets", "normalize_ocr_text", "ocr_target_score"]

# An opening straight or left curly double quote, the span, a closing straight or right curly double quote.
_QUOTED = re.compile(r"[\"\u201c]([^\"\u201c\u201d]*)[\"\u201d]")
_WHITESPACE = re.compile(r"\s+")

BACKENDS = ("rapidocr", "paddleocr")


def extract_quoted_targets(prompt: str) -> list[str]:
    """Every non-blank double-quoted span of ``prompt`` (straight or curly quotes), in order."""
    return [m.group(1) for m in _QUOTED.finditer(prompt) if m.group(1).strip()]


def normalize_ocr_text(text: str) -> str:
    """Lowercase and drop every whitespace character."""
    return _WHITESPACE.sub("", text.lower())


def _levenshtein(a: str, b: str) -> int:
    try:
        from rapidfuzz.distance import Levenshtein
    except ImportError as e:  # pragma: no cover - rapidfuzz ships with the ocr extra
        raise ImportError("the 'ocr' reward needs rapidfuzz: pip install flowgrpo[ocr]") from e
    return Levenshtein.distance(a, b)


def ocr_target_score(target: str, recognized: str) -> float:
    """Score of one target against the recognised text (both normalised here); see the module docstring."""
    t = normalize_ocr_text(target)
    r = normalize_ocr_text(recognized)
    if not t:
        raise ValueError(f"OCR target {target!r} is empty after normalisation")
    if t in r:
        return 1.0
    dist = min(_levenshtein(t, r), len(t))
    return 1.0 - dist / len(t)


# ---- engines ---------------------------------------------------------------------------------------


class _Engine:
    """A backend engine plus the lock that serialises calls into it; ``read(image) -> str``."""

    def __init__(self, backend: str, options: Mapping[str, Any]):
        self.backend = backend
        self.options = dict(options)
        self.lock = threading.Lock()
        self._impl: Any = None

    def _build(self) -> Any:
        if self.backend == "rapidocr":
            return _build_rapidocr(self.options)
        return _build_paddleocr(self.options)

    def ensure_built(self) -> None:
        """Create the engine now (configuration errors surface here, not as per-image failures)."""
        with self.lock:
            if self._impl is None:
                self._impl = self._build()

    def read(self, image: Image.Image) -> str:
        self.ensure_built()
        with self.lock:
            if self.backend == "rapidocr":
                out = self._impl(image)
                texts = getattr(out, "txts", None) or ()
                return " ".join(str(t) for t in texts)
            return _read_paddleocr(self._impl, image)


_ENGINES: dict[tuple, _Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _get_engine(backend: str, options: Mapping[str, Any]) -> _Engine:
    key = (backend, _freeze(options))
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = _Engine(backend, options)
        return engine


def _bundled_rapidocr_models(package_dir: Path) -> dict[str, str]:
    """``Det/Cls/Rec.model_path`` parameters pointing at the ONNX models shipped inside the rapidocr wheel."""
    models = package_dir / "models"
    found: dict[str, str] = {}
    patterns = {"Det": "*_det_*.onnx", "Rec": "*_rec_*.onnx", "Cls": "*_cls_*.onnx"}
    for section, pattern in patterns.items():
        candidates = sorted(models.glob(pattern))
        if candidates:
            found[f"{section}.model_path"] = str(candidates[-1])
    return found


def _build_rapidocr(options: Mapping[str, Any]) -> Any:
    try:
        import rapidocr
        from rapidocr import RapidOCR
    except ImportError as e:
        raise ImportError(
            "the 'ocr' reward's default backend needs rapidocr and onnxruntime: pip install flowgrpo[ocr]"
        ) from e
    # The package logs every model load at INFO through its own handler; keep it to real problems.
    logging.getLogger("RapidOCR").setLevel(logging.ERROR)
    # Detection input: images are only shrunk when their longer side exceeds 960 px (PaddleOCR's classic
    # setting; rapidocr's own default enlarges the shorter side to 736 px, ~5x slower on small images).
    # The 180-degree text-direction classifier is off: generated text is upright.
    params: dict[str, Any] = {
        "Global.log_level": "error",
        "Global.use_cls": False,
        "Det.limit_type": "max",
        "Det.limit_side_len": 960,
    }
    bundled = _bundled_rapidocr_models(Path(rapidocr.__file__).resolve().parent)
    missing = {"Det.model_path", "Rec.model_path"} - set(bundled) - set(options.get("params", {}) or {})
    if missing:
        raise RuntimeError(
            f"the installed rapidocr wheel has no bundled ONNX models for {sorted(missing)} and the ocr reward "
            f"does not download models; pass them with reward_kwargs={{'ocr': {{'params': "
            f"{{'Det.model_path': ..., 'Rec.model_path': ...}}}}}}"
        )
    params.update(bundled)
    if options.get("num_threads"):
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = int(options["num_threads"])
    if options.get("use_cuda"):
        params["EngineConfig.onnxruntime.use_cuda"] = True
    params.update(options.get("params", {}) or {})
    engine = RapidOCR(params=params)
    logging.getLogger("RapidOCR").setLevel(logging.ERROR)
    return engine


def _build_paddleocr(options: Mapping[str, Any]) -> Any:
    try:
        from paddleocr import PaddleOCR
    except ImportError as e:
        raise ImportError(
            "the 'paddleocr' OCR backend needs the paddleocr package: pip install flowgrpo[paddle] "
            "(or use the default backend='rapidocr', which runs offline)"
        ) from e
    kwargs: dict[str, Any] = {"lang": options.get("lang", "en")}
    kwargs.update(options.get("params", {}) or {})
    try:  # PaddleOCR 3.x: turn off the document pre-processing models, not needed for generated images
        return PaddleOCR(use_doc_orientation_classify=False, use_doc_unwarping=False,
                         use_textline_orientation=False, **kwargs)
    except TypeError:  # PaddleOCR 2.x
        return PaddleOCR(use_angle_cls=False, show_log=False, **kwargs)


def _read_paddleocr(engine: Any, image: Image.Image) -> str:
    import numpy as np

    array = np.asarray(image.convert("RGB"))[:, :, ::-1].copy()  # PaddleOCR expects BGR arrays
    if hasattr(engine, "predict"):
        texts: list[str] = []
        for res in engine.predict(array):  # PaddleOCR 3.x: dict-like results with "rec_texts"
            if isinstance(res, Mapping) and "rec_texts" in res:
                data = res
            else:
                data = (getattr(res, "json", None) or {}).get("res", {})
            texts.extend(str(t) for t in (data.get("rec_texts") or []))
        return " ".join(texts)
    result = engine.ocr(array, cls=False)
    lines = result[0] if result and isinstance(result[0], list) else (result or [])
    return " ".join(str(line[1][0]) for line in lines if line)


# ---- the reward ------------------------------------------------------------------------------------


def _as_pil(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    import numpy as np

    if isinstance(image, np.ndarray):
        array = image
        if array.dtype != np.uint8:
            array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
        return Image.fromarray(array).convert("RGB")
    raise TypeError(f"OCR reward needs PIL images (or HxWxC uint8 arrays), got {type(image).__name__}")


@register_reward("ocr")
class OCRReward:
    """Text-rendering accuracy of each image against the prompt's quoted text (see the module docstring).

    Args:
        backend: ``"rapidocr"`` (default, offline, bundled PP-OCR ONNX models) or ``"paddleocr"``.
        target_column: the dataset column that, when present, gives the targets instead of the quotes.
        num_threads: onnxruntime intra-op threads for ``rapidocr`` (``None``: the trainer's CPU thread plan, see
            ``flowgrpo.cpu_threads``; onnxruntime's default when no plan was applied).
        use_cuda: run ``rapidocr``'s ONNX models with the CUDA execution provider (needs onnxruntime-gpu).
        lang: recognition language for ``paddleocr``.
        params: extra backend parameters: for ``rapidocr`` its dotted config keys (e.g.
            ``{"Det.limit_side_len": 1280}``), for ``paddleocr`` keyword arguments of ``PaddleOCR``.
    """

    def __init__(
        self,
        backend: str = "rapidocr",
        target_column: str = "ocr_text",
        num_threads: int | None = None,
        use_cuda: bool = False,
        lang: str = "en",
        params: Mapping[str, Any] | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown OCR backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.target_column = target_column
        options: dict[str, Any] = {"params": dict(params or {})}
        if backend == "rapidocr":
            options.update(num_threads=num_threads, use_cuda=bool(use_cuda))
        else:
            options.update(lang=lang)
        self._options = options
        self._warned_no_target = False
        self._warn_lock = threading.Lock()

    @property
    def engine(self) -> _Engine:
        options = self._options
        if self.backend == "rapidocr" and not options.get("num_threads"):
            # Unset: the process's thread plan decides (flowgrpo.cpu_threads), else onnxruntime's default.
            from ..cpu_threads import reward_thread_count

            options = {**options, "num_threads": reward_thread_count()}
        return _get_engine(self.backend, options)

    def targets_for(self, prompt: str, column_value: Any = None) -> list[str]:
        """The targets of one row: the ``ocr_text`` column value when given, else the prompt's quoted spans."""
        if column_value is not None:
            values = [column_value] if isinstance(column_value, str) else list(column_value)
            return [str(v) for v in values if v is not None and normalize_ocr_text(str(v))]
        return [t for t in extract_quoted_targets(prompt) if normalize_ocr_text(t)]

    def recognize(self, images: Sequence[Any], indices: Sequence[int] | None = None) -> list[str | None]:
        """Recognised text of each image (``None`` where the engine failed; the failure is logged with the
        image's index in the batch, ``indices[k]`` when given)."""
        engine = self.engine
        engine.ensure_built()
        out: list[str | None] = []
        for k, image in enumerate(images):
            i = indices[k] if indices is not None else k
            try:
                out.append(engine.read(_as_pil(image)))
            except Exception as e:  # one bad image must not sink the batch
                logger.warning("OCR (%s) failed on image %d of the batch: %s: %s; scoring it 0",
                               self.backend, i, type(e).__name__, e)
                out.append(None)
        return out

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        if len(prompts) != len(images):
            raise ValueError(f"ocr reward got {len(prompts)} prompts and {len(images)} images")
        column = columns.get(self.target_column)
        if column is not None and len(column) != len(prompts):
            raise ValueError(f"column {self.target_column!r} has {len(column)} values for {len(prompts)} prompts")
        targets = [self.targets_for(p, None if column is None else column[i]) for i, p in enumerate(prompts)]

        no_target = [i for i, t in enumerate(targets) if not t]
        if no_target:
            with self._warn_lock:
                first, self._warned_no_target = not self._warned_no_target, True
            if first:
                logger.warning(
                    "ocr reward: %d of %d prompts have no quoted text and no %r value (e.g. %r); they score 0.0. "
                    "This warning is shown once.", len(no_target), len(prompts), self.target_column,
                    prompts[no_target[0]][:80],
                )

        todo = [i for i, t in enumerate(targets) if t]
        texts = self.recognize([images[i] for i in todo], indices=todo) if todo else []
        scores: list[float | None] = [0.0] * len(prompts)
        for i, text in zip(todo, texts):
            if text is None:
                continue
            scores[i] = sum(ocr_target_score(t, text) for t in targets[i]) / len(targets[i])
        return scores
