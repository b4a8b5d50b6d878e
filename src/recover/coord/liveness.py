"""Liveness is progress, not heartbeats: a replica that stops advancing is hung, whether or not others wait.

A heartbeat proves that a process's heartbeat thread runs, not that its training loop advances (a
stuck kernel, an NCCL hang, a deadlocked data loader leave the heartbeats going). So every rank's
heartbeat also carries its training thread's progress counter (bumped at every phase point of every
step: each microbatch's forward and backward, the reduction, the vote, ...) and its activity:

  ``compute``  it owes the others progress (the default);
  ``wait``     it is blocked for the others: in a collective, a commit vote, a generation forming;
  ``io``       a checkpoint save or an evaluation: long and legitimate, so judged by the same rule
               with ``IO_FACTOR`` x the hang timeout (a training thread stuck in io is still found).

Rule (pure: every call carries ``now``): replica R is *hung* when

* one of its ranks has been in ``compute`` (``io``) with an unchanged counter for longer than the hang
  timeout (``IO_FACTOR`` x it) while a rank of another live replica is in ``wait``; or
* the same, with nobody waiting (a replica alone, or every replica stuck at once), once the replica has
  voted since it registered: its first step (compilation, warm-up, the first reads) is judged only by
  the rule above, so a job that starts slowly everywhere is not fenced, while a lone survivor that
  hangs later is (the job then goes on from a checkpoint: :mod:`recover.coord.state`); or
* generation g has been formed for longer than the hang timeout, R is a member, and a rank of R in
  ``wait`` still reports (``generation`` in its heartbeat: the newest generation its training thread
  moved on to) an older generation: a waiting training thread is woken by the failure notice and
  moves on within milliseconds, so one that has not is stuck (a hang inside a wait); or
* a commit vote of the current generation began longer than the hang timeout ago and a rank of R,
  without progress for as long, has not voted: the first vote means the reduction completed, which
  every member took part in, so a healthy member votes within milliseconds of the others.

The
timeout is ``hang_timeout_s`` when set (> 0); else ``max(min_s, factor x the median step time)``,
the step times being the intervals between the commits this coordinator saw (``min_s`` alone until
there are 3 of them).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import compress, repeat
from operator import eq, ne

ACTIVITIES = ("compute", "wait", "io")
DEFAULT_MIN_S = 60.0
DEFAULT_FACTOR = 10.0
IO_FACTOR = 10.0


@dataclass
class _Rank:
    """One rank's record, as :class:`_Ranks` hands it out (a copy: reading it changes nothing)."""

    progress: int
    activity: str
    since: float
    """When ``progress`` last changed (or the rank entered ``compute``)."""
    generation: int | None = None
    """The newest generation its training thread moved on to (None: not reported)."""


class _Ranks(Mapping[int, _Rank]):
    """The ranks of one replica as parallel lists, indexed by rank (0..P-1): what each rank's heartbeat
    reported (``progress``, ``activity``, ``generation``) and ``since`` (when its progress last changed, or
    it entered ``compute``). A relay's batched heartbeat of all P ranks updates them a list at a time, in C
    (:meth:`Liveness.beats`); read as a mapping, rank -> :class:`_Rank`."""

    __slots__ = ("progress", "activity", "since", "generation")

    def __init__(self, ranks: int, now: float) -> None:
        self.progress: list[int] = [-1] * ranks
        self.activity: list[str] = ["compute"] * ranks
        self.since: list[float] = [now] * ranks
        self.generation: list[int | None] = [None] * ranks

    def __getitem__(self, rank: int) -> _Rank:
        if not 0 <= rank < len(self.progress):
            raise KeyError(rank)
        return _Rank(self.progress[rank], self.activity[rank], self.since[rank], self.generation[rank])

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.progress)))

    def __len__(self) -> int:
        return len(self.progress)

    def beat(self, rank: int, progress: int | None, activity: str | None, now: float,
             generation: int | None) -> None:
        """One rank's heartbeat (see :meth:`Liveness.heartbeat`)."""
        if generation is not None:
            self.generation[rank] = generation
        if progress is None:
            self.activity[rank] = "legacy"  # never judged
            return
        activity = activity if activity in ACTIVITIES else "compute"
        if progress != self.progress[rank] or (activity != "wait" and self.activity[rank] != activity):
            self.since[rank] = now
        self.progress[rank], self.activity[rank] = progress, activity

    def beat_all(self, progress: list[int], activity: list[str], now: float, generation: list[int]) -> None:
        """A heartbeat of every rank at once, in rank order: the rule of :meth:`beat` for each, a list at a
        time (``activity`` holds names of :data:`ACTIVITIES` only)."""
        # (updated in place: lists that the server's gc.freeze took out of the collector's reach stay out of it)
        old = self.progress
        if activity == self.activity:  # no rank changed activity: a clock restarts where progress changed
            if progress != old:
                if all(map(ne, progress, old)):
                    self.since[:] = [now] * len(old)
                else:
                    moved = map(ne, progress, old)
                    self.since[:] = [now if m else s for m, s in zip(moved, self.since, strict=True)]
        else:
            both = zip(progress, old, activity, self.activity, self.since, strict=True)
            self.since[:] = [now if p != o or (a != "wait" and a != was) else s for p, o, a, was, s in both]
            self.activity[:] = activity
        old[:] = progress
        self.generation[:] = generation

    def earliest(self, activity: str) -> float | None:
        """The earliest ``since`` of the ranks in ``activity`` (None: no rank is)."""
        n = self.activity.count(activity)
        if n == 0:
            return None
        if n == len(self.activity):
            return min(self.since)
        return min(compress(self.since, map(eq, self.activity, repeat(activity))))


