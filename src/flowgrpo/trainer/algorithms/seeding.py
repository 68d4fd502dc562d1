"""Seeds that are pure functions of named parts (the run seed, the generation, a prompt or node key, ...).

A draw seeded this way is the same on every process and whatever the order in which the draws are made, which is
what resuming a run, sharding a group over processes and executing a tree rollout in any order need.
"""

from __future__ import annotations

import hashlib

__all__ = ["stable_seed"]


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part, in order, and on nothing else (no Python hash randomisation, no
    global RNG state): the first 8 bytes of BLAKE2b of the parts joined by ``/``."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)
