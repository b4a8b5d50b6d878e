"""The step protocol (:class:`recover.recovery.protocol.ResilientStep`) against fakes, in milliseconds.

Each replica is a thread running the real protocol over a fake layer 1 and coordinator
(:class:`World`): collectives sum the live members' tensors, a replica killed at a phase point
disappears at once (its thread stops, everyone's pending collective or vote raises PeerFailure and
a new generation without it forms), joiners are admitted at a commit. A fake replica's gradient is
a one-hot vector per microbatch id, so a reduced gradient shows exactly which ids it holds. The
World's commit feeds the votes' measured speeds to a real
:class:`~recover.workload.speeds.SpeedTracker`, as the coordinator does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from recover.baselines import JobFailed, ShrinkStep, StopOnFailureStep
from recover.comm.reduction import DeferredReduction
from recover.errors import PeerFailure, QuorumLost, StateLost
from recover.recovery.interfaces import Totals
from recover.recovery.protocol import Progress, ResilientStep
from recover.workload import SpeedTracker

M = 8
TIMEOUT_S = 10.0


class Killed(BaseException):
    """A replica dies here (not an Exception: the protocol must not be able to catch it)."""


@dataclass(frozen=True)
class FakeMembership:
    generation: int
    members: tuple[int, ...]
    joined: tuple[int, ...] = ()
    speeds: dict[int, float] | None = None
    resync: bool = False
    restore: bool = False
    step: int = 0


@dataclass
class World:
    """Layer 1 and the coordinator of ``n`` replicas: one generation at a time, decided here alone."""

    n: int
    membership: FakeMembership = field(init=False)
    cond: threading.Condition = field(default_factory=threading.Condition)
    ops: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    waiting_joiners: list[int] = field(default_factory=list)
    votes: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    tracker: SpeedTracker = field(default_factory=SpeedTracker)
    plans: list[dict[int, float] | None] = field(default_factory=list)  # the speeds sent at each commit

    def __post_init__(self) -> None:
        self.membership = FakeMembership(0, tuple(range(self.n)))

    def kill(self, *replicas: int) -> None:
        with self.cond:
            live = tuple(r for r in self.membership.members if r not in replicas)
            for r in replicas:
                self.tracker.forget(r)
            self.membership = FakeMembership(self.membership.generation + 1, live, speeds=self.tracker.planned)
            self.cond.notify_all()

    def join(self, replica: int) -> None:
        with self.cond:
            if replica not in self.waiting_joiners and replica not in self.membership.members:
                self.waiting_joiners.append(replica)

    def wait_admitted(self, replica: int) -> FakeMembership:
        with self.cond:
            assert self.cond.wait_for(lambda: replica in self.membership.members, TIMEOUT_S)
            return self.membership

    def collective(self, generation: int, seq: int, me: int, value: Any, combine: Any) -> Any:
        """Every member of ``generation`` brings a value; all get ``combine(values by member)``, computed
        once by the last to arrive (so a combine that changes the membership breaks nothing)."""
        with self.cond:
            slot = self.ops.setdefault((generation, seq), {"values": {}})
            slot["values"][me] = value
            m = self.membership
            if m.generation == generation and set(slot["values"]) >= set(m.members) and "result" not in slot:
                slot["result"] = combine({r: slot["values"][r] for r in m.members})
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: "result" in slot or self.membership.generation != generation,
                                    TIMEOUT_S)
            assert ok, f"collective {seq} of generation {generation} hangs"
            if "result" in slot:
                return slot["result"]
            dead = tuple(sorted(set(slot["values"]) - set(self.membership.members)))
            raise PeerFailure(generation, dead, "fake failure")  # a member died: this group is broken

    def vote(self, generation: int, seq: int, me: int, ids: tuple[int, ...], step: int,
             mb_s: float | None) -> tuple[FakeMembership | None, dict[int, float] | None]:
        def decide(votes: dict[int, tuple[tuple[int, ...], float | None]]) -> Any:
            assert len({i for i, _ in votes.values()}) == 1, f"votes disagree: {votes}"
            self.tracker.observe(M, votes, {r: t for r, (_, t) in votes.items() if t is not None})
            speeds = dict(self.tracker.planned) if self.tracker.planned else None
            self.plans.append(speeds)
            return self._admit_at_commit(generation, step, ids), speeds

        return self.collective(generation, seq, me, (ids, mb_s), decide)

    def _admit_at_commit(self, generation: int, step: int, ids: tuple[int, ...]) -> FakeMembership | None:
        """The commit of a step (the lock is held): waiting joiners are admitted in a new generation."""
        self.votes.append((generation, step, ids))
        if not self.waiting_joiners:
            return None
        joined = tuple(self.waiting_joiners)
        self.waiting_joiners.clear()
        self.membership = FakeMembership(generation + 1, tuple(sorted((*self.membership.members, *joined))), joined,
                                         dict(self.tracker.planned) if self.tracker.planned else None)
        return self.membership


class FakeGroup:
    """A :class:`~recover.recovery.interfaces.Group` of one generation of the World."""

    device = torch.device("cpu")
    passed: tuple[FakeMembership, ...] = ()

    def __init__(self, world: World, me: int, membership: FakeMembership) -> None:
        self.world, self.me, self.membership = world, me, membership
        self.generation, self.members = membership.generation, membership.members
        self.rank = self.members.index(me)
        self.seq = 0

    def _op(self, value: Any, combine: Any) -> Any:
        self.seq += 1
        return self.world.collective(self.generation, self.seq, self.me, value, combine)

    def allreduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        copies = [t.clone() for t in tensors]
        return self._op(copies, lambda by: [sum(ts) for ts in zip(*by.values(), strict=True)])

    def reduction(self, tensors: list[torch.Tensor], order: Any = None) -> DeferredReduction:
        return DeferredReduction(self.allreduce, tensors)

    def release(self, results: list[torch.Tensor]) -> None:
        """Each reduction's result is its own copy: nothing to hand back."""

    def barrier(self) -> None:
        self._op(None, lambda by: None)

    def broadcast_into(self, buffers: list[torch.Tensor], src_rank: int) -> None:
        src = self.members[src_rank]
        got = self._op([b.clone() for b in buffers], lambda by: by[src])
        for b, g in zip(buffers, got, strict=True):
            b.copy_(g)

    def next_generation(self) -> FakeGroup:
        """Like layer 1: a group forms only once every member rendezvoused; a generation that loses a
        member while forming is skipped by every survivor alike."""
        generation = self.generation
        while True:
            with self.world.cond:
                assert self.world.cond.wait_for(lambda g=generation: self.world.membership.generation > g, TIMEOUT_S)
                m = self.world.membership
            if self.me not in m.members:
                raise Killed()
            try:
                self.world.collective(m.generation, 0, self.me, None, lambda by: None)  # the rendezvous
            except PeerFailure:
                generation = m.generation
                continue
            return FakeGroup(self.world, self.me, m)

    def close(self) -> None:
        pass


