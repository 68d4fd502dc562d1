"""What a Hub upload of a flowgrpo run contains, and how it gets into ``output_dir``.

``transformers.Trainer`` uploads ``output_dir`` (minus ``_*`` and ``checkpoint-*``) with ``HfApi.upload_folder``:
at ``push_to_hub()`` after saving the final weights there, and with ``hub_strategy="every_save"`` after each
checkpoint, copying a fixed list of transformers/peft weight files from the checkpoint into ``output_dir``
first. That list does not know diffusers' LoRA file, so :func:`copy_checkpoint_exports` copies
``pytorch_lora_weights.safetensors`` (or the full fine-tuning's ``transformer/`` folder) as well, and
:func:`write_card_images` puts the last evaluation's images next to the model card. The upload itself stays
``huggingface_hub``'s, unchanged.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .lora_export import EXPERT_LORA_WEIGHTS_NAMES, LORA_WEIGHTS_NAME
from .media import encode_gif, is_video
from .model_card import CardSample

#: Files of a checkpoint that the Hub upload needs besides transformers' own list (the second one: the low-noise
#: expert's LoRA of a two-expert pipeline).
CHECKPOINT_EXPORT_FILES = (LORA_WEIGHTS_NAME, EXPERT_LORA_WEIGHTS_NAMES["transformer_2"])
#: Folders of a checkpoint that the Hub upload needs (full fine-tuning writes a diffusers transformer folder).
CHECKPOINT_EXPORT_FOLDERS = ("transformer",)
#: Where the model card's sample images go, relative to ``output_dir``.
CARD_IMAGES_DIR = "images"
#: ``ignore_patterns`` that ``Trainer.push_to_hub`` / ``_push_from_checkpoint`` pass to ``upload_folder``.
TRAINER_IGNORE_PATTERNS = ("_*", "checkpoint-*")


def copy_checkpoint_exports(checkpoint_folder: str | os.PathLike, output_dir: str | os.PathLike) -> list[str]:
    """Copy the diffusers exports of ``checkpoint_folder`` into ``output_dir``; returns the copied names."""
    src, dst = Path(checkpoint_folder), Path(output_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in CHECKPOINT_EXPORT_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    for name in CHECKPOINT_EXPORT_FOLDERS:
        if (src / name).is_dir():
            staging = dst / f".{name}.incoming"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(src / name, staging)
            shutil.rmtree(dst / name, ignore_errors=True)
            os.replace(staging, dst / name)
            copied.append(name + "/")
    return copied


def write_card_images(output_dir: str | os.PathLike, last_eval: dict | None,
                      max_images: int = 8) -> tuple[list[CardSample], str | None]:
    """Save the last evaluation's samples as ``images/sample_<i>.png`` in ``output_dir``.

    ``last_eval`` is the trainer's ``_last_eval`` (``{"metrics", "contact_sheet", "samples": [(prompt, PIL image,
    score)]}``) or ``None``. Returns the card samples (paths relative to ``output_dir``) and the contact sheet's
    relative path (copied into ``images/`` when it lies outside ``output_dir``), or ``([], None)``.
    """
    if not last_eval:
        return [], None
    out = Path(output_dir)
    images_dir = out / CARD_IMAGES_DIR
    samples: list[CardSample] = []
    entries = list(last_eval.get("samples") or [])[:max_images]
    if entries:
        images_dir.mkdir(parents=True, exist_ok=True)
        for old in [*images_dir.glob("sample_*.png"), *images_dir.glob("sample_*.gif")]:
            old.unlink()
    for i, (prompt, image, score) in enumerate(entries):
        if is_video(image):  # a video sample: an animated GIF
            name = f"{CARD_IMAGES_DIR}/sample_{i}.gif"
            (out / name).write_bytes(encode_gif(image))
        else:
            name = f"{CARD_IMAGES_DIR}/sample_{i}.png"
            image.convert("RGB").save(out / name)
        samples.append(CardSample(image=name, prompt=str(prompt), score=None if score is None else float(score)))
    sheet = last_eval.get("contact_sheet")
    sheet_rel = None
    if sheet and Path(sheet).is_file():
        sheet_path = Path(sheet).resolve()
        try:
            sheet_rel = sheet_path.relative_to(out.resolve()).as_posix()
        except ValueError:
            images_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(sheet_path, images_dir / sheet_path.name)
            sheet_rel = f"{CARD_IMAGES_DIR}/{sheet_path.name}"
    return samples, sheet_rel


def files_for_upload(folder: str | os.PathLike, ignore_patterns: Sequence[str] = TRAINER_IGNORE_PATTERNS,
                     allow_patterns: Sequence[str] | None = None) -> list[str]:
    """The repository paths ``HfApi.upload_folder(folder_path=folder, ...)`` would upload (sorted), with
    ``huggingface_hub``'s own pattern filter; ``.git`` and ``.cache`` folders are skipped as it does."""
    from huggingface_hub.utils import filter_repo_objects

    root = Path(folder)
    relpaths = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()]
    relpaths = [r for r in relpaths if not any(part in (".git", ".cache") for part in r.split("/"))]
    return sorted(filter_repo_objects(relpaths, allow_patterns=allow_patterns, ignore_patterns=list(ignore_patterns)))


def describe_upload(output_dir: str | os.PathLike) -> dict[str, Any]:
    """A summary of what a push of ``output_dir`` holds: the LoRA / transformer, the card, the images."""
    files = files_for_upload(output_dir)
    return {
        "files": files,
        "lora": LORA_WEIGHTS_NAME in files,
        "transformer": any(f.startswith("transformer/") for f in files),
        "model_card": "README.md" in files,
        "images": [f for f in files if f.startswith(CARD_IMAGES_DIR + "/")],
    }


__all__ = [
    "CARD_IMAGES_DIR",
    "CHECKPOINT_EXPORT_FILES",
    "CHECKPOINT_EXPORT_FOLDERS",
    "TRAINER_IGNORE_PATTERNS",
    "copy_checkpoint_exports",
    "describe_upload",
    "files_for_upload",
    "write_card_images",
]
