"""Shared test set-up: everything offline, one core's worth of threads per test worker, cached tiny pipelines.

The suite runs in parallel pytest-xdist workers (``make test``: one per core). Each worker gets its share of the
cores through ``FLOWGRPO_CPU_THREADS`` (the trainers' thread policy, ``flowgrpo.cpu_threads``) and torch's own
setting, so that two workers never oversubscribe the machine. Tiny pipelines live in the user cache
(``flowgrpo.testing.cached_tiny_pipeline_path``: fingerprinted, built once under a lock, shared by the workers).
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cores_per_worker() -> int:
    from flowgrpo.cpu_threads import usable_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, usable_cores() // max(1, workers))


os.environ.setdefault("FLOWGRPO_CPU_THREADS", str(_cores_per_worker()))
os.environ.setdefault("OMP_NUM_THREADS", os.environ["FLOWGRPO_CPU_THREADS"])


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["FLOWGRPO_CPU_THREADS"]))
    config.addinivalue_line("markers", "run_first: a long test that parallel workers should start first")


def pytest_collection_modifyitems(session, config, items):
    """Long tests marked ``run_first`` go to the front, so that one worker starts them at once while the others
    take the rest of the suite (the suite's wall time is then about the longest test's, not its sum with the
    tests queued before it)."""
    items.sort(key=lambda item: item.get_closest_marker("run_first") is None)


@pytest.fixture(scope="session")
def tiny_pipeline_cache():
    """Folder of the cached tiny pipelines: the user cache (``$FLOWGRPO_TINY_PIPELINE_CACHE`` or
    ``~/.cache/flowgrpo/tiny-pipelines``), shared by parallel workers and by later runs."""
    return None


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
