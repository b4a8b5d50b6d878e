"""Per-replica microbatch times that every replica plans with: stragglers get fewer microbatches.

Contract: pure and deterministic (no clock, no process group). The coordinator owns one
:class:`SpeedTracker`, the single writer: at each commit it feeds the seconds per microbatch each
member measured in that step, and sends the resulting :attr:`SpeedTracker.planned` times with the
``committed`` reply (and with every membership), so every replica computes the same plan for the
next step with :func:`recover.workload.assign`.

Policy:
* Robust to noise: a replica's estimate is the median of its last ``window`` samples (once it has
  ``min_samples``); the planned times are relative (the median replica is 1.0: a machine-wide
  slowdown moves nothing), and a replica's planned time follows its estimate only when the two
  differ by more than ``tolerance`` (a dead band: jitter alone never makes a replica slow or fast).
* Hysteresis: the planned times change only when planning with the new estimates would shorten
  the predicted step (its makespan under the new estimates) by more than ``margin`` against the
  plan in force; otherwise the plan stays, so noise never moves microbatches every step.
* A replica given no microbatch measures nothing; after ``stale_steps`` commits without a sample
  it is probed: its samples are dropped and its planned time set just below the plan's step time,
  so it gets one microbatch (the cheapest probe) and is measured anew (a throttled device that
  recovered gets its share back).
* A replica whose planned time is at least ``straggler_ratio`` x the median of the others is a
  straggler: :meth:`SpeedTracker.observe` reports it once when it becomes one and once when it no
  longer is (below the ratio under the planned times).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from recover.workload.policy import assign, makespan


@dataclass(frozen=True)
class SpeedChange:
    """One thing :meth:`SpeedTracker.observe` noticed."""

    kind: str
    """``rebalanced`` (the planned times changed), ``straggler`` or ``straggler_cleared``."""
    replica: int | None
    """The straggler (None for ``rebalanced``)."""
    factor: float
    """A straggler's planned time over the median of the others; for ``rebalanced``, the predicted
    step time of the old plan over the new one's."""


STRAGGLER_RATIO = 1.5
"""A replica this many times slower than the median of the others is named a straggler."""


def slowdowns(times: Mapping[int, float]) -> dict[int, float]:
    """Each replica's time over the median time of the other replicas (1.0 with no other).

    One sort, then each "median of the others" by index (the coordinator calls this at every commit,
    so it stays O(n log n) for thousands of replicas)."""
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    vals = [t for _, t in ranked]
    m = len(vals) - 1  # how many others each replica has
    if m == 0:
        return {r: 1.0 for r, _ in ranked}

    def others_median(i: int) -> float:
        def kth(k: int) -> float:  # the k-th smallest time once position i is left out
            return vals[k if k < i else k + 1]
        return kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2

    return {r: t / others_median(i) for i, (r, t) in enumerate(ranked)}


