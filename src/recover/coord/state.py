"""The coordinator's membership state machine: pure logic, no sockets, no clock of its own.

Contract: the server feeds events (``on_register``, ``on_dead``, ``on_ack``, ``on_report``,
``on_vote``, ``on_tick``) from one thread, in the order it observes them, with the current
monotonic time; each call returns the actions to carry out, in order (:class:`Send` a message to a
replica, :class:`Fence` a replica off, :class:`Log` an event). A request it refuses raises
:class:`Refused`; the state is then unchanged.

Invariants:
  * Single writer: only this object forms generations; each change adds exactly one.
  * A generation g is replaced only through a *failure round*: every live member of g is told
    ``failing(g)`` and acks it; a member is dead when its connection closed, its heartbeats stopped,
    or it did not ack within ``ack_timeout_s`` (then it is fenced). Generation g+1 is exactly the
    members that acked, so every survivor learns the same dead set.
  * A step is committed only when every member of the current generation voted the same
    ``(step, ids)``; then all of them are told ``committed``, otherwise all are told ``aborted``.
    A failure round aborts every pending vote: never half-committed.
  * Speeds: each vote carries the seconds per microbatch its replica measured; at a commit they
    feed the :class:`~recover.workload.speeds.SpeedTracker` (the single writer of the plan's
    times), whose planned times go with every ``committed`` reply and every membership, so all
    members (joiners too) plan the next step alike. Stragglers and rebalances are logged.
  * Joiners are admitted only at a commit (a step boundary), or at once when no member is left.
    ``Membership.joined`` lists the members admitted since the last commit: a generation formed
    by a failure before that commit carries them on, so the state transfer is done again on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recover.coord.protocol import Membership, speeds_to_wire
from recover.workload.speeds import SpeedTracker


@dataclass(frozen=True)
class Send:
    replica: int
    msg: dict[str, Any]


@dataclass(frozen=True)
class Fence:
    """Close this replica's connection: it is declared dead and must not act on its own."""

    replica: int
    reason: str


@dataclass(frozen=True)
class Log:
    kind: str
    fields: dict[str, Any]


Action = Send | Fence | Log


