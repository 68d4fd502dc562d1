"""The tiny random-weight pipelines as model folders of the launch script: a recipe's
``build_tiny_pipeline_if_missing: <family>`` (any family of `flowgrpo.models.FAMILIES`) reaches
:data:`TINY_PIPELINE` through the ``flowgrpo.model_folders`` entry points (`flowgrpo.cli.model_folders`), so that the
command line never imports this package itself.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_PIPELINE", "TinyPipelineFolder"]


class TinyPipelineFolder:
    """A model folder builder (`flowgrpo.cli.model_folders`): the tiny pipeline of a family, written with
    ``save_pretrained`` (:func:`flowgrpo.testing.save_tiny_pipeline`)."""

    def describe(self, name: str, seed: int) -> str:
        return f"building the tiny {name} pipeline (seed {seed})"

    def build(self, name: str, target: Path, seed: int) -> None:
        from .tiny_pipelines import save_tiny_pipeline

        save_tiny_pipeline(name, target, seed=seed)


#: the builder every family's entry point names
TINY_PIPELINE = TinyPipelineFolder()