class FakeCoordinator:
    def __init__(self, world: World, me: int, step_protocol: list[ResilientStep]) -> None:
        self.world, self.me, self.protocol = world, me, step_protocol
        self.speeds: dict[int, float] | None = None
        self.stopping = self.left = False
        self.committed_step = -1

    def vote_commit(self, generation: int, step: int, ids: list[int],
                    mb_s: float | None = None, fp: str | None = None,
                    audit: dict | None = None, comp_s: float | None = None,
                    comm_s: float | None = None) -> FakeMembership | None:
        group = self.protocol[0].group
        group.seq += 1
        admitted, self.speeds = self.world.vote(generation, group.seq, self.me, tuple(ids), step, mb_s)
        return admitted


class FakeReplica:
    """A :class:`~recover.recovery.interfaces.StepReplica` whose gradient of id ``i`` is ``e_i``."""

    tokens_per_microbatch = 10
    audits = False
    audit_id: int | None = None
    upcoming = None

    def __init__(self, mb_s: float = 0.0) -> None:
        self.mb_s = mb_s  # each microbatch sleeps this long (a slow device)
        self.nonfinite: list[int] = []
        self.audit_value = None
        self.weights = torch.zeros(M, dtype=torch.float64)
        self.grad = torch.zeros(M, dtype=torch.float64)
        self.ledger: list[int] = []
        self.stats = torch.zeros(2, dtype=torch.float64)
        self.applied: list[tuple[int, list[float], int]] = []  # (step, reduced gradient, divisor)

    reduce_order = None

    def reset(self) -> None:
        self.grad.zero_()
        self.stats.zero_()
        self.ledger = []

    def compute(self, step: int, ids: list[int], hook: Any, final: Any = None) -> None:
        for i in ids:
            hook(step, "forward")
            hook(step, "backward")
            time.sleep(self.mb_s)
            self.grad[i] += 1.0
            self.ledger.append(i)
        loss_sum = float(sum(self.ledger))  # loss of id i is i: the reduced loss says which ids are in
        self.stats.copy_(torch.tensor([loss_sum, float(len(self.ledger))], dtype=torch.float64))

    def payload(self) -> list[torch.Tensor]:
        return [self.grad, self.stats]

    def totals(self, reduced: list[torch.Tensor], fingerprint: bool = False) -> Totals:
        fp = f"{int(self.weights.sum()):016x}" if fingerprint else None
        return Totals(float(reduced[-1][0]), int(reduced[-1][1]), float(reduced[0].norm()), fp)

    def apply(self, reduced: list[torch.Tensor], divisor: int, step: int, sum_norm: float) -> float:
        self.applied.append((step, reduced[0].tolist(), divisor))
        self.weights -= reduced[0] / divisor
        return sum_norm / divisor

    def transfer_state(self, counters: dict[str, int]) -> dict[str, torch.Tensor]:
        return {"model.w": self.weights.clone(), **{f"counter.{k}": torch.tensor(v) for k, v in counters.items()}}

    def load_transfer_state(self, state: dict[str, torch.Tensor]) -> dict[str, int]:
        self.weights.copy_(state["model.w"])
        return {k.removeprefix("counter."): int(v) for k, v in state.items() if k.startswith("counter.")}


