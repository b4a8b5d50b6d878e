"""The rule "the P ranks of a replica are one member": their registers, acks and votes gathered into one.

Pure: no sockets, no threads, no clock. Both sides of the control plane hold one :class:`Member`
per replica and feed it the same events: the replica's relay (:mod:`recover.coord.relay`, for the
ranks of its process group on the node) and the coordinator (:mod:`recover.coord.ranks`, for ranks
that connect on their own, or a relay that speaks for a whole replica). Each caller names who asked
with an opaque *handle* (a connection and its request id); the member hands the handles back, in
rank order and without repeats, when an event completes.

Rules:
  * ``register``: every rank in 0..P-1 once, all with the same P and ``join``; a rank that breaks
    this is refused (:class:`~recover.coord.state.Refused` ``rank_mismatch`` or ``duplicate_rank``)
    and the member is unchanged. The member is *registered* once all P are in.
  * ``ack`` of generation g counts once all P acked g (acks of older generations are then moot).
  * ``vote``: a rank's :class:`~recover.coord.protocol.Ballot` is held until every rank voted. All P
    alike (same generation, step and ids) are one vote of the member (``Ballot.of_ranks``: the
    slowest rank's seconds per microbatch, a stop if any rank asked for one, the ranks' fingerprints
    in rank order so that lane k is compared with lane k; a replica of several ranks does not audit).
    Ranks that vote differently (:class:`Disagreed`) mean the replica is broken: every held vote is
    handed back. A second vote of a rank while its first is held is refused (``duplicate_vote``).
  * A message that speaks for every rank at once (a relay's) completes the event by itself.
  * Held votes of generations that a ``failing`` or ``membership`` push ends are handed back by
    :meth:`Member.abort_votes`, to be answered ``aborted``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from recover.coord.actions import Refused
from recover.coord.protocol import Ballot

H = TypeVar("H", bound=Hashable)


@dataclass(frozen=True)
class Agreed(Generic[H]):
    """Every rank voted alike: ``ballot`` is the member's, its reply goes to ``asked`` (rank order)."""

    ballot: Ballot
    asked: list[H]


@dataclass(frozen=True)
class Disagreed(Generic[H]):
    """The ranks voted differently: ``held`` (rank -> (handle, ballot)) are every vote held."""

    held: dict[int, tuple[H, Ballot]]


class Member(Generic[H]):
    """The ranks of one replica as one member (see the module docstring).

    Args:
        replica: its id (for messages).
        ranks: P, its number of ranks.
        join: whether it registers to join a running job.
    """

    def __init__(self, replica: int, ranks: int, join: bool) -> None:
        if ranks < 1:
            raise ValueError(f"a replica has ranks >= 1, got {ranks}")
        self.replica, self.ranks, self.join = replica, ranks, join
        self.every = tuple(range(ranks))
        self.asked: dict[int, H] = {}  # rank -> the handle of its register
        self._acks: dict[int, set[int]] = {}  # generation -> ranks that acked it
        self._votes: dict[int, tuple[H, Ballot]] = {}  # rank -> its held vote

    def who(self, rank: int) -> str:
        return f"replica {self.replica}" + (f" rank {rank}" if self.ranks > 1 else "")

    # ------------------------------------------------------------- register

    @property
    def registered(self) -> bool:
        """All P ranks registered."""
        return len(self.asked) == self.ranks

    def check_register(self, rank: int | None, ranks: int, join: bool) -> None:
        """Raises Refused unless ``rank`` (None: every rank at once) of ``ranks`` may register now."""
        if ranks != self.ranks or join != self.join:
            raise Refused("rank_mismatch", f"rank {rank} of replica {self.replica} declares ranks={ranks} "
                                           f"join={join}, but its rank(s) {sorted(self.asked)} declared "
                                           f"ranks={self.ranks} join={self.join}")
        if rank is None and self.asked or rank in self.asked:
            raise Refused("duplicate_rank", f"rank {rank} of replica {self.replica} is already registered")

    def register(self, rank: int | None, ranks: int, join: bool, handle: H) -> list[H] | None:
        """Rank ``rank`` (None: every rank) registers; the handles of all P (rank order, no repeats) once
        all are in, else None. Raises Refused (see :meth:`check_register`)."""
        self.check_register(rank, ranks, join)
        self.asked.update(dict.fromkeys(self.every if rank is None else (rank,), handle))
        return _unique([self.asked[k] for k in self.every]) if self.registered else None

    # ------------------------------------------------------------- ack

    def ack(self, ranks: tuple[int, ...], generation: int) -> bool:
        """``ranks`` acked ``generation``: True once all P did (then older acks are forgotten)."""
        if len(ranks) < self.ranks:
            got = self._acks.setdefault(generation, set())
            got.update(ranks)
            if len(got) < self.ranks:
                return False
        if self._acks:
            for g in [g for g in self._acks if g <= generation]:
                del self._acks[g]
        return True

    # ------------------------------------------------------------- vote

    def vote(self, ranks: tuple[int, ...], handle: H, ballot: Ballot) -> Agreed[H] | Disagreed[H] | None:
        """``ranks`` voted ``ballot``: the member's vote once all P agree, Disagreed when they do not, None
        while some have not voted. Raises Refused ``duplicate_vote``."""
        if len(ranks) == self.ranks:  # one voice for every rank (a relay's): its ballot is the member's
            return Agreed(ballot if self.ranks == 1 else _no_audit(ballot), [handle])
        if again := [k for k in ranks if k in self._votes]:
            raise Refused("duplicate_vote", f"{self.who(again[0])} already voted in generation {ballot.generation}")
        agree = not self._votes or next(iter(self._votes.values()))[1].key == ballot.key  # the held agree
        self._votes.update(dict.fromkeys(ranks, (handle, ballot)))
        if not agree:
            held, self._votes = self._votes, {}
            return Disagreed(dict(sorted(held.items())))
        if len(self._votes) < self.ranks:
            return None
        held, self._votes = self._votes, {}
        return Agreed(Ballot.of_ranks([held[k][1] for k in self.every]),
                      _unique([held[k][0] for k in self.every]))

    def abort_votes(self, below: int | None = None) -> list[tuple[H, int]]:
        """Drops the held votes of generations before ``below`` (None: every held vote): ``(handle,
        generation)`` of each, rank order, no repeats."""
        if not self._votes:
            return []
        gone = {k: v for k, v in self._votes.items() if below is None or v[1].generation < below}
        for k in gone:
            del self._votes[k]
        return _unique([(h, b.generation) for _, (h, b) in sorted(gone.items())])

    @property
    def held(self) -> dict[int, Ballot]:
        """The ballots held, by rank."""
        return {k: b for k, (_, b) in sorted(self._votes.items())}


def _no_audit(ballot: Ballot) -> Ballot:
    return ballot if ballot.audit is None else ballot._replace(audit=None)


def _unique(items: list[Any]) -> list[Any]:
    """``items`` without repeats, first seen first (the ranks of a relay share one handle)."""
    return list(dict.fromkeys(items))
