"""Which replicas are live in one strategy's simulated run, and the failures still to come.

Contract: :class:`Members` owns the live set (kept sorted, as the workload policy orders
replicas), the replicas under repair with the time each may come back, and a cursor over the
job's replica failures (shared failure data, one cursor per strategy). Failures of a replica that
is not live are skipped, but only up to the earliest time a replaced replica could rejoin, so a
failure of a replica that comes back later is never lost.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from recover.sim.model import JobSpec


class Members:
    """The live replicas of one run, their pending replacements and the coming failures."""

    def __init__(self, spec: JobSpec, times: np.ndarray, replicas: np.ndarray) -> None:
        self.spec = spec
        self.live: list[int] = list(range(spec.replicas))
        self._live = set(self.live)
        self.repairs: list[tuple[float, int]] = []  # heap of (ready time, replica)
        self._t = times.tolist()
        self._r = replicas.tolist()
        self._i = 0
        self.version = 0  # bumped whenever the live set changes
        self.hits = 0  # failures that killed a live replica
        self.first_hit: float | None = None

    @property
    def n(self) -> int:
        return len(self.live)

    def is_live(self, replica: int) -> bool:
        return replica in self._live

    def position(self, replica: int) -> int:
        """Index of a live replica in the sorted live set."""
        return bisect.bisect_left(self.live, replica)

    def next_ready(self) -> float:
        """When the next replaced replica is ready (``inf``: none under repair)."""
        return self.repairs[0][0] if self.repairs else math.inf

    def next_failure(self, before: float = math.inf) -> tuple[float, int]:
        """The next failure that may hit a live replica: ``(time, replica)``, ``(inf, -1)`` if none.

        Failures of replicas that are not live are skipped while they are earlier than
        ``before`` and than the next replacement; a later one is returned as is, so check
        :meth:`is_live` when its time comes.
        """
        horizon = min(before, self.next_ready())
        while self._i < len(self._t) and self._t[self._i] < horizon and self._r[self._i] not in self._live:
            self._i += 1
        if self._i == len(self._t):
            return math.inf, -1
        return self._t[self._i], self._r[self._i]

    def pop_failure(self) -> None:
        """Consumes the failure :meth:`next_failure` returned."""
        self._i = min(self._i + 1, len(self._t))

    def kill(self, replica: int, t: float, repair: bool = True) -> None:
        """``replica`` died at ``t``; it is replaced ``repair_s`` later when ``repair`` is true."""
        self.live.remove(replica)
        self._live.discard(replica)
        self.version += 1
        self.hits += 1
        if self.first_hit is None:
            self.first_hit = t
        if repair:
            heapq.heappush(self.repairs, (t + self.spec.repair_s, replica))

    def admit(self, now: float) -> int:
        """Every replaced replica ready by ``now`` becomes live; returns how many."""
        count = 0
        while self.repairs and self.repairs[0][0] <= now:
            _, r = heapq.heappop(self.repairs)
            bisect.insort(self.live, r)
            self._live.add(r)
            self.version += 1
            count += 1
        return count

    def ready_after(self, k: int) -> float:
        """When ``k`` more replicas will have been replaced (``inf`` if fewer are under repair)."""
        if k <= 0:
            return -math.inf
        if k > len(self.repairs):
            return math.inf
        return heapq.nsmallest(k, self.repairs)[-1][0]
