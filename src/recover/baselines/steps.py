"""The step of each baseline, as a variant of :class:`~recover.recovery.protocol.ResilientStep`.

Contract: same compute, reduction and commit vote as ``recover``; only what happens on a
``PeerFailure`` (and hence which microbatches a committed step holds) differs:

- :class:`ShrinkStep` (shrink-and-drop): every replica always computes its own fixed share of the
  failure-free assignment (its "local batch"); a failure discards the step (:class:`StepDropped`:
  no optimizer update, its data is consumed) and later steps hold only the survivors' shares, so
  they commit fewer than M microbatches and the gradient is divided by that smaller count.
- :class:`StopOnFailureStep` (checkpoint-and-restart): a failure ends the job (:class:`JobFailed`);
  the launcher relaunches it from the last complete checkpoint.
"""

from __future__ import annotations

from typing import Any

from recover.errors import PeerFailure
from recover.recovery.protocol import ResilientStep
from recover.workload import assign


class StepDropped(Exception):
    """Shrink-and-drop discarded this step after a failure; its data is consumed, nothing committed."""


class JobFailed(Exception):
    """Checkpoint-and-restart: a replica failed, so the whole job stops and is relaunched."""


class ShrinkStep(ResilientStep):
    def __init__(self, *args: Any, initial_replicas: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares = assign(list(range(self.M)), range(initial_replicas))

    def plan(self) -> dict[int, list[int]]:
        return {r: list(self.shares[r]) for r in self.group.members}

    def expected_ids(self, plan: dict[int, list[int]]) -> list[int]:
        return sorted(i for ids in plan.values() for i in ids)

    def on_failure(self, step: int, plan: dict[int, list[int]], failure: PeerFailure,
                   recoveries: list[dict[str, Any]]) -> tuple[dict[int, list[int]], list[int]]:
        old = self.regroup(step)
        dead = sorted(set(plan) - set(self.group.members))
        self.on_event("step_dropped", step=step, from_generation=old, generation=self.group.generation, dead=dead)
        raise StepDropped(f"step {step} dropped after losing replicas {dead}")


class StopOnFailureStep(ResilientStep):
    def on_failure(self, step: int, plan: dict[int, list[int]], failure: PeerFailure,
                   recoveries: list[dict[str, Any]]) -> tuple[dict[int, list[int]], list[int]]:
        self.on_event("job_failed", step=step, generation=failure.generation, dead=list(failure.dead))
        raise JobFailed(f"replicas {list(failure.dead)} failed at step {step}: the job stops for a restart")


def step_class(baseline: str | None) -> type[ResilientStep]:
    return {None: ResilientStep, "recover": ResilientStep, "shrink": ShrinkStep,
            "restart": StopOnFailureStep}[baseline]
