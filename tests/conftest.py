"""Shared test set-up: everything offline, small thread counts, session-cached tiny pipelines."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_pipeline_cache(tmp_path_factory):
    """Folder holding the tiny pipelines saved during this test session."""
    return tmp_path_factory.mktemp("tiny-pipelines")


@pytest.fixture(scope="session")
def tiny_sd3_path(tiny_pipeline_cache):
    """Path of a tiny StableDiffusion3Pipeline (seed 0) saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    return cached_tiny_pipeline_path("sd3", seed=0, cache_dir=tiny_pipeline_cache)


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_pipeline_cache):
    """Path of a tiny FluxPipeline (seed 0) saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    return cached_tiny_pipeline_path("flux", seed=0, cache_dir=tiny_pipeline_cache)


@pytest.fixture(scope="session")
def tiny_pipeline_path(tiny_pipeline_cache):
    """``tiny_pipeline_path(family, variant=None)``: a tiny pipeline of any of ``flowgrpo.testing.TINY_FAMILIES``
    saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    def path(family: str, variant: str | None = None):
        return cached_tiny_pipeline_path(family, seed=0, cache_dir=tiny_pipeline_cache, variant=variant)

    return path