class SpeedTracker:
    """Measured seconds per microbatch per replica, and the times the plan uses (see the module docstring).

    Args:
        window: samples per replica whose median is its estimate.
        tolerance: the dead band: how far (relative) a replica's estimate must be from its planned time
            for the plan to consider moving it.
        margin: the smallest predicted relative shortening of the step that changes the plan.
        stale_steps: commits without a sample after which a replica is probed with one microbatch.
        straggler_ratio: planned time over the others' median from which a replica is named slow.
    """

    def __init__(self, window: int = 7, tolerance: float = 0.25, margin: float = 0.1, stale_steps: int = 20,
                 straggler_ratio: float = STRAGGLER_RATIO) -> None:
        if window < 1 or not 0 <= tolerance < 1 or margin < 0 or stale_steps < 1 or straggler_ratio <= 1:
            raise ValueError(f"bad speed tracker settings: window={window}, tolerance={tolerance}, "
                             f"margin={margin}, stale_steps={stale_steps}, straggler_ratio={straggler_ratio}")
        self.window, self.tolerance, self.margin = window, tolerance, margin
        self.min_samples = min(window, 3)
        self.stale_steps, self.straggler_ratio = stale_steps, straggler_ratio
        self._samples: dict[int, deque[float]] = {}
        self._last_seen: dict[int, int] = {}
        self._commits = 0
        self._probed: set[int] = set()  # replicas whose samples a probe restarted
        self.planned: dict[int, float] | None = None
        """The times every replica plans with (None: the even split)."""
        self.stragglers: set[int] = set()

    def estimates(self) -> dict[int, float]:
        """The median of each replica's recent samples (replicas with at least ``min_samples`` of them, or
        any sample since a probe)."""
        return {r: statistics.median(s) for r, s in sorted(self._samples.items())
                if len(s) >= self.min_samples or (s and r in self._probed)}

    def forget(self, replica: int) -> None:
        """``replica`` left the job: its samples and planned time go (a replacement is measured anew)."""
        self._samples.pop(replica, None)
        self._last_seen.pop(replica, None)
        self._probed.discard(replica)
        self.stragglers.discard(replica)
        if self.planned is not None:
            self.planned.pop(replica, None)
            self.planned = self.planned or None

    def observe(self, microbatches: int, members: Iterable[int], samples: Mapping[int, float]) -> list[SpeedChange]:
        """One committed step: ``samples`` are the members' measured seconds per microbatch (a member
        that computed nothing is absent); ``microbatches`` is the step's M. Returns what changed."""
        members = sorted(members)
        self._commits += 1
        for r, t in samples.items():
            if t > 0:
                window = self._samples.setdefault(r, deque(maxlen=self.window))
                window.append(float(t))
                self._last_seen[r] = self._commits
                if len(window) >= self.min_samples:
                    self._probed.discard(r)
        changes = self._replan(microbatches, members)
        self._probe_stale(microbatches, members)
        return changes + self._name_stragglers(members)

    # ---- helpers --------------------------------------------------------------------------------
    def _replan(self, microbatches: int, members: list[int]) -> list[SpeedChange]:
        fresh = {r: t for r, t in self.estimates().items() if r in members}
        if len(members) < 2 or not fresh:
            return []
        planned = _relative(_filled(self.planned or {}, members))
        scale = statistics.median(fresh.values()) / statistics.median(planned[r] for r in fresh)
        now = _relative({r: fresh[r] / scale if r in fresh else planned[r] for r in members})  # unmeasured: as planned
        # the dead band: a replica keeps its planned relative time unless it moved beyond the tolerance
        cand = {r: now[r] if abs(now[r] / planned[r] - 1) > self.tolerance else planned[r] for r in members}
        if cand == planned:
            return []
        ids = range(microbatches)
        before = makespan(assign(ids, members, planned), now)
        after = makespan(assign(ids, members, cand), now)
        if after <= 0 or before <= after * (1 + self.margin):
            return []
        self.planned = cand
        return [SpeedChange("rebalanced", None, round(before / after, 3))]

    def _probe_stale(self, microbatches: int, members: list[int]) -> None:
        if self.planned is None:
            return  # the even split gives every member work
        for r in members:
            if self._commits - self._last_seen.setdefault(r, self._commits) < self.stale_steps:
                continue
            span = makespan(assign(range(microbatches), members, self.planned), _filled(self.planned, members))
            self._samples.pop(r, None)
            self._probed.add(r)
            self._last_seen[r] = self._commits
            self.planned[r] = span * 0.999

    def _name_stragglers(self, members: list[int]) -> list[SpeedChange]:
        slow = slowdowns(_filled(self.planned, members)) if self.planned is not None else {}
        changes = []
        for r in members:
            s = slow.get(r, 1.0)
            if s >= self.straggler_ratio and r not in self.stragglers:
                self.stragglers.add(r)
                changes.append(SpeedChange("straggler", r, round(s, 2)))
            elif s < self.straggler_ratio and r in self.stragglers:
                self.stragglers.discard(r)
                changes.append(SpeedChange("straggler_cleared", r, round(s, 2)))
        return changes


def _filled(times: Mapping[int, float], members: list[int]) -> dict[int, float]:
    """``times`` over ``members``, a member without one taking the median (as :func:`assign` does)."""
    known = [times[r] for r in members if r in times]
    mid = statistics.median(known) if known else 1.0
    return {r: times.get(r, mid) for r in members}


def _relative(times: dict[int, float]) -> dict[int, float]:
    """``times`` over their median (the plan only depends on ratios)."""
    mid = statistics.median(times.values())
    return {r: t / mid for r, t in times.items()}
