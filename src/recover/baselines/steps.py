"""The step of each baseline, as a variant of :class:`~recover.recovery.protocol.ResilientStep`.

Contract: same compute, reduction and commit vote as ``recover``; only what happens on a
``PeerFailure`` (and hence which microbatches a committed step holds) differs:

- :class:`ShrinkStep` (shrink-and-drop, torchft's semantics): every replica always computes its
  own fixed share of the failure-free assignment (its "local batch"); a step whose all-reduce a
  failure broke is discarded (no optimizer update, its data is consumed: :meth:`ShrinkStep.commit`
  moves on to the next step's samples) and
  later steps hold only the survivors' shares, so they commit fewer than M microbatches and the
  gradient is divided by that smaller count.
- :class:`StopOnFailureStep` (checkpoint-and-restart): a failure ends the job (:class:`JobFailed`);
  the launcher relaunches it from the last complete checkpoint.

Which failures drop a step under ``--baseline shrink`` (phases of ``--fail R@STEP:PHASE``), and why:
what torchft 0.2.0 does. Its ``Manager`` forms a quorum with the Lighthouse at the start of every
step (``start_quorum`` from ``zero_grad``; a replica that does not ask for it is left out once its
heartbeat expires); the step's gradient all-reduce runs over that quorum; ``should_commit`` then
returns ``enough_replicas and no error was recorded in this step`` (agreed only among the ranks of
one replica group: different replica groups may decide differently; one that did not commit heals
from a replica at the highest step at the next quorum). So:

====================================  ==================  ==========================================
replica killed at phase of step ``s``  step ``s``           why
====================================  ==================  ==========================================
``forward``, ``backward``, ``reduce``  dropped             it was in the step's quorum, its share never
                                                           reached the all-reduce, which fails
``commit`` (all-reduce done)           committed, all M    the all-reduce completed with its share;
                                       shares               no error on the survivors
``optimizer``, ``idle``                committed           (voted before); step ``s + 1`` forms its
                                                           quorum without it and is not dropped
====================================  ==================  ==========================================

We reproduce that with :meth:`ShrinkStep.run`: a *quorum barrier* (a one-float all-reduce over the
current generation) opens every step, as torchft's per-step quorum does; then compute, all-reduce,
commit vote. On a ``PeerFailure`` anywhere in the step every survivor moves to the next generation
and takes part in one *agreement* all-reduce of two flags: "my quorum barrier completed" and "my
all-reduce of this step completed". Then, the same on every survivor:

- all survivors completed the all-reduce: the step commits (voted again in the new generation)
  with the reduced gradient of all of its shares, the dead replica's included;
- no survivor completed the quorum barrier (the replica died before this step's quorum): the
  step starts again over the survivors, nothing dropped;
- otherwise the step is dropped.

Where a failure lands between survivors (one finished the all-reduce, another's was cut by the
failure notice), every survivor drops the step, where torchft would let the finished ones commit
and the others heal from them at the next quorum: the trajectories differ by that one step only
in that race. The barrier costs one tiny all-reduce per step (torchft pays a Lighthouse quorum
round trip per step).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from recover.errors import PeerFailure
from recover.names import Baseline, Event, Phase
from recover.recovery.protocol import Committed, ResilientStep
from recover.workload import assign

COMMIT, RETRY, DROP = "commit", "retry", "drop"


class JobFailed(Exception):
    """Checkpoint-and-restart: a replica failed, so the whole job stops and is relaunched."""


class _Dropped(Exception):
    """Shrink-and-drop discarded this step after a failure; its data is consumed, nothing committed."""


class ShrinkStep(ResilientStep):
    """Shrink-and-drop with torchft's commit rule (see the module docstring)."""

    def __init__(self, *args: Any, initial_replicas: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares = assign(list(range(self.M)), range(initial_replicas))

    def plan(self, data_step: int) -> dict[int, list[int]]:
        return {r: list(self.shares[r]) for r in self.group.members}

    def expected_ids(self, plan: dict[int, list[int]]) -> list[int]:
        return sorted(i for ids in plan.values() for i in ids)

    def divisor(self, microbatches: int) -> int:
        """The survivors' (smaller) count: a shrunken step averages over fewer microbatches."""
        return microbatches

    def commit(self, step: int, data_step: int) -> Committed:
        """Steps whose all-reduce a failure broke are dropped (their data consumed) until one commits.

        Raises:
            QuorumLost: fewer than ``min_replicas`` replicas are left.
        """
        while True:
            try:
                return self._attempt(step, self.progress.data_step)
            except _Dropped:
                self.progress.data_step += 1

    def _attempt(self, step: int, data_step: int) -> Committed:
        """Quorum barrier, compute, all-reduce and commit vote; on a failure, survivors agree on its fate."""
        recoveries: list[dict[str, Any]] = []
        while True:
            plan = self.plan(data_step)
            generation = self.group.generation
            in_quorum = reduced = None
            try:
                self.group.barrier()  # the step's quorum: who is alive now takes part in this step
                in_quorum = True
                self.replica.reset()
                self.replica.compute(data_step, plan[self.me], self.hook)
                self.hook(step, Phase.REDUCE)
                reduced = self.group.allreduce(self.replica.payload())
                return self.vote(step, plan, reduced, recoveries, len(plan[self.me]))
            except PeerFailure:
                pass
            t0 = time.perf_counter()
            verdict = self._agree(step, bool(in_quorum), reduced is not None)
            dead = sorted(set(plan) - set(self.group.members))
            info = {"step": step, "from_generation": generation, "generation": self.group.generation,
                    "dead": dead, "live": sorted(self.group.members), "verdict": verdict,
                    "regroup_ms": round((time.perf_counter() - t0) * 1000, 3)}
            if verdict == DROP:
                self.on_event(Event.STEP_DROPPED, step=step, from_generation=generation,
                              generation=self.group.generation, dead=dead)
                raise _Dropped(f"step {step} dropped after losing replicas {dead}")
            recoveries.append(info)
            if verdict == RETRY:  # the replica died before this step's quorum: start it over the survivors
                self.on_event(Event.QUORUM_REFORMED, **info)
                continue
            self.on_event(Event.STEP_KEPT, **info)  # the all-reduce had completed everywhere: commit it
            assert reduced is not None
            while True:
                try:
                    return self.vote(step, plan, reduced, recoveries, len(plan[self.me]))
                except PeerFailure:
                    if self._agree(step, True, True) != COMMIT:  # only survivors that hold it are left
                        raise RuntimeError(f"step {step}: survivors disagree after agreeing to commit") from None

    def _agree(self, step: int, in_quorum: bool, reduced: bool) -> str:
        """Moves to the next generation and agrees with every survivor on the step's fate (retried
        on each further failure): COMMIT if all completed its all-reduce, RETRY if none had
        completed its quorum barrier, else DROP."""
        while True:
            self.regroup(step)
            flags = torch.tensor([float(in_quorum), float(reduced)], dtype=torch.float64)
            try:
                total = self.group.allreduce([flags])[0]
            except PeerFailure:
                continue
            n = len(self.group.members)
            if round(float(total[1])) == n:
                return COMMIT
            if round(float(total[0])) == 0:
                return RETRY
            return DROP


class StopOnFailureStep(ResilientStep):
    """Checkpoint-and-restart: the first failure ends the job (:class:`JobFailed`)."""

    def on_failure(self, step: int, plan: dict[int, list[int]], failure: PeerFailure,
                   recoveries: list[dict[str, Any]]) -> tuple[dict[int, list[int]], list[int]]:
        self.on_event(Event.JOB_FAILED, step=step, generation=failure.generation, dead=list(failure.dead))
        raise JobFailed(f"replicas {list(failure.dead)} failed at step {step}: the job stops for a restart")


def step_class(baseline: Baseline | str | None) -> type[ResilientStep]:
    """The step protocol of recover (``None``) or of a baseline."""
    if baseline is None:
        return ResilientStep
    return {Baseline.SHRINK: ShrinkStep, Baseline.RESTART: StopOnFailureStep}[Baseline(baseline)]
