"""The link rule: after a collective or a rendezvous failed with nobody dead, whose links are broken.

Pure: no sockets, no threads, no clock (every event carries ``now``), like :mod:`recover.coord.liveness`
beside it. The coordinator's rank logic (:mod:`recover.coord.ranks`) feeds one :class:`LinkJudge`; the
membership state keeps the :class:`KnownCuts` it finds.

Each replica whose collective or rendezvous of the current generation failed (a timeout, or a peer
closing the pair after its own timeout) reports the members it cannot reach by a direct probe
(``suspects``, :meth:`recover.coord.client.CoordinatorClient.unreachable`). Rules:
  * The reports of generation g are held until every member reported, ``grace_s`` passed since the
    first, or g is no longer current and healthy (a later generation formed, or g is failing already).
    Every member of g times out within the collective timeout, so the wait ends within the collective
    timeout plus the grace: the job is resolved well within twice the collective timeout.
  * Then, if g is still current and healthy, the verdict is :func:`cut`: a pair is *broken* when
    either of its replicas named the other; the replicas fenced are the smallest set that leaves no
    broken pair among the rest (a fully connected group). Ties: the set with more members that did not
    report (a silent member is a suspect), then the one with the higher ids. Nobody named anyone: the
    silent members are fenced (they are the only suspects), or nobody if every member reported (a
    transient stall: the next generation keeps everyone). A replica that cannot reach most others is
    thus fenced alone (its own link is down). The rule reads only the reports, so every coordinator
    reaches the same verdict.
  * Every broken pair is remembered (:class:`KnownCuts`): no generation is formed with both replicas of
    a remembered pair until a probe showed that they connect again.
  * Every held report is handed back with the verdict, to be answered by the membership state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Generic, TypeVar

H = TypeVar("H")

EXACT_LIMIT = 16
"""Above this many replicas in broken pairs the smallest set is found greedily (still deterministic)."""

Pair = tuple[int, int]


@dataclass
class _Held(Generic[H]):
    since: float
    reports: dict[int, list[tuple[H, list[int]]]] = field(default_factory=dict)  # replica -> (handle, suspects)


@dataclass(frozen=True)
class Verdict(Generic[H]):
    """The reports of ``generation``, settled. ``judged``: it was still current and healthy, so
    ``unreachable`` (reporter -> the members it cannot reach) was judged: ``fenced`` are to be fenced
    (empty: nobody), ``broken`` the pairs known not to connect, ``silent`` the members that did not report.
    ``reports``: every held report, replica -> its handles, to answer."""

    generation: int
    judged: bool
    unreachable: dict[int, list[int]]
    fenced: tuple[int, ...]
    broken: tuple[Pair, ...]
    silent: tuple[int, ...]
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

    def holds(self, generation: int) -> bool:
        """Whether reports of ``generation`` are held (a later report of it is judged with them)."""
        return generation in self._held

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
            silent = tuple(sorted(set(members) - set(held.reports))) if current else ()
            broken = broken_pairs(members, unreachable) if current else ()
            fenced = cut(members, unreachable, silent) if current else ()
            out.append(Verdict(g, current, unreachable, fenced, broken, silent,
                               {r: [h for h, _ in reps] for r, reps in held.reports.items()}))
        return out


def broken_pairs(members: list[int], unreachable: dict[int, list[int]]) -> tuple[Pair, ...]:
    """The pairs of members of which one named the other unreachable, each as (lower, higher), sorted."""
    live = set(members)
    pairs = {(min(a, b), max(a, b)) for a, named in unreachable.items() if a in live
             for b in named if b in live and b != a}
    return tuple(sorted(pairs))


def cut(members: list[int], unreachable: dict[int, list[int]], silent: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The replicas to fence (see the module docstring): the smallest set that leaves no broken pair."""
    pairs = broken_pairs(members, unreachable)
    if not pairs:
        return tuple(sorted(s for s in silent if s in members))
    touched = sorted({r for p in pairs for r in p})
    quiet = set(silent)

    def rank(chosen: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:  # larger is preferred
        return (len(quiet & set(chosen)), tuple(sorted(chosen, reverse=True)))

    if len(touched) > EXACT_LIMIT:
        return _greedy(pairs, quiet)
    for k in range(1, len(touched) + 1):
        covers = [c for c in combinations(touched, k) if all(a in c or b in c for a, b in pairs)]
        if covers:
            return tuple(sorted(sorted(covers, key=rank)[-1]))  # the largest rank (the last of equals)
    return tuple(touched)  # unreachable: every replica in a pair covers them all


def _greedy(pairs: tuple[Pair, ...], quiet: set[int]) -> tuple[int, ...]:
    """Many replicas in broken pairs: repeatedly fence the one in most pairs left (silent first, then
    the higher id)."""
    left, chosen = set(pairs), []
    while left:
        degree: dict[int, int] = {}
        for a, b in left:
            degree[a], degree[b] = degree.get(a, 0) + 1, degree.get(b, 0) + 1
        r = max(degree, key=lambda x: (degree[x], x in quiet, x))
        chosen.append(r)
        left = {p for p in left if r not in p}
    return tuple(sorted(chosen))


class KnownCuts:
    """The pairs of replicas known not to connect (see the module docstring)."""

    def __init__(self) -> None:
        self.pairs: set[Pair] = set()

    def add(self, pairs: tuple[Pair, ...] | list[Pair]) -> None:
        """``pairs`` were found broken."""
        self.pairs |= {(min(a, b), max(a, b)) for a, b in pairs}

    def blocked(self, replica: int, others: set[int] | list[int]) -> list[int]:
        """The replicas of ``others`` that ``replica`` is known not to connect to."""
        return sorted({b if a == replica else a for a, b in self.pairs if replica in (a, b)} & set(others))

    def connected(self, replica: int, reached: list[int]) -> list[Pair]:
        """``replica``'s probe reached ``reached``: those pairs connect again. Returns the pairs cleared."""
        gone = [p for p in self.pairs if replica in p and (p[0] if p[1] == replica else p[1]) in reached]
        self.pairs -= set(gone)
        return sorted(gone)
