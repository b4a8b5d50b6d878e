"""What one replica process knows of the job's generations: pure bookkeeping of the coordinator's pushes.

Contract: :class:`Generations` is fed the two pushes that change what a replica knows, in the order
they arrive (``failing(g, now)``: generation ``g`` is failing; ``formed(membership, now)``: a
generation was formed), and answers the questions the training thread asks between them. No
sockets, threads or clocks: the caller passes ``now`` and holds whatever lock it needs (the
coordinator client, :mod:`recover.coord.client`, feeds it from its reader thread).

Invariants:
  * The history only grows and the newest generation only rises (a late push of an older one is
    kept for :meth:`of` but never becomes the newest).
  * :meth:`notice` turns true as soon as ``g`` was declared failing or a later generation formed: a
    read of two integers, cheap enough for a poll loop. :meth:`notice_time` is when this process
    first learnt it (a generation passed over by a newer membership is noticed at that moment).
  * :meth:`dead_since` is the members of ``g`` missing from the newest generation: the coordinator
    forms ``g + 1`` only after every survivor acked the notice, so survivors asking right after it
    name the same set.
"""

from __future__ import annotations

from recover.coord.protocol import Membership


class Generations:
    """See the module docstring."""

    def __init__(self) -> None:
        self.history: dict[int, Membership] = {}
        self.latest = 0
        """The newest generation formed (0: none yet)."""
        self.failing_max = 0
        """The newest generation declared failing (0: none)."""
        self.noticed: dict[int, float] = {}

    # ---- the pushes --------------------------------------------------------------------------
    def failing(self, generation: int, now: float) -> None:
        self.noticed.setdefault(generation, now)
        self.failing_max = max(self.failing_max, generation)

    def formed(self, membership: Membership, now: float) -> None:
        self.history[membership.generation] = membership
        for g in range(self.latest, membership.generation):
            self.noticed.setdefault(g, now)
        self.latest = max(self.latest, membership.generation)

    # ---- the questions -----------------------------------------------------------------------
    @property
    def newest(self) -> Membership | None:
        return self.history.get(self.latest)

    def of(self, generation: int) -> Membership:
        return self.history[generation]

    def newer_than(self, generation: int) -> Membership | None:
        """The newest generation, if it is newer than ``generation``."""
        return self.newest if self.latest > generation else None

    def notice(self, generation: int) -> bool:
        return generation <= self.failing_max or self.latest > generation

    def notice_time(self, generation: int) -> float | None:
        return self.noticed.get(generation)

    def dead_since(self, generation: int) -> tuple[int, ...]:
        old, new = self.history.get(generation), self.newest
        if old is None or new is None:
            return ()
        return tuple(sorted(set(old.members) - set(new.members)))

    def admitted(self, replica: int) -> Membership | None:
        """The newest generation that has ``replica`` as a member."""
        for g in range(self.latest, 0, -1):
            m = self.history.get(g)
            if m is not None and replica in m.members:
                return m
        return None
