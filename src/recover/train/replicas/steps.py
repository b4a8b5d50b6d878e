"""The committed steps of a step protocol: the one iterator of committed steps, shared by
:class:`recover.api.Job` (your loop) and :class:`recover.train.processes.loop.Loop` (the built-in trainer's).

Contract:
- :meth:`Steps.steps` yields a :class:`Step` per step until ``total`` are committed (a joiner starts where
  the job is) or a committed stop; a step left before its microbatches were all computed is an error.
- A :class:`Step` is run whole by the replica's own ``compute`` (:meth:`Step.run`), or iterated for its
  microbatches (your loop computes them) over the :class:`LoopContext` its owner gave (:attr:`Steps.context`:
  the replica that folds the gradients, the reads, this rank's place in its replica, the phase hook): before
  each is handed out the global RNG is seeded from :func:`microbatch_seed` (seed, step, id), so dropout follows
  the sample, not the replica that computes it.
- A coordinator restart that moved the job's state (``Resynced``) starts the step over.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from recover.names import Phase

if TYPE_CHECKING:
    from recover.data.prefetch import Prefetcher
    from recover.recovery.protocol import ResilientStep, StepOutcome


class LoopReplica(Protocol):
    """The replica a loop's microbatches fold into (:class:`~recover.train.replicas.own.OwnReplica`)."""

    perturb: Any

    @property
    def grad_scale(self) -> float: ...

    def fold(self, step: int, mb: int | None, loss: torch.Tensor) -> None: ...

    def settle(self, ids: list[int], mine: list[int]) -> None: ...


@dataclass
class LoopContext:
    """What a step's microbatch loop works with (a :class:`recover.api.Job` builds it).

    ``column(ids)``: the ids this rank computes of a replica's ``ids`` (None: a zero-weight padding pass);
    ``hook(step, phase)``: every phase point (progress and fault injections of a launched job);
    ``failed(exc)``: the end of a job this replica cannot go on in (exits with its status, or returns).
    """

    replica: LoopReplica
    reads: Prefetcher
    device: torch.device
    seed: int
    column: Callable[[list[int]], list[int | None]]
    hook: Callable[[int, Phase], None]
    failed: Callable[[Exception], None]
    probe: Callable[[int], int] | None = None
    """The step's probe microbatch (read by every replica; see :mod:`recover.train.replicas.contract`); None: none."""
    probed: Callable[[int], None] = lambda data_step: None
    """After each batch of a step's work: the probe's digest into the vote (a launched Job's)."""
    evaluated: Callable[[StepOutcome], float | None] = lambda outcome: None
    """After a step's commit, before the loop sees it: an evaluation when due (its value, else None)."""
    protocol: ResilientStep | None = None
    step: int = 0
    """The step being computed (for the phase hook)."""
    inside: bool = False
    """In a step's microbatch loop (a save there is refused)."""

    def phase(self, phase: Phase) -> None:
        self.hook(self.step, phase)

    def read_ahead(self, data_step: int, ids: list[int]) -> None:
        """Schedules the background reads of ``ids`` of ``data_step`` (this rank's) and of this rank's expected
        share of the next ``prefetch`` steps (the step protocol's plan with the current members and speeds)."""
        assert self.protocol is not None
        self.reads.ahead(data_step, ids)
        if self.probe is not None:  # read by every replica: ahead, after its own
            for step in range(data_step, data_step + 1 + self.reads.steps):
                self.reads.ahead(step, [self.probe(step)])
        for coming in range(data_step + 1, data_step + 1 + self.reads.steps):
            self.reads.ahead(coming, [mb for mb in self.column(self.protocol.share(coming)) if mb is not None])

    def slow(self, dt: float) -> None:
        """Under an injected time factor s (``--slow``), a microbatch that took ``dt`` takes s times as long."""
        factor = self.replica.perturb.time_factor()
        if factor > 1.0:
            time.sleep((factor - 1.0) * dt)


