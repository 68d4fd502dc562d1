"""The model folders that ``build_tiny_pipeline_if_missing`` builds: plugins of the ``flowgrpo.model_folders``
entry points, loaded by name (`flowgrpo.plugins`).

A recipe's ``build_tiny_pipeline_if_missing: NAME`` builds the folder ``model_name_or_path`` when it does not exist
yet, with the builder that the entry point ``NAME`` of the group ``flowgrpo.model_folders`` names. A builder is an
object with::

    describe(name: str, seed: int) -> str        # what it builds, for the log line: "building the tiny sd3 pipeline
                                                 # (seed 0)"
    build(name: str, target: Path, seed: int) -> None    # write the folder at target (a staging folder, renamed into
                                                         # place when complete: flowgrpo.build_cache)
    prepare_run(folder: Path, dataset_names: Sequence[str | None],           # the toy world's: called before a run
                main_process_first: Callable[[str], ContextManager]) -> None  # reads its datasets from a toy world

flowgrpo declares (setup.py) the tiny random-weight pipeline of every family of `flowgrpo.models.FAMILIES`
(``flowgrpo.testing.model_folder``) and the toy world, ``toy`` (``flowgrpo.toy.model_folder``). The command line
imports neither package: only the entry point a recipe names is loaded, when the folder is to be built. A folder that
holds the toy world's ``toy_world.json`` (:data:`TOY_WORLD_MARKER`) is prepared by the ``toy`` builder's
``prepare_run``, whatever made it.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..models import FAMILIES
from ..plugins import PluginError, PluginGroup

__all__ = ["BUILTIN_MODEL_FOLDERS", "MODEL_FOLDERS", "MODEL_FOLDER_GROUP", "TOY_WORLD_MARKER", "model_folder_builder"]

MODEL_FOLDER_GROUP = "flowgrpo.model_folders"
#: the entry points flowgrpo declares in setup.py (kept equal by a test), used in their place when flowgrpo runs from
#: a source tree that was never installed
BUILTIN_MODEL_FOLDERS = {**{family: "flowgrpo.testing.model_folder:TINY_PIPELINE" for family in FAMILIES},
                         "toy": "flowgrpo.toy.model_folder:TOY_WORLD"}
#: a model folder holding this file is a toy world: the ``toy`` builder prepares the runs on it
TOY_WORLD_MARKER = "toy_world.json"

MODEL_FOLDERS = PluginGroup(MODEL_FOLDER_GROUP, builtin=BUILTIN_MODEL_FOLDERS)


def model_folder_builder(name: str) -> Any:
    """The builder of the entry point ``name`` (imported now).

    Raises:
        flowgrpo.cli.RecipeError: no entry point is named ``name`` (with the closest names), or it cannot be loaded
            (naming the plugin and its error).
    """
    from .parser import RecipeError

    if name not in MODEL_FOLDERS:
        known = MODEL_FOLDERS.names()
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise RecipeError(f"build_tiny_pipeline_if_missing={name!r} names no model folder builder; {hint}choose one of "
                          f"{known} (the entry points of {MODEL_FOLDER_GROUP!r}), or leave it unset for real models.")
    try:
        return MODEL_FOLDERS.load(name)
    except PluginError as err:
        raise RecipeError(f"build_tiny_pipeline_if_missing={name!r}: {err}") from err
