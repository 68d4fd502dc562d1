"""Seeds derived from a run's seed and the position of what they draw (generation, micro-step, process, group), so
that every draw is a function of where it happens and never of the order things ran in: a resumed run, a process
of a launch and a rollout worker draw exactly what an uninterrupted single process draws."""

from __future__ import annotations

import hashlib

__all__ = ["seed_for"]


def _as_int(part: int | str) -> int:
    """A string part (a name that keeps two kinds of draws apart) as 64 bits of its BLAKE2b digest."""
    if isinstance(part, str):
        return int.from_bytes(hashlib.blake2b(part.encode(), digest_size=8).digest(), "big")
    return int(part)


def seed_for(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part, in order, and on nothing else (no Python hash randomisation, no
    global RNG state). Parts are integers (the run's seed, a generation, a process, a group) or names."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (_as_int(p) + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & ((1 << 63) - 1)
    return value