def microbatch_seed(seed: int, step: int, mb: int) -> int:
    """The RNG seed of microbatch ``mb`` of ``step``: a pure function of the three (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{mb}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Microbatch:
    """One microbatch of a step: ``batch`` (``samples(step, id)`` on the replica's device) and
    :meth:`backward`, which must be called once with the loss computed from it. ``id`` None, ``weight``
    0: a padding pass of a rank with fewer ids than the others of its fsdp group (its gradient is zero)."""

    def __init__(self, context: LoopContext, data_step: int, mb: int | None, batch: Any) -> None:
        self.context, self.step, self.id, self.batch = context, data_step, mb, batch
        self.weight = 0.0 if mb is None else 1.0
        self.done = False

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then the gradient is folded into the replica's step sum.

        Raises:
            RuntimeError: called a second time for this microbatch (its gradient is in the sum once).
        """
        if self.done:
            raise RuntimeError(f"mb.backward() called twice for microbatch {self.id} of step {self.step}: call it "
                               "once per microbatch, with the loss of that microbatch")
        self.done = True
        self.context.phase(Phase.BACKWARD)
        scale = self.context.replica.grad_scale if self.id is not None else 0.0  # float16's loss scale; padding: 0
        (loss if scale == 1.0 else loss * scale).backward()
        self.context.replica.fold(self.step, self.id, loss)


class Step:
    """A step being computed: iterate it for its microbatches (your loop computes them), or :meth:`run` it (a
    replica that computes its own: the built-in trainer's); then it is committed and applied (``loss``,
    ``grad_norm``, ``microbatches`` hold what the step record holds; reading them before raises)."""

    def __init__(self, steps: Steps, index: int) -> None:
        self.steps, self.index = steps, index
        self.outcome: StepOutcome | None = None
        self.val_loss: float | None = None
        """The evaluation after this step's commit, where one ran (``Job(evaluate=..., eval_every=...)``)."""

    def run(self) -> StepOutcome:
        """The whole step by the replica's own ``compute`` (pipeline schedules, audits, the overlapped
        reduction); returns the outcome. A coordinator restart that moved the state starts it over."""
        from recover.recovery.protocol import Resynced

        while self.outcome is None:
            try:
                self.outcome = self.steps.protocol.run()
            except Resynced:
                self.index = self.steps.protocol.progress.step
        return self.outcome

    def __iter__(self) -> Iterator[Microbatch]:
        from recover.recovery.protocol import Resynced

        ctx = self.steps.context
        if ctx is None:
            raise TypeError("this step's replica computes its own microbatches: call step.run()")
        protocol = self.steps.protocol
        ctx.inside = True
        while self.outcome is None:
            work_items = protocol.run_iter()
            try:
                work = next(work_items)
                while True:
                    mine = ctx.column(work.ids)
                    ctx.read_ahead(work.data_step, [work.ids[0] if mb is None else mb for mb in mine])
                    for mb in mine:
                        torch.manual_seed(microbatch_seed(ctx.seed, work.data_step, -1 if mb is None else mb))
                        ctx.phase(Phase.FORWARD)
                        batch = ctx.reads.get(work.data_step, work.ids[0] if mb is None else mb)
                        t0 = time.perf_counter()
                        yield Microbatch(ctx, work.data_step, mb, _to(batch, ctx.device))
                        ctx.slow(time.perf_counter() - t0)
                    ctx.replica.settle(work.ids, [mb for mb in mine if mb is not None])
                    ctx.probed(work.data_step)
                    work = work_items.send(None)
            except StopIteration as done:
                self.outcome = done.value
                ctx.inside = False
                self.val_loss = ctx.evaluated(self.outcome)
            except Resynced:  # the job's state moved after a coordinator restart: the step starts over
                self.index = ctx.step = protocol.progress.step
            except Exception as exc:  # the job cannot go on here: fenced, quorum lost, diverged (exits with one line)
                ctx.failed(exc)
                raise

    def _done(self) -> StepOutcome:
        if self.outcome is None:
            raise RuntimeError(f"step {self.index} is not committed yet: read step.loss, step.grad_norm and "
                               "step.microbatches after its microbatch loop")
        return self.outcome

    @property
    def loss(self) -> float:
        return self._done().loss

    @property
    def grad_norm(self) -> float:
        return self._done().grad_norm

    @property
    def microbatches(self) -> int:
        return self._done().microbatches


class Steps:
    """The committed steps of a step protocol: the one iterator of committed steps, for your loop
    (:class:`recover.api.Job`) and the built-in trainer's (:class:`recover.train.processes.loop.Loop`)."""

    def __init__(self, protocol: ResilientStep | None = None, context: LoopContext | None = None) -> None:
        self.protocol: Any = protocol  # set before steps() (a Job builds its protocol when the loop starts)
        self.context = context
        """What a step's microbatch loop works with; None: the replica computes its own (:meth:`Step.run`)."""
        self._step = 0

    def steps(self, total: int) -> Iterator[Step]:
        """Committed steps until ``total`` are committed (a joiner starts where the job is), or until a
        committed stop (SIGINT in a launched job, or SIGTERM to its launcher) or this replica's leave
        (SIGTERM to it)."""
        stopped = False
        while self.protocol.progress.step < total and not stopped:
            self._step = self.protocol.progress.step
            if self.context is not None:
                self.context.step = self._step
            t0 = time.perf_counter()
            step = Step(self, self._step)
            yield step
            if step.outcome is None:  # the loop broke out of the step's microbatches
                raise RuntimeError(f"step {self._step} was left before its microbatches were all computed")
            self._committed(step.outcome, time.perf_counter() - t0)
            stopped = step.outcome.stop or step.outcome.left

    def _committed(self, outcome: Any, dt: float) -> None:
        """After each committed step (a launched Job's records)."""



def _to(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device`` (tuples, lists and dicts walked)."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch

