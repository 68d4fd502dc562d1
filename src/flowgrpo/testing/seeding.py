"""Per-component seeding of the tiny pipelines' random weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded_component(seed: int, component: int) -> Iterator[None]:
    """Seed torch's CPU generator for one component, in float32, without disturbing the caller's state.

    Each component gets its own stream, so its weights depend only on ``seed`` and not on build order.
    """
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + component)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(default_dtype)
