"""The coordinator's view of its connections and replicas, and the actions it hands the server.

Pure data and checks, no I/O (see :mod:`recover.coord.ranks`, their one user): a :class:`Link` is one
connection, a :class:`Slot` the connections of one replica by rank with its ranks as one member
(:mod:`recover.coord.member`). A connection that registers with ``relay=true`` is the link of every
rank of its replica; its messages name the ``rank`` they speak for, or none for every rank
(:meth:`Slot.ranks_of`). :func:`check_register` holds the rules a ``register`` must pass before it
counts, :func:`replica_resume` what a replica of several ranks holds after a coordinator restart.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from recover.coord.actions import Log, Refused
from recover.coord.member import Member
from recover.coord.protocol import ProtocolError, Resume, register_ranks


@dataclass(frozen=True)
class SendTo:
    """Queue ``msg`` on connection ``conn``."""

    conn: Hashable
    msg: dict[str, Any]


@dataclass(frozen=True)
class Close:
    """Close connection ``conn``; the logic will not address it again."""

    conn: Hashable


Out = SendTo | Close | Log


@dataclass(eq=False)
class Link:
    """One connection as the logic knows it."""

    conn: Hashable
    peer: str
    opened: float
    last_seen: float
    replica: int | None = None  # set once its register is accepted (its replica may still wait for ranks)
    rank: int = 0
    closed: bool = False
    relay: bool = False  # carries every rank of its replica (one connection per replica)
    operator: bool = False  # an operator's (:mod:`recover.coord.operator`): no member, never timed out


Asked = tuple[Link, int]
"""A request: the connection that sent it and its own request id."""


@dataclass(eq=False)
class Slot:
    """The connections of one replica, by rank, and its ranks as one member. The state hears of the
    replica (``registered``) once all ``ranks`` ranks registered; the slot is dropped as a whole when
    any of them goes."""

    replica: int
    ranks: int
    join: bool
    links: dict[int, Link] = field(default_factory=dict)
    registered: bool = False
    resume: dict[int, Resume] = field(default_factory=dict)  # rank -> what it holds (a restarted coordinator)
    routes: dict[int, list[Asked]] = field(default_factory=dict)  # forwarded id -> who asked
    seen: list[float] = field(default_factory=list)  # relay: by rank, its newest entry in a batched heartbeat
    conns: list[Link] = field(default_factory=list)  # its distinct connections (a relay: one), for pushes
    probe: str | None = None  # rank 0's link probe listener, host:port (its register's ``probe``)
    pids: set[int] = field(default_factory=set)  # its registered processes' PIDs (a relay's: its rank 0's)
    member: Member[Asked] = field(init=False)
    order: list[int] = field(init=False)  # its ranks in rank order: a batched heartbeat of every rank names these

    def __post_init__(self) -> None:
        self.member = Member(self.replica, self.ranks, self.join)
        self.order = list(range(self.ranks))

    def who(self, rank: int) -> str:
        return self.member.who(rank)

    def ranks_of(self, link: Link, msg: dict[str, Any]) -> tuple[int, ...]:
        """The ranks a message speaks for: its connection's rank, or on a relay the ``rank`` it names
        (none: every rank of the replica). Raises Refused ``bad_rank``."""
        rank = msg.get("rank")
        if not link.relay:
            if rank is not None and rank != link.rank:
                raise Refused("bad_rank", f"this connection is {self.who(link.rank)}, not rank {rank}")
            return (link.rank,)
        if rank is None:
            return self.member.every
        if not 0 <= rank < self.ranks:
            raise Refused("bad_rank", f"rank must be in 0..{self.ranks - 1} for replica {self.replica}, got {rank}")
        return (rank,)


def check_register(msg: dict[str, Any], slot: Slot | None, alive: bool) -> tuple[int, int]:
    """``(rank, ranks)`` of a ``register`` of replica ``msg["replica"]``, whose slot so far is ``slot``
    and which the state holds ``alive`` (or not). Raises Refused."""
    r, join = msg["replica"], msg["join"]
    if r < 0:
        raise Refused("bad_replica", f"replica id must be >= 0, got {r}")
    try:
        rank, ranks = register_ranks(msg)
    except ProtocolError as exc:
        raise Refused(exc.code, f"replica {r}: {exc.message}") from None
    if alive or (slot is not None and slot.registered):
        raise Refused("duplicate_replica", f"replica {r} is already registered and alive")
    if slot is not None and msg.get("relay"):
        raise Refused("rank_mismatch", f"a relay registers every rank of replica {r}, but its rank(s) "
                                       f"{sorted(slot.links)} registered on connections of their own")
    if msg.get("relay") and "rank" in msg:
        raise Refused("bad_rank", f"a relay of replica {r} speaks for all its ranks: its register names no rank")
    if slot is not None:
        slot.member.check_register(rank, ranks, join)
    return rank, ranks


def replica_resume(held: Any) -> Resume | None:
    """What a replica of several ranks holds: the least any of its ranks committed (a rank that missed
    a commit makes the whole replica behind), with the newest generation any of them knows."""
    held = list(held)
    if not held:
        return None
    least = min(held, key=lambda r: r.committed)
    newest = max(held, key=lambda r: r.generation)
    return Resume(newest.generation, newest.members, least.committed, least.speeds)
