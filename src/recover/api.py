"""recover as a library: your own model, optimizer and loop, trained under the invariant.

    rt = recover.init()                                  # this process's replica, device, run directory
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda step: ..., clip=1.0)
    for step in job.steps(total):                        # committed steps only
        for mb in step:                                  # this replica's ids, then orphans of a lost replica
            x, y = mb.batch                              # sample(step, id): a pure function of (step, id)
            mb.backward(loss_fn(model(x), y))            # recover folds the gradient; divides by M, clips, steps

Contract:
- Every step that ``steps()`` yields is committed: it held exactly M microbatches, the same ids
  ``0..M-1`` (the same ``samples(step, id)``) as a failure-free run, and the update divided their gradient
  sum by M, clipped it by ``clip`` and ran ``optimizer.step()`` with ``lr(step)``. recover owns the
  microbatch boundary: a step hands out this replica's share, and after a failure elsewhere the orphans
  it was given in the same step (:meth:`~recover.recovery.protocol.ResilientStep.run_iter`).
- The global RNG is seeded from (seed, step, id) before each microbatch is handed out, so dropout follows
  the sample, not the replica that computes it.
- :func:`init` finds its job in the environment ``recover launch ... -- python SCRIPT`` sets
  (:data:`WORKER_ENV`: the coordinator, the token file, the run directory, this process's replica id,
  its fault injections, whether it joins a running job). There, every replica registers with the
  coordinator, reduces over layer 1's fault-tolerant groups, writes its step records and events into the
  run directory like a built-in replica, and exits with the same statuses when it is fenced or the job
  ends (:mod:`recover.train.exits`). Run as plain ``python SCRIPT`` it is one replica on its own.
- A joiner (a restarted replica) takes the model's parameters, buffers and optimizer state from a live
  replica at a step boundary; ``steps()`` then continues from the step the job is at.
- Scope: one process per replica (your model on one device); pipeline, tensor and FSDP parallelism
  inside a replica, checkpoints of your model, audits of arithmetic and the overlapped reduction are
  the built-in trainer's for now.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recover.names import WORKER_ENV, Phase


@dataclass
class Runtime:
    """Where this process trains (see :func:`init`)."""

    replica: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    out: Path | None = None
    """The run directory (``--out`` of ``recover launch``); None when run on its own."""
    launched: dict[str, Any] | None = None
    """The job's description from :data:`WORKER_ENV`; None when run on its own."""


