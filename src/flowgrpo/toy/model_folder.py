"""The toy world as a model folder of the launch script: a recipe's ``build_tiny_pipeline_if_missing: toy`` reaches
:data:`TOY_WORLD` through the ``flowgrpo.model_folders`` entry points (`flowgrpo.cli.model_folders`), so that the
command line never imports ``flowgrpo.toy`` (nor, through it, ``flowgrpo.testing``).

Before a run reads its datasets from a toy world (any folder holding ``toy_world.json``), :meth:`ToyWorldFolder.prepare_run`
quiets the caption truncation notices (the world reads a caption's first tokens by design) and writes the world's
preference pairs (``<world>/dpo_pairs/train.jsonl``, ``recipes/toy_dpo.yaml``) when the run asks for them and they are
not there yet: on the local main process, while the others wait, like the world itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

__all__ = ["TOY_WORLD", "ToyWorldFolder"]


class ToyWorldFolder:
    """A model folder builder (`flowgrpo.cli.model_folders`): a copy of the cached toy world
    (:func:`flowgrpo.toy.build.cached_toy_world`, built there on first use and shared with the tests and benchmarks)."""

    def describe(self, name: str, seed: int) -> str:
        return f"preparing the toy world (seed {seed})"

    def build(self, name: str, target: Path, seed: int) -> None:
        import shutil

        from .build import cached_toy_world

        shutil.copytree(cached_toy_world("full", seed=seed), target)

    def prepare_run(self, folder: Path, dataset_names: Sequence[str | None],
                    main_process_first: Callable[[str], AbstractContextManager]) -> None:
        """Quiet the truncation notices of the world at ``folder``; write its preference pairs when one of
        ``dataset_names`` is ``<folder>/dpo_pairs/train.jsonl`` and the file does not exist yet."""
        from .build import METADATA_FILE, quiet_toy_truncation_warnings

        folder = Path(folder)
        metadata = json.loads((folder / METADATA_FILE).read_text())
        quiet_toy_truncation_warnings(metadata["generation"]["max_sequence_length"])
        pairs = folder / "dpo_pairs"
        wanted = (pairs / "train.jsonl").resolve()
        if (pairs / "train.jsonl").is_file() or not any(
                name and Path(name).expanduser().resolve() == wanted for name in dataset_names):
            return
        from ..build_cache import build_folder_once
        from .dpo_pairs import make_toy_dpo_pairs

        def build(target: Path) -> None:
            print(f"[flowgrpo] writing the toy world's preference pairs to {pairs}", flush=True)
            make_toy_dpo_pairs(folder, target)

        with main_process_first("writing the preference pairs"):
            build_folder_once(pairs, build, marker="train.jsonl", what="preference pairs folder")


#: the builder of the ``toy`` entry point
TOY_WORLD = ToyWorldFolder()
