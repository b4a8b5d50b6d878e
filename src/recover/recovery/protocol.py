"""LAYER 2: one committed step with in-step recovery (docs/DESIGN.md §4). The one path every step takes.

    plan      ids 0..M-1 -> live replicas (layer 3, deterministic: every survivor computes the same plan;
              weighted by the replicas' speeds agreed at the last commit, so stragglers get fewer)
    compute   this replica runs its ids; the replica's ledger records each finished id
    reduce    all-reduce a COPY of the replica's payload on generation g (layer 1), its buckets launched
              as the last microbatch's backward finalises them (overlapped, as DDP does)
      on PeerFailure: move to generation g+1; orphans = ids the dead replicas held in the plan;
                      re-plan the orphans over the survivors; compute ours; reduce again (repeat)
    commit    the coordinator's vote on (g, step, ids == all M), with this replica's measured seconds
              per microbatch; the reply carries the speeds the next step is planned with
    apply     grad = sum / M, clip, optimizer step (only now: the LR and the data cursor advance)
    admit     joiners admitted at the commit get the state from the lowest old member
    restore   a generation in which nobody holds the state (every replica that did was lost): each member
              loads the newest complete checkpoint (``restore``) and the job goes on from its step

Invariants:
- the replica's gradient buffers only ever grow by whole microbatches, and a reduction never writes
  to them, so the gradients survivors computed before a failure are kept and never corrupted;
- :meth:`ResilientStep.run` returns only after the reduced payload held exactly M microbatches,
  every live replica voted to commit it and the optimizer applied it divided by M; otherwise it
  keeps recovering or raises :class:`~recover.errors.QuorumLost`.

The same class runs ``recover train`` (a static group and a coordinator that commits every step)
and each replica of ``recover launch``; the baselines (:mod:`recover.baselines.steps`) override
only what a failure does and what a step is divided by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from recover.comm.transfer import receive_state, send_state, source_rank
from recover.errors import PeerFailure, QuorumLost, StateLost
from recover.names import Event, Phase
from recover.recovery.interfaces import Coordinator, Group, Hook, Membership, Reduction, StepReplica, Totals
from recover.workload import audit_plan, plan_step, replan, slowdowns
from recover.workload.speeds import STRAGGLER_RATIO


@dataclass
class Progress:
    """Where training stands: what a joiner receives and a checkpoint records."""

    step: int = 0
    """Committed optimizer steps."""
    data_step: int = 0
    """The step whose samples come next (ahead of ``step`` only when a baseline drops steps)."""
    tokens: int = 0
    """Tokens in committed steps."""

    def counters(self) -> dict[str, int]:
        return {"step": self.step, "data_step": self.data_step, "total_tokens": self.tokens}

    @classmethod
    def of(cls, counters: dict[str, int]) -> Progress:
        return cls(counters["step"], counters["data_step"], counters["total_tokens"])


@dataclass
class Committed:
    """A step the coordinator committed, before it is applied."""

    reduced: list[torch.Tensor]
    totals: Totals
    """What ``reduced`` holds, read once (loss, microbatches, norm, fingerprint)."""
    ids: list[int]
    generation: int
    live: tuple[int, ...]
    computed: int
    """Microbatches this replica computed in the step (its quota plus any orphans)."""
    quotas: dict[int, int] = field(default_factory=dict)
    """Microbatches each live replica computed (the plan after any recovery)."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    admitted: Membership | None = None
    """The membership that admits joiners at this commit, or None."""
    stop: bool = False
    """The commit is a stop: every member stops after this step."""
    left: bool = False
    """This replica asked to leave and the step is its last: it is no member of the next generation."""