@dataclass
class Run:
    """What one replica's thread did."""

    replica: FakeReplica
    protocol: ResilientStep | None = None
    outcomes: list[Any] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error: BaseException | None = None
    killed: bool = False


def run_job(n: int, steps: int, kills: dict[tuple[int, str], tuple[int, ...]] = {},  # noqa: B006
            cls: type[ResilientStep] = ResilientStep, min_replicas: int = 1, joiners: dict[int, int] = {},  # noqa: B006
            mb_s: dict[int, float] = {}, **kwargs: Any) -> tuple[World, dict[int, Run]]:  # noqa: B006
    """``n`` replicas run ``steps`` steps; ``kills[(step, phase)]`` die there (the first to reach it
    kills them all at once); ``joiners[r] = s``: replica ``r`` asks to join during step ``s``;
    ``mb_s[r]``: replica ``r`` takes that long per microbatch. The policy is ``even`` unless given:
    the fakes' microsecond compute times are all noise."""
    kwargs.setdefault("policy", "even")
    world = World(n)
    runs: dict[int, Run] = {}
    fired: set[tuple[int, str]] = set()
    lock = threading.Lock()

    def hook_of(me: int) -> Any:
        def hook(step: int, phase: str) -> None:
            for r, s in joiners.items():
                if s == step and phase == "forward" and me == 0:
                    world.join(r)
            key = (step, str(phase))
            victims = kills.get(key, ())
            with lock:
                if me in victims and key not in fired:
                    fired.add(key)
                    world.kill(*victims)
            if me in victims:
                raise Killed()
        return hook

    def replica_main(me: int, joining: bool) -> None:
        run = runs[me]
        try:
            holder: list[ResilientStep] = []
            if joining:
                group = FakeGroup(world, me, world.wait_admitted(me))
                world.collective(group.generation, 0, me, None, lambda by: None)  # the rendezvous
            else:
                group = FakeGroup(world, me, world.membership)
            p = cls(run.replica, group, FakeCoordinator(world, me, holder), M, Progress(), min_replicas,
                    hook=hook_of(me), on_event=lambda kind, **f: run.events.append((kind, f)), **kwargs)
            holder.append(p)
            run.protocol = p
            if joining:
                p.join()
            while p.progress.step < steps:
                run.outcomes.append(p.run())
        except Killed:
            run.killed = True
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            run.error = exc
            with world.cond:
                world.cond.notify_all()

    threads = []
    for me in [*range(n), *joiners]:
        runs[me] = Run(FakeReplica(mb_s.get(me, 0.0)))
        t = threading.Thread(target=replica_main, args=(me, me in joiners), daemon=True)
        threads.append(t)
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
        assert not t.is_alive(), "a replica thread hangs"
    return world, runs


