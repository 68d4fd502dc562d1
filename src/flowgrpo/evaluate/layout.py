"""GenEval's folder layout, which every benchmark of ``flowgrpo evaluate`` writes and ``--images`` reads::

    <output>/
        00000/                  one folder per prompt, its index in the metadata file (5 digits)
            metadata.jsonl      that prompt's line of the metadata file (one JSON object)
            grid.png            the prompt's samples side by side (optional, as in GenEval)
            samples/
                0000.png        sample n of the prompt (4 digits)
                0001.png
        00001/
            ...
        results.jsonl           one record per image (GenEval: the fields of its evaluate_images.py)
        summary.json            the benchmark's scores
        summary.md
        evaluation.json         how the images were made (benchmark, model, LoRA, sampler settings)

This is the layout GenEval's README documents and its ``evaluation/evaluate_images.py`` reads: prompt folders are
the subfolders whose name is all digits, samples the files of ``samples/`` named ``<digits>.png`` (GenEval's own
``generation/diffusers_generate.py`` names them with 5 digits, ``00000.png``; both are read). Images are written to
a temporary name and renamed into place, so an interrupted run never leaves a truncated PNG that a resumed run
would take for a finished sample.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METADATA_FILE = "metadata.jsonl"
SAMPLES_DIR = "samples"
GRID_FILE = "grid.png"
RESULTS_FILE = "results.jsonl"
SUMMARY_JSON_FILE = "summary.json"
SUMMARY_MD_FILE = "summary.md"
EVALUATION_FILE = "evaluation.json"

_PROMPT_DIR = re.compile(r"\d+")
_SAMPLE_FILE = re.compile(r"(\d+)\.png")


def prompt_dir(output: str | os.PathLike, index: int) -> Path:
    """``<output>/<index:05d>``: the folder of prompt ``index`` (its line number in the metadata file, from 0)."""
    return Path(output) / f"{index:05d}"


def sample_path(output: str | os.PathLike, index: int, sample: int) -> Path:
    """``<output>/<index:05d>/samples/<sample:04d>.png``."""
    return prompt_dir(output, index) / SAMPLES_DIR / f"{sample:04d}.png"


def write_prompt_metadata(output: str | os.PathLike, index: int, metadata: Mapping[str, Any]) -> None:
    """Write the prompt's metadata line to ``<index>/metadata.jsonl`` (one JSON object, as GenEval writes it).

    Raises ``ValueError`` when the folder already holds a different line: the output folder belongs to another
    prompt set (resuming into it would mix images of different prompts).
    """
    folder = prompt_dir(output, index)
    path = folder / METADATA_FILE
    if path.is_file():
        existing = read_prompt_metadata(folder)
        if existing != dict(metadata):
            raise ValueError(f"{path} holds the metadata {existing!r}, but prompt {index} of this run is "
                             f"{dict(metadata)!r}: {output} was written for another prompt file. Use a new --output "
                             "folder (or delete this one).")
        return
    (folder / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
    _write_text_atomic(path, json.dumps(dict(metadata)))


def read_prompt_metadata(folder: str | os.PathLike) -> dict[str, Any]:
    """The metadata object of a prompt folder (``metadata.jsonl``: one JSON object)."""
    path = Path(folder) / METADATA_FILE
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ValueError(f"{path} is missing: every prompt folder holds its metadata line in {METADATA_FILE}.") \
            from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not one JSON object: {err}.") from err
    if not isinstance(value, dict) or "prompt" not in value:
        raise ValueError(f"{path} must hold one JSON object with a 'prompt' field, got {value!r}.")
    return value


def existing_samples(output: str | os.PathLike, index: int, count: int) -> list[int]:
    """Which of samples ``0 .. count-1`` of prompt ``index`` are already written (a resumed run skips them)."""
    return [n for n in range(count) if sample_path(output, index, n).is_file()]


def save_image(image: Any, path: str | os.PathLike) -> None:
    """Save a PIL image as PNG through a temporary file renamed into place (never a truncated PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    image.save(partial, format="PNG")
    os.replace(partial, path)


def save_grid(images: Sequence[Any], path: str | os.PathLike, padding: int = 2) -> None:
    """The prompt's samples in one row on a black background with ``padding`` pixels around each, the look of
    torchvision's ``make_grid`` that GenEval's generator uses for its optional ``grid.png``."""
    from PIL import Image

    if not images:
        return
    width, height = images[0].size
    grid = Image.new("RGB", (len(images) * (width + padding) + padding, height + 2 * padding))
    for k, image in enumerate(images):
        grid.paste(image.convert("RGB"), (padding + k * (width + padding), padding))
    save_image(grid, path)


@dataclass(frozen=True)
class PromptFolder:
    """One prompt folder of an image folder: its index, its metadata line and its sample images (sorted)."""

    index: int
    path: Path
    metadata: dict[str, Any]
    samples: tuple[Path, ...]


def read_prompt_folder(folder: str | os.PathLike) -> PromptFolder:
    """One prompt folder (named by its index): its metadata line and its ``samples/<digits>.png``, by number."""
    folder = Path(folder)
    samples_dir = folder / SAMPLES_DIR
    samples = []
    if samples_dir.is_dir():
        samples = [p for p in samples_dir.iterdir() if p.is_file() and _SAMPLE_FILE.fullmatch(p.name)]
    samples.sort(key=lambda p: int(_SAMPLE_FILE.fullmatch(p.name).group(1)))
    return PromptFolder(int(folder.name), folder, read_prompt_metadata(folder), tuple(samples))


def read_image_folder(images_dir: str | os.PathLike) -> list[PromptFolder]:
    """Every prompt folder of ``images_dir`` in index order, read as GenEval's ``evaluate_images.py`` reads them:
    subfolders named with digits only, each with ``metadata.jsonl`` and ``samples/<digits>.png``.

    Raises ``ValueError`` naming the folder when it holds no prompt folder or a prompt folder lacks its metadata.
    """
    root = Path(images_dir)
    if not root.is_dir():
        raise ValueError(f"--images {str(images_dir)!r} is not a folder; give the folder that holds 00000/, 00001/, "
                         "... (GenEval's layout).")
    folders = [read_prompt_folder(child) for child in root.iterdir()
               if child.is_dir() and _PROMPT_DIR.fullmatch(child.name)]
    if not folders:
        raise ValueError(f"{str(images_dir)!r} holds no prompt folder: GenEval's layout is <dir>/00000/metadata.jsonl "
                         "and <dir>/00000/samples/0000.png, one folder per prompt.")
    folders.sort(key=lambda f: f.index)
    return folders


def write_jsonl(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """One JSON object per line (written through a temporary file)."""
    _write_text_atomic(Path(path), "".join(json.dumps(dict(r)) + "\n" for r in records))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_text(path: str | os.PathLike, text: str) -> None:
    _write_text_atomic(Path(path), text)


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


__all__ = [
    "EVALUATION_FILE", "GRID_FILE", "METADATA_FILE", "RESULTS_FILE", "SAMPLES_DIR", "SUMMARY_JSON_FILE",
    "SUMMARY_MD_FILE", "PromptFolder", "existing_samples", "prompt_dir", "read_image_folder", "read_jsonl",
    "read_prompt_folder", "read_prompt_metadata", "sample_path", "save_grid", "save_image", "write_jsonl",
    "write_prompt_metadata", "write_text",
]
