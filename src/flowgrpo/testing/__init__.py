"""Offline tiny pipelines of every family of `flowgrpo.models.FAMILIES` (random weights, locally made tokenizers;
``TINY_FAMILIES``), with their variants (``TINY_VARIANTS``: Wan 2.2 A14B's two experts, FLUX.2 [klein] distilled, ...).

Used by the tests, the demo and the benchmarks wherever a real checkpoint cannot be downloaded::

    from flowgrpo.testing import build_tiny_pipeline, cached_tiny_pipeline_path

    pipe = build_tiny_pipeline("sd3", seed=0)                 # in memory, float32
    path = cached_tiny_pipeline_path("flux")                  # saved once, then reused
    pipe = DiffusionPipeline.from_pretrained(path)            # stock diffusers loading

See :mod:`flowgrpo.testing.tiny_pipelines` for the architectures.
"""

from .tiny_pipelines import (
    TINY_FAMILIES,
    TINY_GENERATION_DEFAULTS,
    TINY_VARIANTS,
    build_tiny_pipeline,
    cached_tiny_pipeline_path,
    save_tiny_pipeline,
)

__all__ = ["TINY_FAMILIES", "TINY_GENERATION_DEFAULTS", "TINY_VARIANTS", "build_tiny_pipeline", "cached_tiny_pipeline_path", "save_tiny_pipeline"]