def init() -> Runtime:
    """This process's replica id, device and run directory: from ``recover launch``'s environment, else one
    replica on its own (``cuda:0`` when a GPU is visible, else the CPU)."""
    raw = os.environ.get(WORKER_ENV)
    if raw is None:
        return Runtime(device=torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    from recover.comm.nccl import apply_env_defaults
    from recover.config import from_dict
    from recover.launch.lifeline import die_with_launcher
    from recover.train.worker import own_device

    die_with_launcher()
    job = json.loads(raw)
    cfg = from_dict(json.loads((Path(job["out"]) / "config.json").read_text()))
    apply_env_defaults(collective_timeout_s=cfg.fault_tolerance.collective_timeout_s)  # before any NCCL use
    job["config"] = cfg
    return Runtime(int(job["replica"]), own_device(cfg), Path(job["out"]), job)


def microbatch_seed(seed: int, step: int, mb: int) -> int:
    """The RNG seed of microbatch ``mb`` of ``step``: a pure function of the three (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{mb}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Microbatch:
    """One microbatch of a step: ``batch`` (``samples(step, id)`` on the replica's device) and
    :meth:`backward`, which must be called once with the loss computed from it."""

    def __init__(self, job: Job, data_step: int, mb: int, batch: Any) -> None:
        self.job, self.step, self.id, self.batch = job, data_step, mb, batch

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then the gradient is folded into the replica's step sum."""
        self.job._hook(Phase.BACKWARD)
        loss.backward()
        self.job.replica.fold(self.id, loss)


class Step:
    """A step being computed: iterate it for its microbatches; after the loop it is committed and applied
    (``loss``, ``grad_norm``, ``microbatches`` then hold what the step record holds)."""

    def __init__(self, job: Job, index: int) -> None:
        self.job, self.index = job, index
        self.outcome: Any = None

    def __iter__(self) -> Iterator[Microbatch]:
        job = self.job
        work_items = job.protocol.run_iter()
        try:
            work = next(work_items)
            while True:
                for mb in work.ids:
                    torch.manual_seed(microbatch_seed(job.seed, work.data_step, mb))
                    job._hook(Phase.FORWARD)
                    yield Microbatch(job, work.data_step, mb, _to(job.samples(work.data_step, mb), job.runtime.device))
                job.replica.settle(work.ids)
                work = work_items.send(None)
        except StopIteration as done:
            self.outcome = done.value
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


class Job:
    """Trains ``model`` with ``optimizer`` under recover (see the module docstring).

    Args:
        model, optimizer: yours; the optimizer over the model's trainable parameters.
        samples: ``samples(step, id) -> batch``, a pure function (tensors in the batch are moved to the
            device; tuples, lists and dicts of them too).
        microbatches: M, the microbatches of every step.
        lr: the learning rate of a committed step (None: the optimizer's, untouched).
        clip: the bound on the global gradient norm (0: none).
        seed: seeds each microbatch's RNG (with the step and the id).
        deterministic: float64 gradient sums (bitwise equal to the failure-free run); default: the
            launch's ``--deterministic``, else False.
        tokens_per_microbatch: for the records' token counts (0 if unknown).
        runtime: from :func:`init` (called here when not given).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, samples: Callable[[int, int], Any],
                 microbatches: int, lr: Callable[[int], float] | None = None, clip: float = 1.0, seed: int = 0,
                 deterministic: bool | None = None, tokens_per_microbatch: int = 0,
                 runtime: Runtime | None = None) -> None:
        from recover.train.own import OwnReplica

        if microbatches < 1:
            raise ValueError(f"microbatches = {microbatches}: a step needs at least one")
        self.runtime = runtime or init()
        cfg = self.runtime.launched["config"] if self.runtime.launched else None
        if deterministic is None:
            deterministic = bool(cfg and cfg.training.deterministic)
        if deterministic:
            from recover.train.loop import use_deterministic_kernels

            use_deterministic_kernels()
        self.model, self.samples, self.M, self.seed = model, samples, microbatches, seed
        self.replica = OwnReplica(model, optimizer, lr=lr, clip=clip, deterministic=deterministic,
                                  device=self.runtime.device, tokens_per_microbatch=tokens_per_microbatch)
        self._session: Any = None
        self.protocol: Any = None
        self._step = 0

    def _hook(self, phase: Phase) -> None:
        if self._session is not None:
            self._session.hook(self._step, phase)

    def steps(self, total: int) -> Iterator[Step]:
        """Committed steps until ``total`` are committed (a joiner starts where the job is)."""
        if self._session is None:
            self._start()
        try:
            while self.protocol.progress.step < total:
                self._step = self.protocol.progress.step
                t0 = time.perf_counter()
                step = Step(self, self._step)
                yield step
                if step.outcome is None:  # the loop broke out of the step's microbatches
                    raise RuntimeError(f"step {self._step} was left before its microbatches were all computed")
                self._record(step.outcome, time.perf_counter() - t0)
        except Exception as exc:
            self._failed(exc)
            raise
        if self._session is not None:
            self._session.finish()

    def _failed(self, exc: Exception) -> None:
        if self._session is not None:
            self._session.fail(exc)

    def _start(self) -> None:
        from recover.recovery.protocol import ResilientStep
        from recover.train.dist import CommitAll, StaticGroup

        if self.runtime.launched is None:
            self.protocol = ResilientStep(self.replica, StaticGroup(), CommitAll(), self.M, seed=self.seed,
                                          overlap=False)
            self._session = None
            return
        from recover.train.script import Session

        self._session = Session(self)
        self.protocol = self._session.protocol

    def _record(self, outcome: Any, dt: float) -> None:
        if self._session is not None:
            self._session.record(outcome, dt)


def _to(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device`` (tuples, lists and dicts walked)."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch

