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
  * Admission: replica ids in ``[0, max_replicas)`` only (default ``expected``); any other is refused
    (``bad_replica``) and the job goes on. Every generation gets a fresh random ``secret``, sent only
    in its ``membership`` pushes (never logged): its group's store prefix (:mod:`recover.coord.protocol`).
  * Start: the first generation forms once every expected replica registered, or ``start_timeout_s`` after
    the first did, of those registered when at least ``min_members`` are (``start_timeout``); the others
    join at a step boundary when they come. A replica that never starts never holds the job up for good.
  * Joiners are admitted only at a commit (a step boundary), or at once when no member is left.
    ``Membership.joined`` lists the members admitted since the last commit: a generation formed
    by a failure before that commit carries them on, so the state transfer is done again on it.
  * Total loss: a generation whose members were all admitted since the last commit (every replica
    that held the state was lost before a joiner took it) is a ``restore`` generation: its members
    load the newest complete checkpoint, and its first commit may be of a step at or below the
    committed one (the steps after the checkpoint are redone; ``committed_step`` goes back to it).
  * Silent data corruption: every vote may carry the voter's parameter fingerprint; members that
    differ from a strict majority are fenced as ``divergent`` before the step commits, and without a
    strict majority the job ends (``diverged``, :mod:`recover.coord.integrity`). A microbatch not
    finite on one replica fences it; the same microbatch not finite on a second one ends the job
    (``nonfinite``).
  * Leave: a vote with ``leave`` (its process got SIGTERM: a preempted node) makes its voter leave at
    that step's commit: the step commits as usual (the leaver's microbatches are in it), the leaver's
    ``committed`` reply carries ``left``, and the others' ``new_generation``: the next generation is
    formed without it (reason ``leave``; joiners waiting are admitted in it too), as at a join, with
    no failure round and nothing recomputed. The leaver then says goodbye (``left``, no failure). A
    leave of every member is a stop (someone must save the job's state).
  * Drain: :meth:`request_drain` (an operator's ``recover drain R``) makes member R leave at the next
    commit exactly as if its vote carried ``leave`` (``drained`` logs it, the generation's reason is
    ``drain``); refused (:class:`Refused`, state unchanged) for a replica that is no member, during a
    stop, or when the members left would fall below ``min_members``. A drained replica lost before
    that commit is simply lost (its drain is dropped).
  * Stop: a vote with ``stop`` (its process got SIGINT) or :meth:`request_stop` (the coordinator's
    own: SIGTERM to it or to the launcher) makes the next commit a stop (it outranks a leave): its
    ``committed`` replies carry ``stop``, so every member stops after that same step; no joiner is
    admitted at it, waiting joiners are told ``stopping``, and later registrations are refused.
  * End: once every member has left (trained to the end), a replica that registers is told
    ``finished`` (a late rejoin, a restarted pod or srun step: nothing to join; it exits with 0).
  * Restart: a coordinator that starts afresh while a job runs learns the job from the registers'
    ``resume`` (:class:`~recover.coord.protocol.Resume`). It waits for every member of the newest
    generation reported, at most ``rebuild_window_s`` after the first such register, then forms the
    next generation (number above any reported) from those that came back, with ``step`` after the
    newest step any of them committed. A step whose commit was in flight when the old coordinator
    died was committed if any member heard so (every member had voted it alike): the members that
    did not are listed in ``joined`` of a ``resync`` generation and take the state of one that did,
    so no step is half-committed and none is lost. Until the next commit, generations formed by a
    failure carry ``resync`` on (the transfer is redone); a replica that comes back after the window
    joins at the next commit, also with ``resync``.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from recover.coord import integrity
from recover.coord.actions import Action, Fence, Log, Refused, Send
from recover.coord.barren import BarrenReports
from recover.coord.graylinks import SlowLinks, SlowVerdict, Split
from recover.coord.links import KnownCuts
from recover.coord.protocol import Ballot, Membership, Resume, speeds_to_wire
from recover.names import Event
from recover.workload.speeds import SpeedTracker

START_TIMEOUT_S = 60.0
"""How long after the first registration the first generation waits for the other expected replicas."""
FAULTS_KEPT = 5
"""How many of the last failures :attr:`MembershipState.faults` keeps (what ``recover status`` shows)."""


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
    reporter: int | None = None
    """The replica whose report naming nobody started the round (:mod:`recover.coord.barren`)."""


class MembershipState:
    """Generations, failure rounds, commit votes and joins (see the module docstring)."""

    def __init__(self, *, expected: int, min_members: int, store_host: str, store_port: int,
                 ack_timeout_s: float, speeds: SpeedTracker | None = None, rebuild_window_s: float = 3.0,
                 max_replicas: int | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 slow: SlowLinks | None = None) -> None:
        if expected < 1:
            raise ValueError(f"expected replicas must be >= 1, got {expected}")
        if max_replicas is not None and max_replicas < expected:
            raise ValueError(f"max_replicas ({max_replicas}) must be >= the expected replicas ({expected})")
        self.expected = expected
        self.max_replicas = expected if max_replicas is None else max_replicas
        """Replica ids are admitted in ``[0, max_replicas)`` (``recover launch --max-replicas``)."""
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
        self.votes: dict[int, tuple[int, Ballot]] = {}  # member -> (its request id, its ballot)
        self.speeds = speeds or SpeedTracker()
        self.stop_requested = False
        self.stopped = False  # a stop was committed: the job is ending
        self.rebuild_window_s = rebuild_window_s
        self.start_timeout_s = start_timeout_s
        self._start_deadline: float | None = None  # the first generation forms by then without the missing
        self.rebuild: dict[int, Resume] = {}  # restart: what the replicas that came back hold
        self._rebuild_deadline: float | None = None
        self._base_generation = 0  # restart: the newest generation the replicas reported
        self._resync = False  # generations until the next commit carry ``resync`` (a restart's transfer)
        self._restoring = False  # a ``restore`` generation: its first commit may go back to a checkpoint's step
        self.late: set[int] = set()  # replicas that came back after the rebuild, waiting to be admitted
        self.left: set[int] = set()  # replicas that said goodbye (their departure is no failure)
        self.lost: set[int] = set()  # replicas declared dead (not a goodbye) and not registered since
        self.draining: set[int] = set()  # members an operator drains: they leave at the next commit
        self.drained: dict[int, tuple[int, int | None]] = {}  # drained replica -> (step it left at, generation
        # without it: None while every joiner was held back and no generation formed)
        self.faults: deque[dict[str, Any]] = deque(maxlen=FAULTS_KEPT)  # the last failures, for ``status``
        self._nonfinite: dict[tuple[int, int], set[int]] = {}  # (step, id) -> replicas it was not finite on
        self.barren = BarrenReports()
        """Failure rounds in a row started by reports that found nobody (:mod:`recover.coord.barren`)."""
        self._members: frozenset[int] = frozenset()  # the current generation's, for O(1) lookups
        self.cuts = KnownCuts()
        self.held_joiners: set[int] = set()  # joiners held back by a known cut or a slow link (logged once each)
        """Pairs of replicas known not to connect (:mod:`recover.coord.links`): never in one generation."""
        self.slow = slow or SlowLinks()
        """The slow-link rule (:mod:`recover.coord.graylinks`): fed at every commit; a replica it fenced is held
        back as a joiner until its probe shows its link recovered."""

    @property
    def generation(self) -> int:
        return self.current.generation if self.current else self._base_generation

    # ------------------------------------------------------- read-only views

    @property
    def failing(self) -> bool:
        """True while a failure round is open (the current generation is being replaced)."""
        return self.round is not None

    def is_live(self, replica: int) -> bool:
        """True if ``replica`` registered and has not been declared dead since."""
        return replica in self.live

    def accepts_vote(self, replica: int, generation: int, step: int) -> bool:
        """True when ``on_vote`` of a ballot of ``generation`` and ``step`` would record the vote and wait
        for the other members; False when it would refuse it or answer ``aborted`` at once."""
        cur = self.current
        return (cur is not None and generation == cur.generation and replica in self._members
                and self.round is None and (step > self.committed_step or self._restoring)
                and replica not in self.votes)

    def summary(self) -> dict[str, Any]:
        """Generation, members, committed step, live and pending replicas, and ``failing``: copies."""
        return {"generation": self.generation, "members": list(self.current.members) if self.current else [],
                "committed_step": self.committed_step, "live": sorted(self.live),
                "pending_join": sorted(self.pending_join), "failing": self.failing}

    # ----------------------------------------------------------------- events

    def on_register(self, replica: int, join: bool, req_id: int, now: float,
                    resume: Resume | None = None) -> list[Action]:
        """A replica registers; ``resume``: it lost its coordinator and holds this (see the module docstring)."""
        if not 0 <= replica < self.max_replicas:
            raise Refused("bad_replica", f"replica id {replica} is outside this job's 0..{self.max_replicas - 1} "
                                         "(--max-replicas lets it grow)")
        if replica in self.live:
            raise Refused("duplicate_replica", f"replica {replica} is already registered and alive")
        if self.stopped:
            raise Refused("stopping", "the job is stopping (a stop was committed); nothing to join")
        self.live.add(replica)
        self.lost.discard(replica)
        self.drained.pop(replica, None)
        acts: list[Action] = [Send(replica, {"type": "ok", "re": req_id, "generation": self.generation}),
                              Log(Event.REGISTER, {"replica": replica, "join": join,
                                               **({"resume": resume.to_wire()} if resume else {})})]
        if self.current is None and (resume is not None or self.rebuild):
            if resume is None:  # a joiner while the job is being rebuilt: admitted at the next commit
                self.pending_join.add(replica)
                return acts
            self.rebuild[replica] = resume
            if self._rebuild_deadline is None:
                self._rebuild_deadline = now + self.rebuild_window_s
            return acts + self._check_rebuild(now)
        if resume is not None:  # came back after the rebuild: behind, it takes the state at the next commit
            self.pending_join.add(replica)
            self.late.add(replica)
            acts.append(Log(Event.JOIN_REQUEST, {"replica": replica, "generation": self.generation, "resumed": True}))
            return acts
        if self.current is None:
            self.initial.add(replica)
            if self._start_deadline is None:
                self._start_deadline = now + self.start_timeout_s
            if len(self.initial) >= self.expected:
                acts += self._form(sorted(self.initial), "initial", now)
        elif not self.current.members and self.round is None and self.left:  # everyone finished (or stopped)
            acts += [Log(Event.JOIN_REFUSED, {"replica": replica, "reason": "finished"}),
                     Send(replica, {"type": "error", "re": None, "code": "finished",
                                    "message": "the job has finished: nothing to join"})]
        elif not self.current.members and self.round is None:
            self.pending_join.add(replica)
            acts += self._admit_joiners(now)
        else:
            self.pending_join.add(replica)
            acts.append(Log(Event.JOIN_REQUEST, {"replica": replica, "generation": self.generation}))
        return acts

    def on_dead(self, replica: int, cause: str, now: float) -> list[Action]:
        if replica not in self.live:
            return []
        self.live.discard(replica)
        self.initial.discard(replica)
        self.pending_join.discard(replica)
        self.late.discard(replica)
        self.speeds.forget(replica)
        self.draining.discard(replica)
        if cause == "left":  # it said goodbye (finished, stopped): a departure, not a failure
            self.left.add(replica)
            acts: list[Action] = [Log(Event.LEFT, {"replica": replica, "generation": self.generation})]
        else:
            acts = [Log(Event.FAILURE_DETECTED, {"replica": replica, "cause": cause, "generation": self.generation})]
            self._lose(replica, cause, now)
        if self.rebuild.pop(replica, None) is not None:
            acts += self._check_rebuild(now)
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
            Log(Event.FAILURE_REPORT, {"replica": replica, "generation": generation, "suspects": suspects,
                                   "superseded": stale}),
            Send(replica, {"type": "ok", "re": req_id, "generation": self.generation}),
        ]
        if not stale and self.barren.is_the_fault(replica, suspects):  # its own collectives fail: fence it
            return acts + [Log(Event.BARREN_REPORTS, {"replica": replica, "generation": generation,
                                                  "rounds": self.barren.counts[replica]}),
                           Fence(replica, self.barren.cause(replica))]
        if not stale:
            acts += self._start_round(f"collective failure reported by replica {replica}", now)
            if self.round is not None and not suspects:
                self.round.reporter = replica
            acts += self._check_round(now)
        return acts

    def on_rates(self, replica: int, times: dict[int, float], now: float) -> list[Action]:
        """``replica``'s rate probe took ``times`` (peer -> seconds; :mod:`recover.coord.graylinks`): a member's
        goes to the probe in progress, a joiner held back for its slow link is admitted at the next commit once
        its link recovered (``slow_link_cleared``; ``slow_link_held``: not yet)."""
        if self.current is not None and replica in self._members:
            self.slow.answered(replica, times)
            return []
        found = self.slow.probed_joiner(replica, times)
        if found is None:
            return []
        admitted, link_s, with_s = found
        step_s = self.slow.last.step if self.slow.last is not None else 0.0
        return [Log(Event.SLOW_LINK_CLEARED if admitted else Event.SLOW_LINK_HELD, {
            "replica": replica, "generation": self.generation, "link_s": round(link_s, 6),
            "step_with_s": round(with_s, 6), "step_s": round(step_s, 6), "factor": self.slow.factor})]

    def settle_slow(self, now: float) -> SlowVerdict | None:
        """The slow-link rule's verdict once its probe is over (None: none due); its replica is not fenced here:
        the caller fences it with the cause ``slow_link``."""
        members = self.current.members if self.current is not None and self.round is None else ()
        return self.slow.settle(now, members, self.min_members)

    def on_reached(self, replica: int, reached: list[int], now: float) -> list[Action]:
        """``replica``'s probe reached ``reached``: the known cuts between them are cleared
        (:mod:`recover.coord.links`); a joiner held back by them joins at the next commit."""
        cleared = self.cuts.connected(replica, reached)
        return [Log(Event.LINK_RESTORED, {"pairs": [list(p) for p in cleared], "generation": self.generation})] \
            if cleared else []

    def on_vote(self, replica: int, req_id: int, ballot: Ballot, now: float) -> list[Action]:
        """A member's commit vote (:class:`~recover.coord.protocol.Ballot`): its ``mb_s`` is the seconds
        per microbatch it measured in the step; ``stop``: its process was asked to stop the job (the
        commit, if it happens, is a stop); ``leave``: to leave it (at the commit, if it happens); ``fp``
        and ``audit`` are compared across the members (:mod:`recover.coord.integrity`)."""
        generation, step = ballot.generation, ballot.step
        cur = self.current
        if cur is None or generation != cur.generation or replica not in self._members:
            raise Refused("stale_generation",
                          f"vote of replica {replica} for generation {generation}; current is {self.generation}")
        if self.round is not None:
            return [Send(replica, {"type": "aborted", "re": req_id, "generation": generation,
                                   "reason": "generation is failing"})]
        if step <= self.committed_step and not self._restoring:
            raise Refused("stale_step", f"step {step} is already committed (last {self.committed_step})")
        if replica in self.votes:
            raise Refused("duplicate_vote", f"replica {replica} already voted in generation {generation}")
        self.votes[replica] = (req_id, ballot)
        acts: list[Action] = []
        if ballot.stop and not self.stop_requested:
            self.stop_requested = True
            acts.append(Log(Event.STOP_REQUESTED, {"replica": replica, "step": step}))
        if len(self.votes) < len(cur.members):  # only members vote, once each: O(1), not O(members)
            return acts
        votes, self.votes = self.votes, {}
        ballots = {r: b for r, (_, b) in votes.items()}
        if len({(b.step, b.ids) for b in ballots.values()}) != 1:
            acts += [Log(Event.VOTE_DISAGREEMENT, {"generation": generation, "ballots": {
                str(r): {"step": b.step, "ids": len(b.ids)} for r, b in ballots.items()}})]
            acts += [Send(r, {"type": "aborted", "re": rid, "generation": generation,
                              "reason": "commit vote disagreement"}) for r, (rid, _) in votes.items()]
            return acts + self._start_round("commit vote disagreement", now) + self._check_round(now)
        if (verdict := integrity.check(generation, step, votes)) is not None:
            self.stopped = self.stopped or verdict[1]
            return acts + verdict[0]
        return acts + self._commit(ballot, votes, now)

    def _commit(self, ballot: Ballot, votes: dict[int, tuple[int, Ballot]], now: float) -> list[Action]:
        """Every member voted ``ballot``'s step and ids alike: the step is committed."""
        assert self.current is not None
        generation, step, ids = ballot.generation, ballot.step, ballot.ids
        self.committed_step = step
        self.barren.committed()
        self.fresh.clear()
        self._resync = self._restoring = False
        acts: list[Action] = [Log(Event.COMMIT, {"generation": generation, "step": step, "ids": len(ids)})]
        measured = {r: b.mb_s for r, (_, b) in votes.items() if b.mb_s is not None}
        acts += self._observe_speeds(step, len(ids), self.current.members, measured)
        split = Split(len(ids), measured, {r: b.comp_s for r, (_, b) in votes.items() if b.comp_s is not None},
                      {r: b.comm_s for r, (_, b) in votes.items() if b.comm_s is not None})
        if self.slow.observe(generation, step, self.current.members, split):
            acts.append(Log(Event.SLOW_LINK_PROBE, {"generation": generation, "step": step,
                                                    "compute_s": round(split.compute, 6),
                                                    "reduction_s": round(split.reduction, 6)}))
        drained = self.draining & set(votes)
        leavers = {r for r, (_, b) in votes.items() if b.leave} | drained
        if leavers and leavers >= set(self.current.members) and not self.stop_requested:
            self.stop_requested = True  # nobody would be left to hold the state: a stop, saved
            acts.append(Log(Event.STOP_REQUESTED, {"source": "leave", "step": step}))
        new_gen = None
        if self.stop_requested:
            acts += self._stop(step)
            leavers = set()
        elif self.pending_join or leavers:
            if leavers - drained:
                acts.append(Log(Event.LEAVE, {"replicas": sorted(leavers - drained), "step": step,
                                          "generation": generation}))
            if drained:
                acts.append(Log(Event.DRAINED, {"replicas": sorted(drained), "step": step, "generation": generation}))
            before = self.generation
            acts += self._admit_joiners(now, leavers, "drain" if drained == leavers else "leave")
            new_gen = self.generation if self.generation != before else None  # every joiner held back: none
            self.drained.update(dict.fromkeys(drained, (step, new_gen)))
        self.draining -= drained
        speeds = speeds_to_wire(self.speeds.planned)
        return acts + [Send(r, {"type": "committed", "re": rid, "generation": generation, "step": step,
                                "new_generation": None if r in leavers else new_gen, "speeds": speeds,
                                "stop": self.stopped, **({"left": True} if r in leavers else {})})
                       for r, (rid, _) in votes.items()]

    def on_nonfinite(self, replica: int, req_id: int, generation: int, step: int, ids: list[int],
                     now: float) -> list[Action]:
        """Microbatches ``ids`` of ``step`` were not finite on ``replica``. The first replica to report an
        id is fenced as faulty (the others recompute its microbatches in the step); a second replica
        reporting the same id, or every live member reporting some in the same step (a learning rate that
        sends the model to infinity), means the training itself diverged: the job ends (``nonfinite``)."""
        cur = self.current
        if cur is None or replica not in cur.members:
            raise Refused("not_member", f"replica {replica} is not a member of the current generation")
        again = sorted(i for i in ids if self._nonfinite.get((step, i), set()) - {replica})
        for i in ids:
            self._nonfinite.setdefault((step, i), set()).add(replica)
        reported = {r for (s, _), rs in self._nonfinite.items() if s == step for r in rs}
        everyone = not [m for m in cur.members if m in self.live and m not in reported]
        if not again and not everyone:
            return [Log(Event.NONFINITE, {"replica": replica, "step": step, "ids": sorted(ids),
                                          "generation": generation}),
                    Send(replica, {"type": "ok", "re": req_id, "generation": self.generation}),
                    Fence(replica, f"microbatch(es) {sorted(ids)} of step {step} were not finite on it; "
                                   "the other replicas recompute them")]
        self.stopped = True
        if again:
            who = sorted(self._nonfinite[(step, again[0])])
            what = f"microbatch {again[0]} of step {step} has a loss or gradient that is not finite on replicas {who}"
        else:  # each on its own microbatches, but every replica left: the model itself is not finite
            who = sorted(reported)
            what = f"microbatches of step {step} have losses or gradients that are not finite on every replica {who}"
        msg = f"{what}: the training diverged (its data or its model), not a faulty device; the last committed " \
              "state is saved"
        return [Log(Event.NONFINITE_DIVERGENCE, {"step": step, "id": again[0] if again else None, "replicas": who}),
                Send(replica, {"type": "error", "re": req_id, "code": "nonfinite", "message": msg}),
                *(Send(m, {"type": "error", "re": None, "code": "nonfinite", "message": msg})
                  for m in cur.members if m != replica and m in self.live)]

    def request_drain(self, replica: int) -> list[Action]:
        """An operator drains member ``replica``: it leaves at the next commit (see the module docstring).
        Raises :class:`Refused` (``bad_replica``, ``not_member``, ``stopping``, ``below_quorum``)."""
        if not 0 <= replica < self.max_replicas:
            raise Refused("bad_replica", f"replica {replica} is unknown: this job's replica ids are "
                                         f"0..{self.max_replicas - 1}")
        members = set(self.current.members) if self.current is not None else set()
        if replica not in members:
            raise Refused("not_member", f"replica {replica} is not a member of generation {self.generation} "
                                        f"(members {sorted(members)}): nothing to drain")
        if self.stop_requested:
            raise Refused("stopping", "the job is stopping at its next commit: nothing to drain")
        left = len(members - self.draining - {replica})
        if left < self.min_members:
            raise Refused("below_quorum", f"draining replica {replica} would leave {left} member(s), below "
                                          f"min_replicas {self.min_members}; to stop the whole job instead (with a "
                                          "checkpoint), send SIGTERM to the launcher or the coordinator")
        if replica in self.draining:
            return []
        self.draining.add(replica)
        return [Log(Event.DRAIN_REQUESTED, {"replica": replica, "step": self.committed_step + 1,
                                        "generation": self.generation})]

    def _lose(self, replica: int, cause: str, now: float) -> None:
        """``replica`` was declared dead (not a goodbye): remembered for ``status``."""
        self.lost.add(replica)
        self.faults.append({"replica": replica, "cause": cause, "generation": self.generation,
                            "step": self.committed_step + 1, "at": now})

    def request_stop(self) -> list[Action]:
        """The coordinator itself was asked to stop the job (SIGTERM to it, as the launcher's graceful stop
        sends): the next commit is a stop, for every member."""
        if self.stop_requested:
            return []
        self.stop_requested = True
        return [Log(Event.STOP_REQUESTED, {"source": "coordinator", "step": self.committed_step + 1})]

    def _stop(self, step: int) -> list[Action]:
        self.stopped = True
        waiting, self.pending_join = sorted(self.pending_join), set()
        msg = {"type": "error", "re": None, "code": "stopping",
               "message": f"the job stopped after step {step}; nothing to join"}
        return [Log(Event.STOP, {"step": step, "members": list(self.current.members) if self.current else [],
                             "waiting_joiners": waiting}), *(Send(r, msg) for r in waiting)]

    def on_tick(self, now: float) -> list[Action]:
        if self.rebuild:
            return self._check_rebuild(now)
        if self.current is None and self._start_deadline is not None and now >= self._start_deadline:
            return self._start_without_missing(now)
        return self._check_round(now) if self.round is not None else []

    def _start_without_missing(self, now: float) -> list[Action]:
        """The start timeout passed: the first generation forms of the replicas registered, when at least
        ``min_members`` are (the missing ones join at a step boundary if they come); else it waits on."""
        if len(self.initial) < self.min_members or self.stopped:
            return []
        missing = sorted(set(range(self.expected)) - self.initial)
        acts: list[Action] = [Log(Event.START_TIMEOUT, {"registered": sorted(self.initial), "missing": missing,
                                                    "timeout_s": self.start_timeout_s})]
        return acts + self._form(sorted(self.initial), "initial", now, detail=f"without {missing}: not registered "
                                 f"within {self.start_timeout_s:g} s")

    def _check_rebuild(self, now: float) -> list[Action]:
        """Restart: forms the rebuilt generation once every member of the newest reported generation
        came back, or the window is over (see the module docstring)."""
        if not self.rebuild or self.current is not None:
            return []
        newest = max(self.rebuild.values(), key=lambda r: r.generation)
        expected = set(newest.members)
        assert self._rebuild_deadline is not None
        if not expected <= set(self.rebuild) and now < self._rebuild_deadline:
            return []
        back, self.rebuild, self._rebuild_deadline = self.rebuild, {}, None
        members = sorted(r for r, res in back.items() if r in expected or res.generation == newest.generation)
        others = set(back) - set(members)
        self.pending_join |= others | self.initial  # those without a resume: new replicas, they join
        self.initial.clear()
        self.late |= others
        self._base_generation = max(res.generation for res in back.values())
        self.committed_step = max(back[r].committed for r in members)
        ahead = [r for r in members if back[r].committed == self.committed_step]
        speeds = back[ahead[0]].speeds
        self.speeds.planned = dict(speeds) if speeds else None
        self.fresh = {r for r in members if back[r].committed < self.committed_step}
        self._resync = bool(self.fresh)
        acts: list[Action] = [Log(Event.REBUILT, {
            "generation": self._base_generation, "committed_step": self.committed_step,
            "back": sorted(back), "missing": sorted(expected - set(back)), "behind": sorted(self.fresh),
            "late": sorted(others)})]
        return acts + self._form(members, "restart", now)

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
            acts.append(Log(Event(change.kind), fields))
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
        acts: list[Action] = [Log(Event.FAILING, {"generation": g, "reason": reason})]
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
            self.draining.discard(m)
            self._lose(m, "no_ack", now)
            acts.append(Fence(m, f"no ack of failure notice for generation {r.generation} "
                                 f"within {self.ack_timeout_s:g} s"))
        self.round = None
        self.barren.closed(r.reporter, bool(r.dead))
        survivors = sorted(set(cur.members) - r.dead)
        acts += self._form(survivors, "failure", now, detail=r.reason, latency_s=now - r.started)
        if not survivors and self.pending_join:
            acts += self._admit_joiners(now)
        return acts

    def _admit_joiners(self, now: float, leavers: set[int] | None = None, reason: str = "leave") -> list[Action]:
        """The next generation at a step boundary: the waiting joiners in, the ``leavers`` out (``reason``
        names why they leave)."""
        stay = set(self.current.members if self.current else ()) - (leavers or set())
        joiners, held = self._joinable(sorted(self.pending_join & self.live), stay)
        self.pending_join = set(held)
        acts: list[Action] = [Log(Event.JOIN_HELD, {"replica": j, "generation": self.generation,
                                                    "cannot_reach": self.cuts.blocked(j, stay),
                                                    **({"cause": "slow_link"} if self.slow.held(j) else {})})
                              for j in held if j not in self.held_joiners]
        self.held_joiners = set(held)
        if not joiners and not leavers:
            return acts
        self.fresh |= set(joiners)
        if self.late & set(joiners):  # they hold a step's state already, midway through the next: resync
            self._resync = True
            self.late -= set(joiners)
        members = sorted((set(self.current.members if self.current else ()) - (leavers or set())) | set(joiners))
        return acts + self._form(members, reason if leavers else "join", now)

    def _joinable(self, joiners: list[int], stay: set[int]) -> tuple[list[int], list[int]]:
        """``joiners`` split into those admitted beside ``stay`` and those held back: a joiner known not to
        connect to a member (or to an earlier joiner) waits until a probe shows the pair connects; one fenced for
        a slow link waits until its probe shows the link recovered (:mod:`recover.coord.graylinks`; at once when
        no member is left to compare it with)."""
        admitted: list[int] = []
        held: list[int] = []
        for j in joiners:
            slow = self.slow.held(j) and bool(stay)
            (held if slow or self.cuts.blocked(j, stay | set(admitted)) else admitted).append(j)
        return admitted, held

    def _form(self, members: list[int], reason: str, now: float, *, detail: str = "",
              latency_s: float | None = None) -> list[Action]:
        old = self.current
        self.fresh &= set(members)
        joined = tuple(sorted(self.fresh))
        self._restoring = bool(members) and len(joined) == len(members)  # nobody holds the state
        dead = tuple(sorted(set(old.members) - set(members))) if old else ()
        m = Membership(generation=self.generation + 1, members=tuple(members), store_host=self.store_host,
                       store_port=self.store_port, step=self.committed_step + 1, dead=dead, joined=joined,
                       min_members=self.min_members, reason=reason,
                       speeds=dict(self.speeds.planned) if self.speeds.planned else None,
                       resync=self._resync and bool(joined) and not self._restoring, restore=self._restoring,
                       secret=secrets.token_hex(16))
        acts: list[Action] = [Send(r, {"type": "aborted", "re": rid, "generation": old.generation if old else 0,
                                       "reason": f"generation replaced ({reason})"})
                              for r, (rid, _) in self.votes.items() if r in self.live]
        self.votes = {}
        self.current = m
        self._members = frozenset(m.members)
        self.initial.clear()
        fields: dict[str, Any] = {"generation": m.generation, "members": list(m.members), "dead": list(dead),
                                  "joined": list(joined), "reason": reason, "step": m.step}
        if detail:
            fields["detail"] = detail
        if latency_s is not None:
            fields["latency_ms"] = round(latency_s * 1e3, 3)
        if m.restore:
            fields["restore"] = True
        acts.append(Log(Event.GENERATION, fields))
        if len(members) < self.min_members and not set(dead) <= self.left:  # not at a normal end
            acts.append(Log(Event.QUORUM_LOST, {"generation": m.generation, "members": list(members),
                                            "min_members": self.min_members}))
        wire = {"type": "membership", "membership": m.to_wire()}
        return acts + [Send(r, wire) for r in m.members if r in self.live]
