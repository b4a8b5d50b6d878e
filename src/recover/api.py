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
- A joiner (a restarted replica) takes the model's parameters, buffers, optimizer state and ``extra``
  state from a live replica at a step boundary; ``steps()`` then continues from the step the job is at.
- :meth:`Job.save` checkpoints the model, optimizer, ``extra`` state and counters between steps
  (:mod:`recover.train.own_checkpoint`: the built-in trainer's disk conventions); ``Job(resume=RUN)``
  continues from the newest intact one, bitwise in deterministic mode. In a launched job only the lowest
  live replica writes, with no collective; ``recover launch --resume`` makes ``RUN`` the run directory.
- Scope: one process per replica (your model on one device); pipeline, tensor and FSDP parallelism
  inside a replica, audits of arithmetic and the overlapped reduction are the built-in trainer's for now.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recover.names import WORKER_ENV, Phase

if TYPE_CHECKING:
    from recover.recovery.protocol import Progress


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
        job._inside = True
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
            job._inside = False
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
        extra: more state that is trained along (an EMA, an LR scheduler): an object with ``state_dict()``
            and ``load_state_dict()`` or a dict of such; it goes to joiners and into checkpoints.
        resume: a run directory: the model, optimizer, ``extra`` and counters are loaded from the newest intact
            checkpoint of :meth:`save` under ``RUN/checkpoints`` (none there: a fresh start, said in one line);
            default: the launch's run directory with ``recover launch --resume``, else none.
        runtime: from :func:`init` (called here when not given).

    Raises:
        IncompatibleCheckpoint: ``resume`` holds a checkpoint of another model or extra state (nothing loaded).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, samples: Callable[[int, int], Any],
                 microbatches: int, lr: Callable[[int], float] | None = None, clip: float = 1.0, seed: int = 0,
                 deterministic: bool | None = None, tokens_per_microbatch: int = 0, extra: Any = None,
                 resume: str | os.PathLike[str] | None = None, runtime: Runtime | None = None) -> None:
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
                                  device=self.runtime.device, tokens_per_microbatch=tokens_per_microbatch,
                                  extra=extra)
        self._session: Any = None
        self.protocol: Any = None
        self._step = 0
        self._inside = False  # in a step's microbatch loop
        self.start = self._resume(resume)
        """The counters the step protocol starts from (a resumed checkpoint's) and then advances."""

    def _resume(self, resume: str | os.PathLike[str] | None) -> Progress:
        from recover.recovery.protocol import Progress
        from recover.train import own_checkpoint

        launched = self.runtime.launched
        if resume is None and launched and launched.get("resume"):
            resume = self.runtime.out
        if resume is None or (launched and launched.get("join")):  # a joiner takes the live replicas' state
            return Progress()
        root = own_checkpoint.checkpoints_of(resume)
        return own_checkpoint.resume(root, self.replica, clean=launched is None) or Progress()

    def save(self, run_dir: str | os.PathLike[str] | None = None, *, keep: int | None = None) -> Path | None:
        """Checkpoints the model, optimizer, ``extra`` state and counters after the steps committed so far, in
        ``RUN/checkpoints/step_NNNNNN`` (layout: :mod:`recover.train.own_checkpoint`). Call it between steps
        (after a step's microbatch loop), the same on every replica.

        In a launched job only the lowest live replica writes, alone (no collective, the others do not wait):
        it returns the checkpoint's directory, every other replica None at once.

        Args:
            run_dir: RUN; default: the launch's run directory (``--out``).
            keep: complete checkpoints kept, older ones deleted (0: all); default: the launch's
                ``training.keep_checkpoints``, else 3.

        Raises:
            RuntimeError: called inside a step's microbatch loop. ValueError: no ``run_dir`` when not launched.
        """
        from recover.train import own_checkpoint

        if self._inside:
            raise RuntimeError("job.save() inside a step's microbatch loop: call it after the loop, between steps")
        run_dir = run_dir if run_dir is not None else self.runtime.out
        if run_dir is None:
            raise ValueError("job.save(): run_dir is None; give the run directory, e.g. job.save('runs/mine')")
        if self.protocol is None:
            self._start()
        if self._session is not None and min(self.protocol.group.members) != self.runtime.replica:
            return None
        cfg = self.runtime.launched["config"] if self.runtime.launched else None
        keep = keep if keep is not None else (cfg.training.keep_checkpoints if cfg else 3)
        # launched: the coordinator's hang rule does not count the write as a stuck training loop
        with self._session.client.activity("io") if self._session is not None else nullcontext():
            return own_checkpoint.save(own_checkpoint.checkpoints_of(run_dir), self.replica, self.protocol.progress,
                                       seed=self.seed, microbatches=self.M, keep=keep)

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
            self.protocol = ResilientStep(self.replica, StaticGroup(), CommitAll(), self.M, self.start,
                                          seed=self.seed, overlap=False)
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