class Refused(Exception):
    """A request the coordinator will not act on; ``code`` goes back in the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class _Round:
    generation: int
    reason: str
    started: float
    deadline: float
    dead: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    """Members neither acked nor dead: kept up to date so each ack costs O(1), not O(members)."""


class MembershipState:
    """Generations, failure rounds, commit votes and joins (see the module docstring)."""

    def __init__(self, *, expected: int, min_members: int, store_host: str, store_port: int,
                 ack_timeout_s: float, speeds: SpeedTracker | None = None) -> None:
        if expected < 1:
            raise ValueError(f"expected replicas must be >= 1, got {expected}")
        self.expected = expected
        self.min_members = min_members
        self.store_host = store_host
        self.store_port = store_port
        self.ack_timeout_s = ack_timeout_s
        self.current: Membership | None = None
        self.committed_step = -1
        self.live: set[int] = set()
        self.initial: set[int] = set()
        self.pending_join: set[int] = set()
        self.fresh: set[int] = set()  # admitted since the last commit: may still need state
        self.round: _Round | None = None
        self.votes: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.speeds = speeds or SpeedTracker()
        self._mb_s: dict[int, float] = {}  # the measured seconds per microbatch of the pending votes
        self._members: frozenset[int] = frozenset()  # the current generation's, for O(1) lookups

    @property
    def generation(self) -> int:
        return self.current.generation if self.current else 0

    # ------------------------------------------------------- read-only views

    @property
    def failing(self) -> bool:
        """True while a failure round is open (the current generation is being replaced)."""
        return self.round is not None

    def is_live(self, replica: int) -> bool:
        """True if ``replica`` registered and has not been declared dead since."""
        return replica in self.live

    def accepts_vote(self, replica: int, generation: int, step: int) -> bool:
        """True when ``on_vote(replica, _, generation, step, ...)`` would record the vote and wait
        for the other members; False when it would refuse it or answer ``aborted`` at once."""
        cur = self.current
        return (cur is not None and generation == cur.generation and replica in self._members
                and self.round is None and step > self.committed_step and replica not in self.votes)

    def summary(self) -> dict[str, Any]:
        """Generation, members, committed step, live and pending replicas, and ``failing``: copies."""
        return {"generation": self.generation, "members": list(self.current.members) if self.current else [],
                "committed_step": self.committed_step, "live": sorted(self.live),
                "pending_join": sorted(self.pending_join), "failing": self.failing}

    # ----------------------------------------------------------------- events

    def on_register(self, replica: int, join: bool, req_id: int, now: float) -> list[Action]:
        if replica < 0:
            raise Refused("bad_replica", f"replica id must be >= 0, got {replica}")
        if replica in self.live:
            raise Refused("duplicate_replica", f"replica {replica} is already registered and alive")
        self.live.add(replica)
        acts: list[Action] = [Send(replica, {"type": "ok", "re": req_id, "generation": self.generation}),
                              Log("register", {"replica": replica, "join": join})]
        if self.current is None:
            self.initial.add(replica)
            if len(self.initial) >= self.expected:
                acts += self._form(sorted(self.initial), "initial", now)
        elif not self.current.members and self.round is None:
            self.pending_join.add(replica)
            acts += self._admit_joiners(now)
        else:
            self.pending_join.add(replica)
            acts.append(Log("join_request", {"replica": replica, "generation": self.generation}))
        return acts

    def on_dead(self, replica: int, cause: str, now: float) -> list[Action]:
        if replica not in self.live:
            return []
        self.live.discard(replica)
        self.initial.discard(replica)
        self.pending_join.discard(replica)
        self.speeds.forget(replica)
        acts: list[Action] = [Log("failure_detected", {"replica": replica, "cause": cause,
                                                       "generation": self.generation})]
        if self.current is not None and replica in self._members:
            acts += self._start_round(f"replica {replica}: {cause}", now)
            assert self.round is not None
            self.round.dead.add(replica)
            self.round.pending.discard(replica)
            acts += self._check_round(now)
        return acts

    def on_ack(self, replica: int, generation: int, now: float) -> list[Action]:
        r = self.round
        if r is None or r.generation != generation or self.current is None:
            return []
        if replica in r.pending:
            r.acked.add(replica)
            r.pending.discard(replica)
        return self._check_round(now)

    def on_report(self, replica: int, req_id: int, generation: int, suspects: list[int],
                  now: float) -> list[Action]:
        if self.current is None or not 1 <= generation <= self.generation:
            raise Refused("bad_generation", f"report for generation {generation}; current is {self.generation}")
        stale = generation < self.generation
        if not stale and replica not in self._members:
            raise Refused("not_member", f"replica {replica} is not a member of generation {generation}")
        acts: list[Action] = [
            Log("failure_report", {"replica": replica, "generation": generation, "suspects": suspects,
                                   "superseded": stale}),
            Send(replica, {"type": "ok", "re": req_id, "generation": self.generation}),
        ]
        if not stale:
            acts += self._start_round(f"collective failure reported by replica {replica}", now)
            acts += self._check_round(now)
        return acts

    def on_vote(self, replica: int, req_id: int, generation: int, step: int, ids: list[int],
                now: float, mb_s: float | None = None) -> list[Action]:
        """A member's commit vote; ``mb_s`` is the seconds per microbatch it measured in the step."""
        cur = self.current
        if cur is None or generation != cur.generation or replica not in self._members:
            raise Refused("stale_generation",
                          f"vote of replica {replica} for generation {generation}; current is {self.generation}")
        if self.round is not None:
            return [Send(replica, {"type": "aborted", "re": req_id, "generation": generation,
                                   "reason": "generation is failing"})]
        if step <= self.committed_step:
            raise Refused("stale_step", f"step {step} is already committed (last {self.committed_step})")
        if replica in self.votes:
            raise Refused("duplicate_vote", f"replica {replica} already voted in generation {generation}")
        self.votes[replica] = (req_id, step, tuple(sorted(ids)))
        if mb_s is not None:
            self._mb_s[replica] = mb_s
        if len(self.votes) < len(cur.members):  # only members vote, once each: O(1), not O(members)
            return []
        votes, self.votes = self.votes, {}
        measured, self._mb_s = self._mb_s, {}
        ballots = {(s, i) for _, s, i in votes.values()}
        if len(ballots) != 1:
            acts: list[Action] = [Log("vote_disagreement", {"generation": generation, "ballots": {
                str(r): {"step": s, "ids": len(i)} for r, (_, s, i) in votes.items()}})]
            acts += [Send(r, {"type": "aborted", "re": rid, "generation": generation,
                              "reason": "commit vote disagreement"}) for r, (rid, _, _) in votes.items()]
            return acts + self._start_round("commit vote disagreement", now) + self._check_round(now)
        self.committed_step = step
        self.fresh.clear()
        acts = [Log("commit", {"generation": generation, "step": step, "ids": len(ids)})]
        acts += self._observe_speeds(step, len(ids), cur.members, measured)
        new_gen = None
        if self.pending_join:
            acts += self._admit_joiners(now)
            new_gen = self.generation
        speeds = speeds_to_wire(self.speeds.planned)
        acts += [Send(r, {"type": "committed", "re": rid, "generation": generation, "step": step,
                          "new_generation": new_gen, "speeds": speeds}) for r, (rid, _, _) in votes.items()]
        return acts

    def on_tick(self, now: float) -> list[Action]:
        return self._check_round(now) if self.round is not None else []

    def pause(self, stall_s: float) -> None:
        """The coordinator did not run for ``stall_s``: an open failure round's ack deadline moves on by it."""
        if self.round is not None:
            self.round.deadline += stall_s

    def _observe_speeds(self, step: int, microbatches: int, members: tuple[int, ...],
                        measured: dict[int, float]) -> list[Action]:
        acts: list[Action] = []
        for change in self.speeds.observe(microbatches, members, measured):
            fields: dict[str, Any] = {"step": step}
            if change.kind == "rebalanced":
                fields.update(speedup=change.factor, speeds={str(r): round(t, 6) for r, t in
                                                               sorted((self.speeds.planned or {}).items())})
            else:
                fields.update(replica=change.replica, slowdown=change.factor)
            acts.append(Log(change.kind, fields))
        return acts

    # ---------------------------------------------------------------- helpers

    def _start_round(self, reason: str, now: float) -> list[Action]:
        if self.round is not None or self.current is None:
            return []
        g = self.current.generation
        members = self.current.members
        self.round = _Round(g, reason, now, now + self.ack_timeout_s, dead={m for m in members if m not in self.live},
                            pending={m for m in members if m in self.live})
        msg = {"type": "failing", "generation": g, "dead": [], "reason": reason}
        acts: list[Action] = [Log("failing", {"generation": g, "reason": reason})]
        return acts + [Send(m, msg) for m in self.current.members if m in self.live]

    def _check_round(self, now: float) -> list[Action]:
        r, cur = self.round, self.current
        if r is None or cur is None:
            return []
        if r.pending and now < r.deadline:
            return []  # O(1) per ack and per tick: the members are walked once, when the round closes
        acts: list[Action] = []
        for m in sorted(r.pending):
            r.dead.add(m)
            self.live.discard(m)
            acts.append(Fence(m, f"no ack of failure notice for generation {r.generation} "
                                 f"within {self.ack_timeout_s:g} s"))
        self.round = None
        survivors = sorted(set(cur.members) - r.dead)
        acts += self._form(survivors, "failure", now, detail=r.reason, latency_s=now - r.started)
        if not survivors and self.pending_join:
            acts += self._admit_joiners(now)
        return acts

    def _admit_joiners(self, now: float) -> list[Action]:
        joiners = sorted(self.pending_join & self.live)
        self.pending_join.clear()
        if not joiners:
            return []
        self.fresh |= set(joiners)
        members = sorted(set(self.current.members if self.current else ()) | set(joiners))
        return self._form(members, "join", now)

    def _form(self, members: list[int], reason: str, now: float, *, detail: str = "",
              latency_s: float | None = None) -> list[Action]:
        old = self.current
        self.fresh &= set(members)
        joined = tuple(sorted(self.fresh))
        dead = tuple(sorted(set(old.members) - set(members))) if old else ()
        m = Membership(generation=self.generation + 1, members=tuple(members), store_host=self.store_host,
                       store_port=self.store_port, step=self.committed_step + 1, dead=dead, joined=joined,
                       min_members=self.min_members, reason=reason,
                       speeds=dict(self.speeds.planned) if self.speeds.planned else None)
        acts: list[Action] = [Send(r, {"type": "aborted", "re": rid, "generation": old.generation if old else 0,
                                       "reason": f"generation replaced ({reason})"})
                              for r, (rid, _, _) in self.votes.items() if r in self.live]
        self.votes, self._mb_s = {}, {}
        self.current = m
        self._members = frozenset(m.members)
        self.initial.clear()
        fields: dict[str, Any] = {"generation": m.generation, "members": list(m.members), "dead": list(dead),
                                  "joined": list(joined), "reason": reason, "step": m.step}
        if detail:
            fields["detail"] = detail
        if latency_s is not None:
            fields["latency_ms"] = round(latency_s * 1e3, 3)
        acts.append(Log("generation", fields))
        if len(members) < self.min_members:
            acts.append(Log("quorum_lost", {"generation": m.generation, "members": list(members),
                                            "min_members": self.min_members}))
        wire = {"type": "membership", "membership": m.to_wire()}
        return acts + [Send(r, wire) for r in m.members if r in self.live]
