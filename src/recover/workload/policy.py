"""Which microbatch ids each live replica computes in a step.

Contract: pure, deterministic functions of their arguments. Every id is assigned exactly once,
quotas sum to the number of ids, and an even split gives quotas that differ by at most one.
No process group, no clock, no randomness beyond an explicit seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

ASSIGNMENTS = ("blocks", "strided", "shuffled")


def even_split(ids: Sequence[int], replicas: Sequence[int]) -> dict[int, list[int]]:
    """Contiguous blocks of ``ids`` over ``replicas`` (in sorted order); the first ones get one more."""
    live = sorted(replicas)
    if not live:
        raise ValueError("no live replicas to assign microbatches to")
    q, r = divmod(len(ids), len(live))
    out: dict[int, list[int]] = {}
    start = 0
    for i, rep in enumerate(live):
        size = q + (1 if i < r else 0)
        out[rep] = list(ids[start:start + size])
        start += size
    return out


def static_assignment(M: int, replicas: int, step: int, how: str = "blocks", seed: int = 0) -> list[list[int]]:
    """The failure-free assignment of ids ``0..M-1`` to replicas ``0..replicas-1`` at ``step``.

    ``blocks`` gives contiguous blocks, ``strided`` gives ``ids[r::replicas]`` and ``shuffled``
    permutes the ids with a generator seeded by (seed, step) first: the trajectory must not depend
    on which of them is used.
    """
    if how not in ASSIGNMENTS:
        raise ValueError(f"assignment {how!r} is not one of {ASSIGNMENTS}")
    ids = list(range(M))
    if how == "strided":
        return [ids[r::replicas] for r in range(replicas)]
    if how == "shuffled":
        random.Random(f"{seed}:{step}").shuffle(ids)
    split = even_split(ids, range(replicas))
    return [split[r] for r in range(replicas)]