@dataclass
class StepOutcome:
    """What a committed and applied step leaves (for the step record)."""

    step: int
    data_step: int
    loss_sum: float
    microbatches: int
    tokens: int
    grad_norm: float
    generation: int
    live: tuple[int, ...]
    computed: int
    recoveries: list[dict[str, Any]]
    quotas: dict[int, int] = field(default_factory=dict)
    """Microbatches each live replica computed."""
    stragglers: dict[int, float] = field(default_factory=dict)
    """Replicas the agreed speeds name slow, with their time over the others' median."""
    stop: bool = False
    """The job stops after this step (a graceful stop was committed with it)."""
    left: bool = False
    """This replica left the job after this step (a graceful leave); the others train on."""
    cpu: dict[str, float] = field(default_factory=dict)
    """The training thread's CPU seconds in the step's ``compute``, ``reduce`` (the wait on the reduction)
    and ``update`` (:mod:`recover.observe.cpu`: the rest of the step is recover's own work)."""
    wall: dict[str, float] = field(default_factory=dict)
    """The step's wall seconds in ``compute`` (this replica's microbatches) and ``reduce`` (its wait in the
    committed reduction: the slowest peer's compute beyond its own, then the reduction itself), as voted
    (the slow-link rule, :mod:`recover.coord.graylinks`)."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.microbatches


@dataclass(frozen=True)
class Work:
    """Microbatches this replica computes now: its share of step ``data_step``'s ids, or the orphans of a
    failure. ``final(i)``, when given, is told as payload tensor ``i`` becomes complete (the reduction
    launches its buckets then)."""

    data_step: int
    ids: list[int]
    final: Callable[[int], None] | None = None


class Resynced(Exception):  # noqa: N818 - not an error: the step starts over
    """A restarted coordinator's ``resync`` generation moved state to the members that were behind:
    the step in progress is abandoned and :meth:`ResilientStep.run` is called again (from the progress
    the members now share)."""


def _no_hook(step: int, phase: str) -> None:
    return None


def _no_event(kind: str, **fields: Any) -> None:
    return None


class ResilientStep:
    """Runs committed steps on a generation's group, recovering in-step from replica failures.

    Args:
        replica: this replica's model, optimizer and step gradients.
        group: the current generation's group (replaced as generations change: read ``self.group``).
        coordinator: the commit vote.
        M: microbatches per step.
        progress: where training starts (a resumed or joining replica's counters).
        min_replicas: below this many live replicas a step raises QuorumLost.
        hook: called at each phase point (fault injection) as ``(step, phase)``.
        on_event: called as ``(kind, **fields)`` for recovery and membership events.
        assignment: the failure-free ids -> replicas rule (``training.assignment``).
        seed: seeds the ``shuffled`` assignment.
        policy: ``weighted`` (quotas by the speeds agreed at the last commit) or ``even``.
        fingerprint_every: every this many steps the vote carries the fingerprint of this replica's
            parameters (0: never), so the coordinator can fence a corrupted minority before the commit.
        audit_every: every this many steps one microbatch, drawn from (seed, step), is computed by its
            owner and by the two members after it, and their gradients' fingerprints go with their
            votes (0: never; one-process replicas only): the coordinator fences the odd one out.
        overlap: launch the reduction's buckets while the last backward finalises them (else after it).
        restore: loads the newest complete checkpoint into the replica and returns its counters (None:
            there is none); called in a ``restore`` generation (None: such a generation ends the job).
    """

    def __init__(self, replica: StepReplica, group: Group, coordinator: Coordinator, M: int,
                 progress: Progress | None = None, min_replicas: int = 1, hook: Hook = _no_hook,
                 on_event: Callable[..., Any] = _no_event, assignment: str = "blocks", seed: int = 0,
                 policy: str = "weighted", fingerprint_every: int = 0, audit_every: int = 0,
                 overlap: bool = True, restore: Callable[[], Progress | None] | None = None) -> None:
        self.replica, self.group, self.coordinator = replica, group, coordinator
        self.me = group.members[group.rank]
        self.M, self.min_replicas = M, min_replicas
        self.progress = progress or Progress()
        self.hook, self.on_event = hook, on_event
        self.assignment, self.seed, self.policy = assignment, seed, policy
        self.fingerprint_every, self.audit_every = fingerprint_every, audit_every
        self.overlap, self.restore = overlap, restore
        self._audit: dict[str, Any] | None = None  # this replica's audit value of the step, if it takes part
        self.speeds = group.membership.speeds  # a joiner's: those of the commit that admitted it
        self._compute_s = 0.0  # this step's compute time so far
        self._comm_s = 0.0  # this step's wait in its last reduction (wall seconds)
        self._cpu: dict[str, float] = {}  # this step's thread CPU seconds by part (StepOutcome.cpu)
        replica.upcoming = self.share  # a replica that reads its data ahead asks for its coming shares

    # ---- one step --------------------------------------------------------------------------
    def run(self) -> StepOutcome:
        """Plans, computes, reduces, recovers, commits and applies the next step; admits joiners."""
        step = self.progress.step
        return self._finish(step, self.commit(step, self.progress.data_step))

    def run_iter(self) -> Generator[Work, None, StepOutcome]:
        """:meth:`run` for a caller that computes the microbatches itself (a user's own loop,
        :mod:`recover.api`): yields each :class:`Work` to compute (the replica's share, then the orphans
        of any failure) and returns the step's outcome; the caller folds every yielded id's gradient
        into ``replica.payload()`` before asking for the next."""
        step = self.progress.step
        committed = yield from self.commit_iter(step, self.progress.data_step)
        return self._finish(step, committed)

    def _finish(self, step: int, committed: Committed) -> StepOutcome:
        outcome = self.apply(step, committed)
        if committed.admitted is not None and not committed.stop:
            self.admit()
        return outcome

    def plan(self, data_step: int) -> dict[int, list[int]]:
        """Ids of the step per live replica: all M over the current members (layer 3)."""
        return plan_step(self.M, self.group.members, data_step, self.assignment, self.seed, self.times)

    def _step_plan(self, data_step: int) -> dict[int, list[int]]:
        """The plan this step starts from: :meth:`plan`, but for a replica whose first rendezvous failed (a
        member it could not connect to was fenced) the plan the members that formed that generation made
        over its members, with the orphans of those not in this one re-planned as their in-step recovery
        does: otherwise this replica would compute other ids than the others expect of it."""
        passed = [m for m in self.group.passed if m.step == self.progress.step
                  and self.me not in m.joined and not m.restore and not m.resync]  # a joiner's: planned later
        if not passed:
            return self.plan(data_step)
        self.group.passed = ()  # once: the step's first plan
        plan = plan_step(self.M, passed[0].members, data_step, self.assignment, self.seed, self.times)
        live = set(self.group.members)
        dead = set(plan) - live
        new_work = replan(plan, None, dead, live, self.times) if dead else {}
        return {r: list(ids) + list(new_work.get(r, [])) for r, ids in plan.items() if r in live}

    def share(self, data_step: int) -> list[int]:
        """This replica's ids of ``data_step`` in the plan of the current members and speeds: what it expects
        to compute in a coming step (a failure, a joiner or the speeds of the next commit may change it)."""
        return self.plan(data_step).get(self.me, [])

    @property
    def times(self) -> dict[int, float] | None:
        """The per-microbatch times plans are weighted by (None: the even split)."""
        return self.speeds if self.policy == "weighted" else None

    def commit(self, step: int, data_step: int) -> Committed:
        """Computes this replica's ids of ``data_step``, reduces and votes until the step commits."""
        work = self.commit_iter(step, data_step)
        try:
            order = next(work)
            while True:
                self.replica.compute(order.data_step, order.ids, self.hook, order.final)
                order = work.send(None)
        except StopIteration as done:
            return done.value

    def commit_iter(self, step: int, data_step: int) -> Generator[Work, None, Committed]:
        """:meth:`commit` with the computing left to the caller: yields :class:`Work`, returns the commit."""
        plan = self._step_plan(data_step)
        todo = plan[self.me]
        self.replica.reset()
        audit = self._audit_of(step, plan)
        if audit is not None and audit[1] == self.me:
            self.replica.audit_id = audit[0]  # the owner fingerprints its gradient as it computes it
        recoveries: list[dict[str, Any]] = []
        computed = 0
        self._compute_s = 0.0
        self._cpu = {"compute": 0.0, "reduce": 0.0, "update": 0.0}
        while True:
            t0 = time.perf_counter()
            order = self.replica.reduce_order if self.overlap else None
            reduction = self.group.reduction(self.replica.payload(), order)
            c0 = time.thread_time()
            yield Work(data_step, list(todo), reduction.final if self.overlap else None)
            if audit is not None and self.me in audit[2]:
                self._audit = {"id": audit[0], **self.replica.audit(data_step, audit[0])}
                audit = None  # once per step, even if the step recovers
            self._cpu["compute"] += time.thread_time() - c0
            self._compute_s += time.perf_counter() - t0
            computed += len(todo)
            if self.replica.nonfinite:
                self.report_nonfinite(step)
            try:
                return self._reduce_and_vote(step, plan, recoveries, computed, reduction)
            except PeerFailure as failure:
                plan, todo = self.on_failure(step, plan, failure, recoveries)

    def expected_ids(self, plan: dict[int, list[int]]) -> list[int]:
        """The ids a committed step must hold: all M (a shrinking baseline expects fewer)."""
        return list(range(self.M))

    def divisor(self, microbatches: int) -> int:
        """What the reduced gradient sum is divided by: always M (the baseline that shrinks overrides)."""
        return self.M

    def _reduce_and_vote(self, step: int, plan: dict[int, list[int]], recoveries: list[dict[str, Any]],
                         computed: int, reduction: Reduction) -> Committed:
        self.hook(step, Phase.REDUCE)
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            reduced = reduction.result()  # launches the stats (and any bucket not launched yet), waits
        finally:
            self._cpu["reduce"] += time.thread_time() - c0
            self._comm_s = time.perf_counter() - w0  # the committed reduction's (a failed one's is recovery)
        return self.vote(step, plan, reduced, recoveries, computed)

    def vote(self, step: int, plan: dict[int, list[int]], reduced: list[torch.Tensor],
             recoveries: list[dict[str, Any]], computed: int) -> Committed:
        """Checks the reduced payload against the plan, then the coordinator's commit vote. The payload's
        totals and the fingerprint (when due) come to the host in one read (``replica.totals``)."""
        self.hook(step, Phase.COMMIT)
        every = self.fingerprint_every
        t = self.replica.totals(reduced, fingerprint=bool(every and step % every == 0))
        ids = sorted(i for share in plan.values() for i in share)
        expected = self.expected_ids(plan)
        if t.microbatches != len(expected) or ids != expected:
            raise RuntimeError(f"step {step}: reduced gradient holds {t.microbatches} microbatches and the plan "
                               f"covers {len(ids)}, expected {len(expected)}: the ledger is inconsistent")
        mb_s = self._compute_s / computed if computed else None
        audit, self._audit = self._audit, None
        if audit is None and self.replica.audit_value is not None:  # the owner's
            audit = {"id": self.replica.audit_id, **self.replica.audit_value}
        admitted = self.coordinator.vote_commit(self.group.generation, step, ids, mb_s=mb_s, fp=t.fingerprint,
                                                audit=audit, comp_s=self._compute_s, comm_s=self._comm_s)
        self.speeds = self.coordinator.speeds
        quotas = {r: len(share) for r, share in sorted(plan.items())}
        return Committed(reduced, t, ids, self.group.generation, tuple(self.group.members), computed, quotas,
                         recoveries, admitted, self.coordinator.stopping,
                         self.coordinator.left)

    def apply(self, step: int, c: Committed) -> StepOutcome:
        """The optimizer update of a committed step; the progress advances."""
        loss_sum, count = c.totals.loss_sum, c.totals.microbatches
        self.hook(step, Phase.OPTIMIZER)
        c0 = time.thread_time()
        grad_norm = self.replica.apply(c.reduced, self.divisor(count), step, c.totals.sum_norm)
        self._cpu["update"] = self._cpu.get("update", 0.0) + time.thread_time() - c0
        self.group.release(c.reduced)  # consumed by the update: a later reduction may reuse their memory
        tokens = count * self.replica.tokens_per_microbatch
        slow = {r: round(s, 2) for r, s in slowdowns(self.speeds or {}).items()
                if s >= STRAGGLER_RATIO and r in c.live}
        outcome = StepOutcome(step, self.progress.data_step, loss_sum, count, tokens, grad_norm, c.generation,
                              c.live, c.computed, c.recoveries, c.quotas, slow, c.stop, c.left, dict(self._cpu),
                              {"compute": self._compute_s, "reduce": self._comm_s})
        self.progress.step += 1
        self.progress.data_step += 1
        self.progress.tokens += tokens
        return outcome

    def _audit_of(self, step: int, plan: dict[int, list[int]]) -> tuple[int, int, list[int]] | None:
        """This step's audit (``(id, owner, auditors)``), when one is due and replicas can audit."""
        self._audit = None
        if not (self.audit_every and step % self.audit_every == 0 and self.replica.audits):
            return None
        return audit_plan(plan, step, self.seed)

    def report_nonfinite(self, step: int) -> None:
        """Microbatches whose loss or gradient was not finite here: the coordinator fences this replica
        (the others recompute its microbatches in the step) or, if another replica reported one of them
        too, ends the job. Either way this replica does not go on: the wait below ends with the fence
        (:class:`~recover.coord.client.CoordinatorLost`) or the end of the job."""
        bad = sorted(self.replica.nonfinite)
        self.on_event(Event.NONFINITE, step=step, ids=bad)
        self.coordinator.report_nonfinite(self.group.generation, step, bad)
        g, end = self.group.generation, time.monotonic() + 60.0
        while time.monotonic() < end:  # a generation another replica's fence formed may come before ours
            g = self.coordinator.wait_for_generation(g, max(end - time.monotonic(), 0.0)).generation
        raise RuntimeError(f"step {step}: microbatches {bad} were not finite here and the coordinator did not "
                           "fence this replica")

    # ---- recovery --------------------------------------------------------------------------
    def regroup(self, step: int) -> int:
        """Moves to the coordinator's next generation; returns the old one.

        Raises:
            QuorumLost: fewer than ``min_replicas`` replicas are left.
        """
        old = self.group.generation
        self.hook(step, Phase.RECOVER)
        self.group = self.group.next_generation()  # follows further failures while it forms
        if self.group.membership.restore:
            self.fall_back()
        if self.group.membership.resync and self.group.membership.joined:
            self.resync()
        if len(self.group.members) < self.min_replicas:
            raise QuorumLost(f"only {len(self.group.members)} replica(s) {list(self.group.members)} left at step "
                             f"{step}; fault_tolerance.min_replicas = {self.min_replicas}")
        return old

    def on_failure(self, step: int, plan: dict[int, list[int]], failure: PeerFailure,
                   recoveries: list[dict[str, Any]]) -> tuple[dict[int, list[int]], list[int]]:
        """In-step recovery: a new generation, the orphans of the dead re-planned over the survivors.

        Returns the merged plan and this replica's new ids (baselines override this).
        """
        t0 = time.perf_counter()
        old_generation = self.regroup(step)
        live = set(self.group.members)
        dead = set(plan) - live
        new_work = replan(plan, None, dead, live, self.times) if dead else {}
        merged = {r: list(ids) + list(new_work.get(r, [])) for r, ids in plan.items() if r in live}
        todo = list(new_work.get(self.me, []))
        info = {"step": step, "from_generation": old_generation, "generation": self.group.generation,
                "dead": sorted(dead), "reported_dead": list(failure.dead), "live": sorted(live),
                "orphans": sorted(i for r in dead for i in plan[r]), "my_orphans": todo,
                "regroup_ms": round((time.perf_counter() - t0) * 1000, 3)}
        recoveries.append(info)
        self.on_event(Event.RECOVERED, **info)
        return merged, todo

    # ---- membership growth -----------------------------------------------------------------
    def admit(self) -> None:
        """Moves to the generation that admits joiners; its lowest old member sends them the state.

        A failure during the transfer moves everyone to the next generation, which still lists the
        joiners until the next commit, and the transfer is redone (or skipped if they died)."""
        while True:
            self.group = self.group.next_generation()
            if not self.group.membership.joined:
                return
            src = source_rank(self.group)
            try:
                if self.group.rank == src:
                    send_state(self.group, self.replica.transfer_state(self.progress.counters()))
                else:
                    receive_state(self.group, src)  # every member takes part; ours is already identical
                break
            except PeerFailure:
                continue
        self.on_event(Event.GREW, generation=self.group.generation, members=list(self.group.members),
                      step=self.progress.step)

    def resync(self) -> None:
        """In a ``resync`` generation (a restarted coordinator's), the members behind take the state of
        the lowest member ahead; then the step starts over for everyone (raises :class:`Resynced`)."""
        t0 = time.perf_counter()
        m = self.group.membership
        while m.resync and m.joined:
            src = source_rank(self.group)
            try:
                if self.group.rank == src:
                    send_state(self.group, self.replica.transfer_state(self.progress.counters()))
                else:
                    state = receive_state(self.group, src)
                    if self.me in m.joined:
                        self.progress = Progress.of(self.replica.load_transfer_state(state))
                        self.coordinator.committed_step = self.progress.step - 1
                break
            except PeerFailure:
                self.group = self.group.next_generation()
                m = self.group.membership
                if m.restore:
                    self.fall_back()
        self.speeds = m.speeds  # those of the commit the members ahead hold: every plan alike again
        self.on_event(Event.RESYNCED, generation=self.group.generation, behind=list(m.joined), step=self.progress.step,
                      ms=round((time.perf_counter() - t0) * 1000, 2))
        raise Resynced

    def join(self) -> None:
        """A joiner takes the live replicas' state and progress (again on the next generation if a
        peer dies meanwhile)."""
        t0 = time.perf_counter()
        while True:
            if self.group.membership.restore:  # the replicas it was to take the state from are gone
                self._restore()
                return
            try:
                state = receive_state(self.group, source_rank(self.group))
                break
            except PeerFailure:
                self.group = self.group.next_generation()
        self.progress = Progress.of(self.replica.load_transfer_state(state))
        self.coordinator.committed_step = self.progress.step - 1
        self.on_event(Event.STATE_RECEIVED, step=self.progress.step, ms=round((time.perf_counter() - t0) * 1000, 2),
                      tensors=len(state))

    def fall_back(self) -> None:
        """A ``restore`` generation reached while training: the newest complete checkpoint is loaded and the
        step starts over from its progress (raises :class:`Resynced`)."""
        self._restore()
        raise Resynced

    def _restore(self) -> None:
        """Nobody holds the training state: this member loads the newest complete checkpoint (every member
        loads the same one: nobody is left to write a newer one; should they differ after all, their votes
        disagree and the next generation restores again).

        Raises:
            StateLost: there is no checkpoint to fall back to.
        """
        t0 = time.perf_counter()
        m = self.group.membership
        found = self.restore() if self.restore is not None else None
        if found is None:
            raise StateLost(f"every replica that held the training state was lost before step {m.step} was "
                            "committed, and there is no intact checkpoint to fall back to")
        self.progress = found
        self.coordinator.committed_step = found.step - 1
        self.speeds = m.speeds
        self.on_event(Event.RESTORED, generation=m.generation, step=found.step, redo=max(0, m.step - found.step),
                      ms=round((time.perf_counter() - t0) * 1000, 2))