def survivors(runs: dict[int, Run]) -> dict[int, Run]:
    return {r: run for r, run in runs.items() if not run.killed}


def assert_every_step_holds_all_M(runs: dict[int, Run], steps: int) -> None:
    """The invariant: every committed step's reduced gradient holds each id exactly once, divided by M,
    and every surviving replica applied exactly the same updates."""
    for r, run in survivors(runs).items():
        assert run.error is None, f"replica {r}: {run.error!r}"
        applied = run.replica.applied
        assert [s for s, _, _ in applied] == list(range(steps - len(applied), steps)), r
        for step, grad, divisor in applied:
            assert grad == [1.0] * M and divisor == M, f"replica {r} step {step}: {grad} / {divisor}"
        assert all(o.microbatches == M and o.loss_sum == sum(range(M)) for o in run.outcomes)
    weights = {r: run.replica.weights.tolist() for r, run in survivors(runs).items()}
    assert len({tuple(w) for w in weights.values()}) == 1, weights


# ---- recover's rule -------------------------------------------------------------------------------
def test_failure_free_steps_hold_all_M_microbatches_split_evenly() -> None:
    _, runs = run_job(4, 3)
    assert_every_step_holds_all_M(runs, 3)
    assert [runs[r].outcomes[0].computed for r in range(4)] == [2, 2, 2, 2]
    assert runs[0].protocol is not None and runs[0].protocol.progress == Progress(3, 3, 3 * M * 10)


@pytest.mark.parametrize("phase", ["forward", "backward", "reduce", "commit"])
def test_a_failure_in_any_phase_is_recovered_in_the_same_step(phase: str) -> None:
    _, runs = run_job(4, 3, kills={(1, phase): (2,)})
    assert runs[2].killed and len(survivors(runs)) == 3
    assert_every_step_holds_all_M(runs, 3)
    step1 = {r: runs[r].outcomes[1] for r in survivors(runs)}
    assert all(o.live == (0, 1, 3) and len(o.recoveries) == 1 for o in step1.values())
    assert sum(o.computed for o in step1.values()) == M  # their own 6 and the dead's 2
    orphans = step1[0].recoveries[0]["orphans"]
    assert orphans == [4, 5]  # the dead replica's share, recomputed by the survivors in step 1
    assert sorted(i for o in step1.values() for i in o.recoveries[0]["my_orphans"]) == [4, 5]