@dataclass
class _Summary:
    """What the hang rule asks of a replica's ranks, kept per replica so that a scan of a large job visits a
    replica's ranks only when one of them may be judged: the earliest ``since`` of its ranks in ``compute``
    and in ``io``, whether one waits, and the oldest generation a waiting rank reported."""

    compute_since: float | None
    io_since: float | None
    waits: bool
    oldest_wait: int | None

    @classmethod
    def of(cls, ranks: _Ranks) -> _Summary:
        waits = "wait" in ranks.activity
        oldest = None
        if waits:
            both = zip(ranks.generation, ranks.activity, strict=True)
            oldest = min((g for g, a in both if a == "wait" and g is not None), default=None)
        return cls(ranks.earliest("compute"), ranks.earliest("io"), waits, oldest)


class Liveness:
    """Per-rank progress of the registered replicas, and the hang rule (see the module docstring)."""

    def __init__(self, hang_timeout_s: float = 0.0, min_s: float = DEFAULT_MIN_S,
                 factor: float = DEFAULT_FACTOR) -> None:
        if hang_timeout_s < 0 or min_s <= 0 or factor <= 0:
            raise ValueError(f"hang_timeout_s = {hang_timeout_s} must be >= 0, min_s = {min_s} and "
                             f"factor = {factor} > 0")
        self.hang_timeout_s, self.min_s, self.factor = hang_timeout_s, min_s, factor
        self._replicas: dict[int, _Ranks] = {}
        self._summaries: dict[int, _Summary] = {}  # replica -> its ranks summed up, dropped when a rank changes
        self._commits: deque[tuple[int, float]] = deque(maxlen=21)
        self._formed: tuple[int, tuple[int, ...], float] | None = None  # (generation, members, when)
        self._ballot: tuple[float, set[tuple[int, int | None]]] | None = None  # (first vote, (replica, rank) voted)
        self._warm: set[int] = set()  # replicas that voted since they registered (past their first step)

    def start(self, replica: int, ranks: int, now: float) -> None:
        """Replica ``replica`` of ``ranks`` ranks is registered: its clocks start now."""
        self._replicas[replica] = _Ranks(ranks, now)
        self._summaries.pop(replica, None)
        self._warm.discard(replica)

    def forget(self, replica: int) -> None:
        """The replica is gone (dead, fenced or left)."""
        self._replicas.pop(replica, None)
        self._summaries.pop(replica, None)
        self._warm.discard(replica)

    def pause(self, stall_s: float) -> None:
        """The coordinator did not run for ``stall_s``: every clock moves on by it (nobody is judged
        for a silence the coordinator itself caused)."""
        for ranks in self._replicas.values():
            ranks.since[:] = [s + stall_s for s in ranks.since]
        self._summaries.clear()
        if self._formed is not None:
            g, members, when = self._formed
            self._formed = (g, members, when + stall_s)
        if self._ballot is not None:
            self._ballot = (self._ballot[0] + stall_s, self._ballot[1])

    def formed(self, generation: int, members: list[int] | tuple[int, ...], now: float) -> None:
        """Generation ``generation`` of ``members`` was formed (its members are told now)."""
        if self._formed is None or generation > self._formed[0]:
            self._formed = (generation, tuple(members), now)
            self._ballot = None

    def voted(self, replica: int, rank: int | None, now: float) -> None:
        """Rank ``rank`` of ``replica`` (None: every rank of it) sent its commit vote for the current
        generation's next step."""
        if self._ballot is None:
            self._ballot = (now, set())
        self._ballot[1].add((replica, rank))
        self._warm.add(replica)

    def heartbeat(self, replica: int, rank: int, progress: int | None, activity: str | None, now: float,
                  generation: int | None = None) -> None:
        """A heartbeat of rank ``rank`` of ``replica`` (older clients send neither field: never judged)."""
        ranks = self._replicas.get(replica)
        if ranks is None or not 0 <= rank < len(ranks):
            return
        self._summaries.pop(replica, None)
        ranks.beat(rank, progress, activity, now, generation)

    def beats(self, replica: int, progress: list[int], activity: list[str], now: float,
              generation: list[int]) -> None:
        """A batched heartbeat of every rank of ``replica``, in rank order (a relay's ``hbs``): the same as a
        :meth:`heartbeat` of each rank, in C rather than per rank. ``activity`` names activities of
        :data:`ACTIVITIES` only; the lists are as long as the replica has ranks."""
        ranks = self._replicas.get(replica)
        if ranks is None:
            return
        if not len(progress) == len(activity) == len(generation) == len(ranks):
            raise ValueError(f"a batched heartbeat of replica {replica} names {len(progress)} ranks, not its "
                             f"{len(ranks)}")
        self._summaries.pop(replica, None)
        ranks.beat_all(progress, activity, now, generation)

    def committed(self, step: int, now: float) -> None:
        """A step was committed (called once per step or more: repeats of a step are ignored)."""
        self._ballot = None
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

    def _summary(self, replica: int) -> _Summary:
        found = self._summaries.get(replica)
        if found is None:
            found = self._summaries[replica] = _Summary.of(self._replicas[replica])
        return found

    def hung(self, now: float) -> list[tuple[int, str]]:
        """``(replica, detail)`` of every replica hung at ``now``, by replica id. A replica's ranks are visited
        only when its summary says one may be judged (a scan of 1,024 x 128 ranks costs 1,024 looks)."""
        limit = self.timeout()
        io_limit = IO_FACTOR * limit
        summaries = [(replica, self._summary(replica)) for replica in sorted(self._replicas)]
        waiting = {replica for replica, s in summaries if s.waits}
        ballot = self._ballot is not None and self._formed is not None and now - self._ballot[0] > limit
        out = []
        for replica, s in summaries:
            compute = s.compute_since is not None and now - s.compute_since > limit
            io = s.io_since is not None and now - s.io_since > io_limit
            if not (compute or io or s.oldest_wait is not None or ballot):
                continue  # no rank of it can be stale, behind or late to vote: nothing to judge
            ranks = self._replicas[replica]
            stale: list[tuple[int, float]] = []
            if compute or io:
                stale = [(k, now - since) for k, (activity, since) in enumerate(zip(ranks.activity, ranks.since,
                                                                                   strict=True))
                         if (activity == "compute" and now - since > limit)
                         or (activity == "io" and now - since > io_limit)]
            behind = self._behind(replica, ranks, now, limit) if s.oldest_wait is not None else None
            others = sorted(waiting - {replica}) if stale else []
            if stale and (others or replica in self._warm):
                # the rank behind the others (least progress, longest still) is the stuck one; those of its
                # replica blocked in a collective with it report ``wait`` and are not stale
                rank, silent = min(stale, key=lambda ks: (ranks.progress[ks[0]], -ks[1], ks[0]))
                in_io = ranks.activity[rank] == "io"
                where, allowed = ("in a save or evaluation, ", io_limit) if in_io else ("", limit)
                why = f"while replicas {others} waited for it" if others else "with no other replica waiting"
                out.append((replica, f"rank {rank} made no progress for {silent:.1f} s ({where}hang timeout "
                                     f"{allowed:.1f} s) {why}"))
            elif behind is not None:
                out.append((replica, behind))
            elif (stuck := self._not_voting(replica, ranks, now, limit)) is not None:
                out.append((replica, stuck))
        return out

    def _not_voting(self, replica: int, ranks: _Ranks, now: float, limit: float) -> str | None:
        """Why a rank of ``replica`` counts as stuck before its vote, or None."""
        if self._ballot is None or self._formed is None or replica not in self._formed[1]:
            return None
        first, voted = self._ballot
        if now - first <= limit or (replica, None) in voted:
            return None
        for k, (progress, since) in enumerate(zip(ranks.progress, ranks.since, strict=True)):
            if (replica, k) not in voted and progress >= 0 and now - since > limit:
                return (f"rank {k} has not voted {now - first:.1f} s after the others began to (hang timeout "
                        f"{limit:.1f} s) and made no progress since: its training thread is stuck")
        return None

    def _behind(self, replica: int, ranks: _Ranks, now: float, limit: float) -> str | None:
        """Why a rank of ``replica`` is stuck in a wait of a generation older than the current one, or None."""
        if self._formed is None:
            return None
        generation, members, when = self._formed
        if replica not in members or now - when <= limit:
            return None
        for k, (activity, reported) in enumerate(zip(ranks.activity, ranks.generation, strict=True)):
            if activity == "wait" and reported is not None and reported < generation:
                return (f"rank {k} is still waiting in generation {reported} {now - when:.1f} s after "
                        f"generation {generation} formed (hang timeout {limit:.1f} s): its training thread is stuck")
        return None

    def activities(self, replica: int) -> tuple[str, ...]:
        """The activity of each rank of ``replica`` in its last heartbeat, in rank order (none: unknown)."""
        ranks = self._replicas.get(replica)
        return tuple(ranks.activity) if ranks is not None else ()

    def away(self, replica: int) -> bool:
        """Whether a rank of ``replica`` is in ``compute`` or ``io``: not at a collective of the others."""
        ranks = self._replicas.get(replica)
        return ranks is not None and ("compute" in ranks.activity or "io" in ranks.activity)

    def waiting(self) -> set[int]:
        """Replicas with a rank blocked for the others (in a collective, a vote, ...)."""
        return {rep for rep in self._replicas if self._summary(rep).waits}
