"""The committed steps of a step protocol: the one iterator of committed steps, shared by
:class:`recover.api.Job` (your loop) and :class:`recover.train.loop.Loop` (the built-in trainer's).

Contract:
- :meth:`Steps.steps` yields a :class:`Step` per step until ``total`` are committed (a joiner starts where
  the job is) or a committed stop; a step left before its microbatches were all computed is an error.
- A :class:`Step` is run whole by the replica's own ``compute`` (:meth:`Step.run`), or iterated for its
  microbatches (your loop computes them): before each is handed out the global RNG is seeded from
  :func:`microbatch_seed` (seed, step, id), so dropout follows the sample, not the replica that computes it.
- A coordinator restart that moved the job's state (``Resynced``) starts the step over.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from recover.names import Phase


def microbatch_seed(seed: int, step: int, mb: int) -> int:
    """The RNG seed of microbatch ``mb`` of ``step``: a pure function of the three (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{mb}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Microbatch:
    """One microbatch of a step: ``batch`` (``samples(step, id)`` on the replica's device) and
    :meth:`backward`, which must be called once with the loss computed from it. ``id`` None, ``weight``
    0: a padding pass of a rank with fewer ids than the others of its fsdp group (its gradient is zero)."""

    def __init__(self, job: Any, data_step: int, mb: int | None, batch: Any) -> None:
        self.job, self.step, self.id, self.batch = job, data_step, mb, batch
        self.weight = 0.0 if mb is None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then the gradient is folded into the replica's step sum."""
        self.job._hook(Phase.BACKWARD)
        (loss if self.id is not None else loss * 0.0).backward()
        self.job.replica.fold(self.step, self.id, loss)


class Step:
    """A step being computed: iterate it for its microbatches (your loop computes them), or :meth:`run` it (a
    replica that computes its own: the built-in trainer's); then it is committed and applied (``loss``,
    ``grad_norm``, ``microbatches`` hold what the step record holds)."""

    def __init__(self, job: Any, index: int) -> None:
        self.job, self.index = job, index
        self.outcome: Any = None

    def run(self) -> Any:
        """The whole step by the replica's own ``compute`` (pipeline schedules, audits, the overlapped
        reduction); returns the outcome. A coordinator restart that moved the state starts it over."""
        from recover.recovery.protocol import Resynced

        while self.outcome is None:
            try:
                self.outcome = self.job.protocol.run()
            except Resynced:
                self.index = self.job.protocol.progress.step
        return self.outcome

    def __iter__(self) -> Iterator[Microbatch]:
        from recover.recovery.protocol import Resynced
        from recover.train.own import column

        job, rt = self.job, self.job.runtime
        fsdp, (index, _) = rt.fsdp, rt.coordinate
        job._inside = True
        while self.outcome is None:
            work_items = job.protocol.run_iter()
            try:
                work = next(work_items)
                while True:
                    mine = column(work.ids, fsdp, index)
                    job._read_ahead(work.data_step, [work.ids[0] if mb is None else mb for mb in mine])
                    for mb in mine:
                        torch.manual_seed(microbatch_seed(job.seed, work.data_step, -1 if mb is None else mb))
                        job._hook(Phase.FORWARD)
                        batch = job.reads.get(work.data_step, work.ids[0] if mb is None else mb)
                        t0 = time.perf_counter()
                        yield Microbatch(job, work.data_step, mb, _to(batch, rt.device))
                        job._slow(time.perf_counter() - t0)
                    job.replica.settle(work.ids, [mb for mb in mine if mb is not None])
                    work = work_items.send(None)
            except StopIteration as done:
                self.outcome = done.value
                job._inside = False
            except Resynced:  # the job's state moved after a coordinator restart: the step starts over
                self.index = job._step = job.protocol.progress.step
            except Exception as exc:  # the job cannot go on here: fenced, quorum lost, diverged (exits with one line)
                job._failed(exc)
                raise

    @property
    def loss(self) -> float:
        return self.outcome.loss

    @property
    def grad_norm(self) -> float:
        return self.outcome.grad_norm

    @property
    def microbatches(self) -> int:
        return self.outcome.microbatches


class Steps:
    """The committed steps of a step protocol: the one iterator of committed steps, for your loop
    (:class:`recover.api.Job`) and the built-in trainer's (:class:`recover.train.loop.Loop`)."""

    def __init__(self, protocol: Any = None) -> None:
        self.protocol = protocol
        self._step = 0

    def steps(self, total: int) -> Iterator[Step]:
        """Committed steps until ``total`` are committed (a joiner starts where the job is), or until a
        committed stop (SIGINT in a launched job, or SIGTERM to its launcher) or this replica's leave
        (SIGTERM to it)."""
        stopped = False
        while self.protocol.progress.step < total and not stopped:
            self._step = self.protocol.progress.step
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