def test_a_failure_after_the_commit_is_recovered_in_the_next_step() -> None:
    _, runs = run_job(4, 3, kills={(1, "optimizer"): (3,)})
    assert_every_step_holds_all_M(runs, 3)
    assert [len(runs[0].outcomes[s].recoveries) for s in range(3)] == [0, 0, 1]  # step 1 committed intact
    assert runs[0].outcomes[1].live == (0, 1, 2, 3) and runs[0].outcomes[2].live == (0, 1, 2)


def test_two_at_once_then_one_while_the_next_generation_forms() -> None:
    world, runs = run_job(6, 3, kills={(1, "backward"): (1, 4), (1, "recover"): (5,)})
    assert {r for r, run in runs.items() if run.killed} == {1, 4, 5}
    assert_every_step_holds_all_M(runs, 3)
    assert runs[0].outcomes[1].live == (0, 2, 3)
    assert world.membership.members == (0, 2, 3)


def test_quorum_lost_stops_every_survivor() -> None:
    _, runs = run_job(4, 3, kills={(1, "reduce"): (1, 2)}, min_replicas=3)
    for r in (0, 3):
        assert isinstance(runs[r].error, QuorumLost) and "min_replicas = 3" in str(runs[r].error)
        assert [s for s, _, _ in runs[r].replica.applied] == [0]  # step 1 never committed


def test_joiners_are_admitted_at_a_commit_and_receive_the_state() -> None:
    world, runs = run_job(3, 4, kills={(0, "forward"): (2,)}, joiners={7: 1})
    assert_every_step_holds_all_M(runs, 4)
    joiner = runs[7]
    assert joiner.protocol is not None and joiner.protocol.progress.step == 4
    assert [s for s, _, _ in joiner.replica.applied] == [2, 3]  # joined at the step-1 commit
    assert ("state_received", {"step": 2}) in [(k, {"step": f["step"]}) for k, f in joiner.events]
    assert any(k == "grew" for k, _ in runs[0].events)
    assert world.membership.members == (0, 1, 7)
    assert runs[0].outcomes[2].computed + runs[1].outcomes[2].computed + joiner.outcomes[0].computed == M


# ---- the baselines' rules -------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", [Progress(2, 2, 20), None])
def test_a_joiner_with_nobody_holding_the_state_restores_the_newest_checkpoint(checkpoint: Progress | None) -> None:
    """A ``restore`` generation (every replica that held the state was lost at step 5): the joiner loads the
    checkpoint (``restore``), redoes the steps after it and trains on; with no checkpoint it raises StateLost."""
    world = World(1)
    world.membership = FakeMembership(3, (0,), joined=(0,), restore=True, step=5)
    run, holder = Run(FakeReplica()), []
    p = ResilientStep(run.replica, FakeGroup(world, 0, world.membership), FakeCoordinator(world, 0, holder), M,
                      on_event=lambda kind, **f: run.events.append((kind, f)), policy="even",
                      restore=lambda: checkpoint)
    holder.append(p)
    if checkpoint is None:
        with pytest.raises(StateLost, match="no intact checkpoint to fall back to"):
            p.join()
        return
    p.join()
    assert p.progress == checkpoint and p.coordinator.committed_step == 1
    assert [(k, f["step"], f["redo"]) for k, f in run.events] == [("restored", 2, 3)]
    while p.progress.step < 4:
        run.outcomes.append(p.run())
    assert [s for s, _, _ in run.replica.applied] == [2, 3] and all(o.microbatches == M for o in run.outcomes)


def test_shrink_drops_a_step_whose_all_reduce_broke_and_then_averages_over_fewer() -> None:
    _, runs = run_job(4, 3, kills={(1, "backward"): (3,)}, cls=ShrinkStep, initial_replicas=4)
    s = survivors(runs)
    assert len(s) == 3
    for run in s.values():
        assert run.error is None
        steps = [(step, divisor) for step, _, divisor in run.replica.applied]
        assert steps == [(0, M), (1, 6), (2, 6)]  # dropped step 1's data; later steps hold 3 shares
        assert [o.data_step for o in run.outcomes] == [0, 2, 3]
        assert any(k == "step_dropped" for k, _ in run.events)


