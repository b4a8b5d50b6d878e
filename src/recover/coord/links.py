"""The link rule: after a collective that every member reached timed out, which replica's link is broken.

Pure: no sockets, no threads, no clock (every event carries ``now``), like :mod:`recover.coord.liveness`
beside it. The coordinator's rank logic (:mod:`recover.coord.ranks`) feeds one :class:`LinkJudge`.

Each replica whose collective of the current generation timed out while every member reached it
reports the members it cannot reach by a direct probe (``suspects``,
:meth:`recover.coord.client.CoordinatorClient.unreachable`). Rules:
  * The reports of generation g are held until every member reported, ``grace_s`` passed, or g is
    no longer current and healthy (a later generation formed, or g is failing already).
  * Then, if g is still current and healthy, the verdict is :func:`implicated`: the replica named
    unreachable by the most reporters; a reporter that cannot reach half the others or more
    implicates itself (its own link is down); ties go to the higher id; nobody named: nobody (a
    transient stall: the next generation keeps everyone). So a broken link never yields an endless
    series of generations with the same members.
  * Every held report is handed back with the verdict, to be answered by the membership state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

H = TypeVar("H")


@dataclass
class _Held(Generic[H]):
    since: float
    reports: dict[int, list[tuple[H, list[int]]]] = field(default_factory=dict)  # replica -> (handle, suspects)


@dataclass(frozen=True)
class Verdict(Generic[H]):
    """The reports of ``generation``, settled. ``judged``: it was still current and healthy, so
    ``unreachable`` (reporter -> the members it cannot reach) was judged and ``victim`` (None: nobody)
    is to be fenced. ``reports``: every held report, replica -> its handles, to answer."""

    generation: int
    judged: bool
    unreachable: dict[int, list[int]]
    victim: int | None
    reports: dict[int, list[H]]


class LinkJudge(Generic[H]):
    """See the module docstring. ``grace_s``: how long the reports of a generation are gathered."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._held: dict[int, _Held[H]] = {}  # generation -> its reports so far

    def hold(self, generation: int, replica: int, handle: H, suspects: list[int], now: float) -> None:
        """``replica`` reports that it cannot reach ``suspects`` after a collective of ``generation``."""
        held = self._held.setdefault(generation, _Held(now))
        held.reports.setdefault(replica, []).append((handle, suspects))

    @property
    def holding(self) -> bool:
        """Whether any report is held."""
        return bool(self._held)

    def pause(self, stall_s: float) -> None:
        """The caller was not running for ``stall_s``: the grace moves on by the gap."""
        for held in self._held.values():
            held.since += stall_s

    def settle(self, now: float, generation: int, healthy: bool, members: list[int]) -> list[Verdict[H]]:
        """The verdicts of the generations whose wait ended: ``generation`` is the current one, ``healthy``
        whether it is not failing, ``members`` its members still registered."""
        out = []
        for g in sorted(self._held):
            held = self._held[g]
            current = g == generation and healthy
            if current and now - held.since < self.grace_s and not set(members) <= set(held.reports):
                continue
            del self._held[g]
            unreachable = {r: sorted({s for _, named in reps for s in named}) for r, reps in held.reports.items()}
            out.append(Verdict(g, current, unreachable, implicated(members, unreachable) if current else None,
                               {r: [h for h, _ in reps] for r, reps in held.reports.items()}))
        return out


def implicated(members: list[int], unreachable: dict[int, list[int]]) -> int | None:
    """The replica the reports implicate (see the module docstring), or None."""
    others = max(1, len(members) - 1)
    blame: dict[int, int] = {}
    for reporter, named in unreachable.items():
        named = [r for r in named if r in members and r != reporter]
        if 2 * len(named) >= others and len(members) > 2:
            blame[reporter] = blame.get(reporter, 0) + len(members)
            continue
        for r in named:
            blame[r] = blame.get(r, 0) + 1
    return max(blame, key=lambda r: (blame[r], r)) if blame else None
