"""The random-fault clock of ``recover launch --random-failures MTBF``: when to strike, whom, and how.

Contract (pure: no process, no signal, no file; the launcher carries a :class:`Strike` out and logs it):
- The clock starts with the first committed step (the first replica seen training); from then on
  strikes come at exponentially distributed intervals of mean ``mtbf_s``, drawn from ``seed``: the same
  seed and the same calls give the same strikes.
- A strike hits a replica that is training right now (its current processes recorded a step in the last
  :data:`TRAINING_WINDOW_S`: a replica just started in place of a struck one has no state yet, whatever its
  predecessor recorded), never one already struck (a hung replica has no second fault), and never
  leaves fewer than ``min_replicas`` training: a strike that would is skipped, not postponed.
- What it does is drawn uniformly from ``faults``, fault kinds that strike from outside with a signal
  (:func:`recover.faults.random_kinds`: a SIGKILL, a hung training thread, a SIGSTOP;
  :attr:`Strike.signal` asks the registry); the hung or frozen replica is fenced and reaped like any other.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from recover.faults import kind

TRAINING_WINDOW_S = 2.0
"""A replica that recorded a step this recently is training (replicas still starting up or waiting
to be admitted are no targets)."""


@dataclass(frozen=True)
class Strike:
    """Fail rank ``rank`` of replica ``replica`` with the fault kind ``fault``."""

    replica: int
    rank: int
    fault: str

    @property
    def signal(self) -> int:
        """The signal that makes the fault (the kind's, :mod:`recover.faults.registry`)."""
        sig = kind(self.fault).signal
        assert sig is not None, f"{self.fault} strikes from inside: no random fault"
        return sig


class FaultClock:
    """Random faults at exponential intervals (see the module docstring).

    Args:
        mtbf_s: the mean time between strikes, seconds.
        faults: what a strike may do (fault kind names with a signal, drawn uniformly).
        ranks: the ranks of a replica (the rank struck is drawn uniformly).
        min_replicas: a strike never leaves fewer replicas training.
        seed: seeds the draws.
    """

    def __init__(self, mtbf_s: float, faults: tuple[str, ...], ranks: int, min_replicas: int, seed: int) -> None:
        self.mtbf_s = mtbf_s
        self.faults = faults
        self.ranks = ranks
        self.min_replicas = min_replicas
        self.rng = random.Random(seed)
        self.next_at: float | None = None
        """When the next strike is due (None until the clock starts)."""

    def tick(self, now: float, last_step_at: Mapping[int, float], candidates: Mapping[int, float]) -> Strike | None:
        """The strike due at ``now``, if any.

        Args:
            now: the time, seconds.
            last_step_at: replica -> when it last recorded a step (the clock starts with the first).
            candidates: the replicas running and not struck before -> when their processes started.
        """
        if not last_step_at:
            return None
        if self.next_at is None:
            self.next_at = now + self._interval()
        if now < self.next_at:
            return None
        self.next_at = now + self._interval()
        training = sorted(r for r, started in candidates.items()
                          if started <= last_step_at.get(r, -1.0) and now - last_step_at[r] < TRAINING_WINDOW_S)
        if len(training) - 1 < self.min_replicas:
            return None
        replica = self.rng.choice(training)
        rank = self.rng.randrange(self.ranks)
        return Strike(replica, rank, self.rng.choice(self.faults))

    def _interval(self) -> float:
        return self.rng.expovariate(1.0 / self.mtbf_s)