def test_shrink_keeps_a_step_whose_all_reduce_completed() -> None:
    _, runs = run_job(4, 3, kills={(1, "commit"): (3,)}, cls=ShrinkStep, initial_replicas=4)
    for run in survivors(runs).values():
        assert run.error is None
        assert [(s, d) for s, _, d in run.replica.applied] == [(0, M), (1, M), (2, 6)]
        assert any(k == "step_kept" for k, _ in run.events)


def test_restart_baseline_stops_the_job_at_the_first_failure() -> None:
    _, runs = run_job(4, 3, kills={(1, "forward"): (0,)}, cls=StopOnFailureStep)
    for r in (1, 2, 3):
        assert isinstance(runs[r].error, JobFailed)
        assert [s for s, _, _ in runs[r].replica.applied] == [0]


# ---- stragglers ------------------------------------------------------------------------------------
def test_a_slow_replica_gets_fewer_microbatches_and_every_plan_agrees() -> None:
    """Replica 3 is 4x slower: after a few commits the agreed speeds give it less work, every step still
    holds all M (the World asserts that all votes carry the same ids), and a joiner plans alike."""
    world, runs = run_job(4, 12, mb_s={0: 0.004, 1: 0.004, 2: 0.004, 3: 0.016, 5: 0.004}, joiners={5: 8},
                          policy="weighted")
    assert_every_step_holds_all_M(runs, 12)
    computed = [runs[3].outcomes[s].computed for s in range(12)]
    assert computed[0] == 2 and computed[-1] < 2, computed
    assert 3 in world.tracker.stragglers and world.plans[-1] is not None
    assert runs[5].outcomes and all(o.microbatches == M for o in runs[5].outcomes)
    assert runs[5].protocol is not None and runs[5].protocol.speeds == runs[0].protocol.speeds


def test_the_even_policy_ignores_speeds() -> None:
    _, runs = run_job(2, 4, mb_s={0: 0.002, 1: 0.008})
    assert [o.computed for o in runs[1].outcomes] == [M // 2] * 4


def test_a_replica_whose_first_rendezvous_failed_plans_the_step_as_the_members_that_formed_it() -> None:
    """Generation 0 (replicas 0-3) formed for 0, 2 and 3, not for 1 (it could not connect to 2, which was
    fenced); 0 and 3 computed their share and re-planned 2's orphans over 0, 1 and 3. Replica 1 starts in
    generation 1: it computes its share of generation 0's plan plus its orphans, so every id is computed
    exactly once (before: it planned afresh over 0, 1 and 3 and computed ids another replica held)."""
    from recover.workload import plan_step, replan

    world = World(4)
    first, now = FakeMembership(0, (0, 1, 2, 3)), FakeMembership(1, (0, 1, 3))
    group = FakeGroup(world, 1, now)
    group.passed = (first,)  # type: ignore[attr-defined]
    p = ResilientStep(FakeReplica(), group, FakeCoordinator(world, 1, []), M, Progress(), 1, policy="even")
    base = plan_step(M, first.members, 0, p.assignment, p.seed, None)
    orphans = replan(base, None, {2}, {0, 1, 3}, None)
    survivors_plan = {r: base[r] + orphans.get(r, []) for r in (0, 1, 3)}
    plan = p._step_plan(0)
    assert plan == survivors_plan and sorted(i for ids in plan.values() for i in ids) == list(range(M))
    assert p._step_plan(0) == p.plan(0) != survivors_plan  # once: the next step plans over the members
    # a joiner's failed generation is not planned from (the members plan after its state transfer), nor
    # one of another step
    for stale in (FakeMembership(0, (0, 1, 2, 3), joined=(1,)), FakeMembership(0, (0, 1, 2, 3), step=3)):
        group.passed = (stale,)  # type: ignore[attr-defined]
        assert p._step_plan(0) == p.plan(0)
