"""LAYER 2: one step with in-step recovery (DESIGN 4.3).

    plan      ids 0..M-1 -> live replicas (layer 3, deterministic: every survivor computes the same plan)
    compute   this replica runs its ids; the accumulator's ledger records each finished id
    reduce    all-reduce a COPY of the accumulator on generation g (layer 1)
      on PeerFailure: move to generation g+1; orphans = ids the dead replicas held in the plan;
                      re-plan the orphans over the survivors; compute ours; reduce again (repeat)
    commit    the coordinator's vote on (g, step, ids == all M); only then may the optimizer step

Invariants:
- the accumulator only ever grows by whole microbatches, and a reduction never writes to it, so
  the gradients survivors computed before a failure are kept and never corrupted;
- a step returns only after the reduced payload holds exactly M microbatches and every live
  replica voted to commit it; otherwise it keeps recovering or raises :class:`QuorumLost`.

The caller (the worker) divides by M, clips and steps the optimizer, so the LR schedule and the
data cursor advance only on commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from recover.errors import PeerFailure, QuorumLost
from recover.recovery.accumulator import GradAccumulator
from recover.workload import assign, replan

Compute = Callable[[int, list[int]], None]  # (step, ids) -> fold their gradients into the accumulator
Hook = Callable[[int, str], Any]  # (step, phase) -> fault injection point


@dataclass
class StepOutcome:
    """What a committed step leaves: the reduced payload and how it got there."""

    reduced: list[torch.Tensor]
    loss_sum: float
    microbatches: int
    generation: int
    live: tuple[int, ...]
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    computed: int = 0
    """Microbatches this replica computed in the step (its quota plus any orphans)."""
    admitted: Any = None
    """A new membership decided at the commit (joiners admitted), or None."""


class ResilientStep:
    """Runs steps on a fault-tolerant group, recovering in-step from replica failures.

    Args:
        replica: this replica's id.
        group: the current generation's ``FaultTolerantGroup`` (replaced as generations change).
        client: the coordinator client (commit vote).
        acc: this replica's gradient accumulator.
        compute: runs forward/backward of the given ids of a step into ``acc``.
        M: microbatches per step.
        min_replicas: below this many live replicas a step raises QuorumLost.
        hook: called at each phase point (fault injection); ``(step, phase)``.
        on_event: called with (kind, fields) for recovery events (logging).
    """

    def __init__(self, replica: int, group: Any, client: Any, acc: GradAccumulator, compute: Compute, M: int,
                 min_replicas: int = 1, hook: Hook | None = None,
                 on_event: Callable[..., Any] | None = None) -> None:
        self.replica = replica
        self.group = group
        self.client = client
        self.acc = acc
        self.compute = compute
        self.M = M
        self.min_replicas = min_replicas
        self.hook = hook or (lambda step, phase: None)
        self.on_event = on_event or (lambda kind, **fields: None)

    def plan(self) -> dict[int, list[int]]:
        """Ids of this step per live replica: all M, evenly over the current members (layer 3)."""
        return assign(list(range(self.M)), self.group.members)

    def run(self, step: int, data_step: int | None = None) -> StepOutcome:
        """Computes, reduces and commits optimizer step ``step``; its samples are those of ``data_step``
        (the same by default; a baseline that drops steps consumes data faster than it commits)."""
        data_step = step if data_step is None else data_step
        plan = self.plan()
        todo = plan[self.replica]
        self.acc.reset()
        recoveries: list[dict[str, Any]] = []
        computed = 0
        while True:
            self.compute(data_step, todo)
            computed += len(todo)
            try:
                return self._reduce_and_commit(step, plan, recoveries, computed)
            except PeerFailure as failure:
                plan, todo = self.on_failure(step, plan, failure, recoveries)

    def expected_ids(self, plan: dict[int, list[int]]) -> list[int]:
        """The ids a committed step must hold: all M (a shrinking baseline expects fewer)."""
        return list(range(self.M))

    def _reduce_and_commit(self, step: int, plan: dict[int, list[int]], recoveries: list[dict[str, Any]],
                           computed: int) -> StepOutcome:
        self.hook(step, "reduce")
        reduced = self.group.allreduce(self.acc.payload())
        loss_sum, count = GradAccumulator.totals(reduced)
        ids = sorted(i for ids in plan.values() for i in ids)
        expected = self.expected_ids(plan)
        if count != len(expected) or ids != expected:
            raise RuntimeError(f"step {step}: reduced gradient holds {count} microbatches and the plan covers "
                               f"{len(ids)}, expected {len(expected)}: the ledger is inconsistent")
        self.hook(step, "commit")
        admitted = self.client.vote_commit(self.group.generation, step, ids)
        return StepOutcome(reduced=reduced, loss_sum=loss_sum, microbatches=count,
                           generation=self.group.generation, live=tuple(self.group.members),
                           recoveries=recoveries, computed=computed, admitted=admitted)

    def regroup(self, step: int) -> int:
        """Moves to the coordinator's next generation (surviving failures while it forms); returns the old one.

        Raises:
            QuorumLost: fewer than ``min_replicas`` replicas are left.
        """
        old = self.group.generation
        self.hook(step, "recover")
        while True:
            try:
                self.group = self.group.next_generation()
                break
            except PeerFailure:  # a second failure while the new generation forms
                continue
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
        new_work = replan(plan, None, dead, live) if dead else {}
        merged = {r: list(ids) + list(new_work.get(r, [])) for r, ids in plan.items() if r in live}
        todo = list(new_work.get(self.replica, []))
        latency_ms = (time.perf_counter() - t0) * 1000
        info = {"step": step, "from_generation": old_generation, "generation": self.group.generation,
                "dead": sorted(dead), "reported_dead": list(failure.dead), "live": sorted(live),
                "orphans": sorted(i for r in dead for i in plan[r]), "my_orphans": todo,
                "regroup_ms": round(latency_ms, 3)}
        recoveries.append(info)
        self.on_event("recovered", **info)
        return merged, todo
