"""Liveness is progress, not heartbeats: a replica that stops advancing while others wait for it is hung.

A heartbeat proves that a process's heartbeat thread runs, not that its training loop advances (a
stuck kernel, an NCCL hang, a deadlocked data loader leave the heartbeats going). So every rank's
heartbeat also carries its training thread's progress counter (bumped at every phase point of every
step: each microbatch's forward and backward, the reduction, the vote, ...) and its activity:

  ``compute``  it owes the others progress (the default);
  ``wait``     it is blocked for the others: in a collective, a commit vote, a generation forming;
  ``io``       a checkpoint save or an evaluation: long, legitimate, not judged.

Rule (pure: every call carries ``now``): replica R is *hung* when one of its ranks has been in
``compute`` with an unchanged counter for longer than the hang timeout while a rank of another live
replica is in ``wait`` (so a replica alone, or a job that is slow everywhere, is never fenced). The
timeout is ``hang_timeout_s`` when set (> 0); else ``max(min_s, factor x the median step time)``,
the step times being the intervals between the commits this coordinator saw (``min_s`` alone until
there are 3 of them).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

ACTIVITIES = ("compute", "wait", "io")
DEFAULT_MIN_S = 60.0
DEFAULT_FACTOR = 10.0


@dataclass
class _Rank:
    progress: int
    activity: str
    since: float
    """When ``progress`` last changed (or the rank entered ``compute``)."""


class Liveness:
    """Per-rank progress of the registered replicas, and the hang rule (see the module docstring)."""

    def __init__(self, hang_timeout_s: float = 0.0, min_s: float = DEFAULT_MIN_S,
                 factor: float = DEFAULT_FACTOR) -> None:
        if hang_timeout_s < 0 or min_s <= 0 or factor <= 0:
            raise ValueError(f"hang_timeout_s = {hang_timeout_s} must be >= 0, min_s = {min_s} and "
                             f"factor = {factor} > 0")
        self.hang_timeout_s, self.min_s, self.factor = hang_timeout_s, min_s, factor
        self._replicas: dict[int, dict[int, _Rank]] = {}
        self._commits: deque[tuple[int, float]] = deque(maxlen=21)

    def start(self, replica: int, ranks: int, now: float) -> None:
        """Replica ``replica`` of ``ranks`` ranks is registered: its clocks start now."""
        self._replicas[replica] = {k: _Rank(-1, "compute", now) for k in range(ranks)}

    def forget(self, replica: int) -> None:
        """The replica is gone (dead, fenced or left)."""
        self._replicas.pop(replica, None)

    def heartbeat(self, replica: int, rank: int, progress: int | None, activity: str | None, now: float) -> None:
        """A heartbeat of rank ``rank`` of ``replica`` (older clients send neither field: never judged)."""
        r = self._replicas.get(replica, {}).get(rank)
        if r is None:
            return
        if progress is None:
            r.activity = "io"
            return
        activity = activity if activity in ACTIVITIES else "compute"
        if progress != r.progress or (activity == "compute" and r.activity != "compute"):
            r.since = now
        r.progress, r.activity = progress, activity

    def committed(self, step: int, now: float) -> None:
        """A step was committed (called once per step or more: repeats of a step are ignored)."""
        if not self._commits or self._commits[-1][0] != step:
            self._commits.append((step, now))

    def timeout(self) -> float:
        """The hang timeout in force now (seconds)."""
        if self.hang_timeout_s > 0:
            return self.hang_timeout_s
        times = [b[1] - a[1] for a, b in zip(self._commits, list(self._commits)[1:], strict=False)]
        if len(times) < 3:
            return self.min_s
        return max(self.min_s, self.factor * statistics.median(times))

    def hung(self, now: float) -> list[tuple[int, str]]:
        """``(replica, detail)`` of every replica hung at ``now``, by replica id (one pass over the ranks)."""
        waiting = self.waiting()
        if not waiting:
            return []
        limit = self.timeout()
        out = []
        for replica, ranks in sorted(self._replicas.items()):
            others = sorted(waiting - {replica})
            stale = [(k, now - r.since) for k, r in ranks.items() if r.activity == "compute" and now - r.since > limit]
            if others and stale:
                rank, silent = stale[0]
                out.append((replica, f"rank {rank} made no progress for {silent:.1f} s (hang timeout {limit:.1f} s) "
                                     f"while replicas {others} waited for it"))
        return out

    def computing(self, replica: int) -> bool:
        """Whether a rank of ``replica`` is in ``compute`` (owes the others progress)."""
        return any(r.activity == "compute" for r in self._replicas.get(replica, {}).values())

    def waiting(self) -> set[int]:
        """Replicas with a rank blocked for the others (in a collective, a vote, ...)."""
        return {rep for rep, ranks in self._replicas.items() if any(r.activity == "wait" for r in ranks.values())}
