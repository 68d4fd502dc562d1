"""A reward's weight file: finding it (a local file, a file in a local folder, or a file of a Hugging Face hub repo)
and reading its tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["read_state_dict", "resolve_model_file"]


def resolve_model_file(name_or_path: str | Path, filename: str, what: str) -> Path:
    """The local path of ``filename`` for ``name_or_path``.

    * an existing file: itself;
    * an existing folder: ``folder / filename`` (which must exist);
    * otherwise a hub repo id (``owner/name``): ``filename`` downloaded from it (or taken from the local hub cache).

    Raises:
        FileNotFoundError: a folder without ``filename``, or a name that is neither a local path nor a repo id.
    """
    local = Path(name_or_path).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        candidate = local / filename
        if not candidate.is_file():
            raise FileNotFoundError(f"{what}: folder {str(local)!r} has no {filename!r}; give the file itself or a "
                                    f"folder holding {filename!r}")
        return candidate
    parts = str(name_or_path).split("/")
    if len(parts) != 2 or not all(parts) or Path(name_or_path).is_absolute():
        raise FileNotFoundError(f"{what}: {str(name_or_path)!r} is neither a local file or folder nor a hub repo id "
                                f"('owner/name')")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=str(name_or_path), filename=filename))


def read_state_dict(file: str | Path) -> dict[str, Any]:
    """The tensors of a checkpoint file: a ``.safetensors`` file, or a ``torch.load`` file (``weights_only``) holding
    the state dict itself or under ``"model"`` (as the official HPSv3 and EditReward inferencers read theirs)."""
    import torch

    file = Path(file)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    state = torch.load(file, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    return dict(state)
