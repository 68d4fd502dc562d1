"""Seeds derived from a run's seed and the position of what they draw (generation, micro-step, process, group), so
that every draw is a function of where it happens and never of the order things ran in: a resumed run, a process
of a launch and a rollout worker draw exactly what an uninterrupted single process draws."""

from __future__ import annotations

__all__ = ["seed_for"]


def seed_for(*parts: int) -> int:
    """A 63-bit seed that depends on every part (deterministic, no Python hash randomisation)."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (int(p) + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & ((1 << 63) - 1)
    return value
