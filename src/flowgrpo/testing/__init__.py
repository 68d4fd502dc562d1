"""Offline tiny Stable Diffusion 3 and FLUX pipelines (random weights, locally made tokenizers).

Used by the tests, the demo and the benchmarks wherever a real checkpoint cannot be downloaded::

    from flowgrpo.testing import build_tiny_pipeline, cached_tiny_pipeline_path

    pipe = build_tiny_pipeline("sd3", seed=0)                 # in memory, float32
    path = cached_tiny_pipeline_path("flux")                  # saved once, then reused
    pipe = DiffusionPipeline.from_pretrained(path)            # stock diffusers loading

See :mod:`flowgrpo.testing.tiny_pipelines` for the architectures.
"""

from .tiny_pipelines import TINY_FAMILIES, build_tiny_pipeline, cached_tiny_pipeline_path, save_tiny_pipeline

__all__ = ["TINY_FAMILIES", "build_tiny_pipeline", "cached_tiny_pipeline_path", "save_tiny_pipeline"]
