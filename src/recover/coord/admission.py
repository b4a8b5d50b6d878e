"""A joiner must show up: a replica admitted into a generation starts its rendezvous in time, or is fenced.

Contract: the coordinator hosts the store its generations rendezvous on, so it can see who started.
Every rank of every member publishes its probe address (``probe/{replica}``) under its lane's prefix
of the generation (:meth:`~recover.coord.protocol.Membership.prefix`), sealed with the generation's
secret (:mod:`recover.coord.sealing`: nobody else can publish it), first thing when it forms that
generation's group (``recover.comm.group._rendezvous``). A replica
admitted at a step boundary (one of ``Membership.joined`` that was not a member of the generation
before) is *ready* once it has published that key on every lane, under the prefix of that generation
or of a later one it is still a member of (a failure while it forms moves it on). One that is not
ready ``ready_s`` after its admission is fenced by the coordinator (``join_not_ready``): that opens a
failure round, and the members, whose rendezvous waits for it, move on to the next generation
without it. So a joiner that registers and never rendezvouses (a broken process, or one that holds
the token but does not belong) costs the members at most ``ready_s``, instead of the rendezvous
timeout and the link rule (8-60 s); an honest joiner publishes within milliseconds of its membership,
and the honest path costs nothing more: the store is read once per watched joiner, at its deadline.

Replicas that were members of the previous generation are never watched (a generation that a failure
formed, a restarted coordinator's rebuild: they rendezvous as members always do, or an NCCL
communicator is shrunk without any rendezvous); neither is anyone in the first generation this
coordinator process forms.

Pure: no sockets, no clock of its own; the caller passes ``now`` and ``published``, its store lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from recover.coord.protocol import Membership
from recover.coord.sealing import sealed_key

JOIN_READY_S = 3.0
"""Seconds an admitted joiner has to start its rendezvous (``recover coordinator`` default)."""


@dataclass
class _Watch:
    deadline: float
    lanes: int
    keys: list[list[str]] = field(default_factory=list)
    """Per generation since the admission, the key each lane publishes there."""


class JoinWatch:
    """See the module docstring. ``lanes_of(replica)``: its ranks (None: no longer registered)."""

    def __init__(self, ready_s: float = JOIN_READY_S) -> None:
        if ready_s <= 0:
            raise ValueError(f"ready_s must be > 0, got {ready_s}")
        self.ready_s = ready_s
        self._previous: Membership | None = None
        self._watched: dict[int, _Watch] = {}

    @property
    def watching(self) -> list[int]:
        """The admitted replicas not yet seen ready, sorted."""
        return sorted(self._watched)

    def formed(self, m: Membership, lanes_of: Callable[[int], int | None], now: float) -> None:
        """Generation ``m`` was formed: its new joiners are watched from ``now``; watched replicas that
        left it are dropped, the others may publish under ``m``'s prefix too."""
        before = set(self._previous.members) if self._previous is not None else None
        self._previous = m
        members = set(m.members)
        self._watched = {r: w for r, w in self._watched.items() if r in members}
        if before is not None:
            for r in set(m.joined) - before - set(self._watched):
                lanes = lanes_of(r)
                if lanes is not None:
                    self._watched[r] = _Watch(now + self.ready_s, lanes)
        for r, w in self._watched.items():
            w.keys.append([sealed_key(m.secret, m.prefix(k, w.lanes), f"probe/{r}") for k in range(w.lanes)])

    def due(self, now: float, published: Callable[[str], bool]) -> list[int]:
        """The watched replicas whose deadline passed without their being ready (no longer watched
        from now on); those found ready are dropped too."""
        late: list[int] = []
        for r, w in list(self._watched.items()):
            if now < w.deadline:
                continue
            del self._watched[r]
            if not all(any(published(keys[k]) for keys in w.keys) for k in range(w.lanes)):
                late.append(r)
        return sorted(late)

    def pause(self, stall_s: float) -> None:
        """The coordinator did not run for ``stall_s``: every deadline moves on by it."""
        for w in self._watched.values():
            w.deadline += stall_s
