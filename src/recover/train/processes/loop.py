"""The loop of committed steps, shared by ``recover train`` and every replica of ``recover launch``.

    replica = Replica.from_config(cfg, sampler, ctx)          # model, optimizer, step gradients
    step = ResilientStep(replica, group, coordinator, M, ...)  # the step protocol (layer 2)
    for committed in Steps(step).steps(end):   # the library API's iterator too (recover.train.replicas.steps)
        outcome = committed.run()            # plan, compute, reduce, recover, commit, apply, admit
        record it; validate and checkpoint when due (the lowest live replica)

Contract: a record is written for every committed step, after its optimizer update, with
``data_wait_ms``: how long the training thread waited for microbatches in the step (reads that the
read-ahead of :mod:`recover.data.prefetch` did not hide); validation
and checkpoints run on the lowest live replica only (every rank of it: both are collective inside
a replica of several ranks), so the other replicas never wait for them; which steps are saved is the
:class:`~recover.train.checkpoints.cadence.Cadence`'s (``training.checkpoint_every``, a number or ``"auto"``).
Storage errors are not faults of the replica: a periodic checkpoint the storage refuses is abandoned
and training goes on (:meth:`Loop.save_or_abandon`); one the job ends with (the last step's, a stop's,
one when the job cannot go on: :meth:`Loop.save_last`) leaves ``unsaved`` set to its line, and the
process exits with :data:`~recover.train.processes.exits.EXIT_UNSAVED`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recover.config import Config
from recover.data.sampler import EvalSampler
from recover.names import Event
from recover.observe import cpu
from recover.recovery.protocol import ResilientStep, StepOutcome
from recover.train.checkpoints.cadence import Cadence
from recover.train.checkpoints.checkpoint import UNSAVED, Checkpointer, abandon, save_failures
from recover.train.replicas.optim import lr_at
from recover.train.replicas.replica import Replica
from recover.train.replicas.steps import Steps  # the committed-step iterator of the library API, the one there is


def _env_threads() -> int:
    """``OMP_NUM_THREADS`` as a positive count (0: unset or not one): a process told how many threads to use
    keeps to it (more OpenMP threads than free cores spin in their barriers, several times the CPU for the
    same work)."""
    try:
        return max(0, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return 0


def configure_torch(cfg: Config, local_procs: int) -> None:
    """Threads per process (``training.threads``, else ``OMP_NUM_THREADS`` where set, as torch itself and torchrun
    read it, else cores / local processes), denormal flushing, and deterministic kernels in deterministic mode
    (:func:`use_deterministic_kernels`).

    Unseen vocabulary rows get ~1e-20 gradients whose squares are subnormal in AdamW's state: on CPUs
    subnormal arithmetic is ~100x slower, so they are flushed to zero (no effect on GPUs).
    Call it before the first matrix multiplication on a GPU (cuBLAS reads its workspace setting then).
    """
    threads = cfg.training.threads or _env_threads() or max(1, (os.cpu_count() or 1) // max(1, local_procs))
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    if cfg.training.deterministic:
        use_deterministic_kernels()


def use_deterministic_kernels() -> None:
    """The same inputs give the same bits on the same hardware and software: ``CUBLAS_WORKSPACE_CONFIG``
    (unless set; cuBLAS reads it when it creates its handle, at the first matrix multiplication) and
    ``torch.use_deterministic_algorithms(True)``, which makes attention's backward and index
    accumulations use deterministic kernels on CUDA, stops inductor from autotuning by on-device
    benchmarks (two processes would pick different kernels), and makes any operation that has no
    deterministic kernel raise instead of differing silently. No effect on CPU arithmetic, which is
    already deterministic for a fixed thread count."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def cpu_record(step_s: float, background_s: float, parts: dict[str, float]) -> dict[str, float]:
    """A step's ``cpu_ms``: the training thread's CPU milliseconds in the whole step and in its parts
    (``compute``, ``reduce``, ``update``), ``own`` (the rest: recover's own work on the training thread) and
    ``background`` (recover's own threads meanwhile: heartbeats, the relay); see :mod:`recover.observe.cpu`."""
    ms = {"step": step_s * 1000, **{k: v * 1000 for k, v in parts.items()}}
    ms["own"] = max(0.0, ms["step"] - sum(v * 1000 for v in parts.values()))
    ms["background"] = background_s * 1000
    return {k: round(v, 3) for k, v in ms.items()}


def step_record(outcome: StepOutcome, dt: float, lr: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of a committed step."""
    record = {"step": outcome.step, "loss": outcome.loss, "microbatches": outcome.microbatches,
              "tokens": outcome.tokens, "time_s": round(dt, 6), "lr": lr, "grad_norm": outcome.grad_norm,
              "tokens_per_s": outcome.tokens / dt, "live_replicas": len(outcome.live),
              "generation": outcome.generation, "computed": outcome.computed, "data_step": outcome.data_step}
    if len(set(outcome.quotas.values())) > 1:
        record["quotas"] = {str(r): q for r, q in outcome.quotas.items()}
    if outcome.stragglers:
        record["stragglers"] = {str(r): s for r, s in outcome.stragglers.items()}
    if outcome.recoveries:
        record["recovery_ms"] = sum(r["regroup_ms"] for r in outcome.recoveries)
        record["failures"] = [r["dead"] for r in outcome.recoveries]
    return record


@dataclass
class Loop:
    """Runs the committed steps of one replica (see the module docstring).

    Args:
        cfg: the job's config.
        step: the step protocol (its ``progress`` says where training stands).
        replica: the replica it trains (validation).
        eval_data: the validation batches.
        checkpointer: saves when the cadence says so (``training.checkpoint_every``).
        write: takes each step's record (with ``total_tokens`` and, when due, ``val_loss``).
        after_step: called with the step after its record (fault injection at ``idle``).
        busy: ``busy("io")`` is a context around validation and checkpoints (the coordinator does not
            judge the progress of a replica inside it: see :mod:`recover.coord.liveness`).
        on_event: called as ``(kind, **fields)``: ``checkpoint`` (step, blocking_s) after each save, for
            the goodput's lost time (:mod:`recover.observe.goodput`); ``checkpoint_interval`` when
            ``"auto"`` chooses a new one; ``checkpoint_abandoned`` and ``checkpoint_unsaved`` (message).
    """

    cfg: Config
    step: ResilientStep
    replica: Replica
    eval_data: EvalSampler
    checkpointer: Checkpointer
    write: Callable[[dict[str, Any]], None]
    after_step: Callable[[int], Any] = lambda step: None
    busy: Callable[[str], AbstractContextManager[Any]] = lambda kind: nullcontext()
    on_event: Callable[..., Any] = lambda kind, **fields: None
    val_loss: float | None = None
    """The last validation loss this replica computed."""
    stopped: bool = False
    """The job stopped on request before ``end`` (a graceful stop was committed)."""
    unsaved: str | None = None
    """The line of a checkpoint the job ends with that the storage refused (:meth:`save_last`)."""
    cadence: Cadence = field(init=False)
    """Which steps are saved (``Cadence.of(cfg)``)."""

    def __post_init__(self) -> None:
        self.cadence = Cadence.of(self.cfg)

    def run(self, end: int) -> None:
        """Trains until ``end`` steps are committed, or until a commit is a stop: then the lowest live
        replica saves a complete checkpoint of it (unless one was due anyway) and ``stopped`` is set."""
        tc, cadence = self.cfg.training, self.cadence
        for committed in Steps(self.step).steps(end):
            t0, c0, b0 = time.perf_counter(), time.thread_time(), cpu.background_s()
            outcome = committed.run()  # plan, compute, reduce, recover, commit, apply, admit
            dt = time.perf_counter() - t0
            record_cpu = cpu_record(time.thread_time() - c0, cpu.background_s() - b0, outcome.cpu)
            cadence.stepped(dt, sum(len(r["dead"]) for r in outcome.recoveries))
            record = step_record(outcome, dt, lr_at(outcome.step, tc))
            record["data_wait_ms"] = round(self.replica.reads.take().wait_s * 1000, 3)  # reads not hidden
            record["total_tokens"] = self.step.progress.tokens
            record["cpu_ms"] = record_cpu
            if outcome.wall:  # the step split into compute and communication (the slow-link rule's measure)
                record["wall_ms"] = {k: round(v * 1000, 3) for k, v in outcome.wall.items()}
            mixture = getattr(self.replica.data, "source_tokens", None)
            if mixture is not None and len(self.cfg.data.sources) > 1:
                record["source_tokens"] = mixture(outcome.step)  # committed steps 0..step, per source
            if self.replica.device.type == "cuda":
                record["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(self.replica.device) / 2**30, 3)
            leader = self.step.me == min(outcome.live)
            if leader and cadence.periodic():
                self.checkpointer.prepare()  # its writer process starts now, ready by the first periodic save
            if leader and tc.eval_due(outcome.step, end):
                t_eval = time.perf_counter()
                with self.busy("io"):
                    self.val_loss = record["val_loss"] = self.evaluate()
                record["eval_s"] = round(time.perf_counter() - t_eval, 6)
            self.write(record)
            due = leader and cadence.due(outcome.step, end)
            final = outcome.stop or outcome.step + 1 == end
            if leader and final and (due or outcome.stop):
                self.on_event(Event.CHECKPOINT_FINAL, step=self.step.progress.step,  # the launcher waits for it
                              timeout_s=tc.checkpoint_timeout_s)
                with self.busy("io"):
                    self.save_last()
            elif due:
                with self.busy("io"):
                    self.save_or_abandon()
                self.choose_interval(outcome.step)
            elif leader and outcome.recoveries and not final:
                self.choose_interval(outcome.step)
            if outcome.stop and self.step.progress.step < end:
                self.stopped = True
                return
            self.after_step(outcome.step)

    def evaluate(self) -> float:
        """Mean validation loss over ``training.eval_batches`` fixed batches (collective in a replica)."""
        return self.replica.evaluate([self.eval_data.batch(i) for i in range(self.cfg.training.eval_batches)])

    def choose_interval(self, step: int) -> None:
        """``"auto"``: Young/Daly's interval from this replica's measurements (its rank 0's, in a replica
        of several ranks: every rank must save alike), logged when it changes."""
        cadence = self.cadence
        if cadence.auto and cadence.save_costs and cadence.set(int(self.replica.agreed(cadence.choose()))):
            self.on_event(Event.CHECKPOINT_INTERVAL, step=step + 1, **cadence.describe())

    def save_or_abandon(self) -> Any:
        """A periodic checkpoint; one the storage cannot take (a full disk, an I/O error) is abandoned with
        one line and an event, and training goes on: a storage error is not a fault of this replica."""
        t0 = time.perf_counter()
        try:
            return self.save()
        except save_failures() as exc:
            self._abandoned(exc)
            return None
        finally:  # what training waited for it, saved or not
            self.cadence.saved(self.step.progress.step, time.perf_counter() - t0)

    def save_last(self, root: Path | None = None) -> Path | None:
        """(collective in a replica of several ranks) The blocking checkpoint the job ends with (the last
        step's, a stop's, one when the job cannot go on; under ``root`` instead of the run's own
        checkpoints when given). One the storage cannot take is abandoned: its line (path, free space,
        cause) is printed and logged (``checkpoint_unsaved``), kept in ``unsaved``, and None returned;
        older checkpoints stay. An asynchronous save still in flight that fails is abandoned as a periodic one."""
        self.settle()
        p = self.step.progress
        try:
            if root is None:
                return self.save(blocking=True)
            return Checkpointer(root, self.replica, self.cfg, self.checkpointer.epoch_of).save(
                p.step, p.data_step, p.tokens, blocking=True)
        except save_failures() as exc:
            self.unsaved = abandon(root or self.checkpointer.root, p.step, exc, then=UNSAVED)
            print(f"recover: error: {self.unsaved}", file=sys.stderr, flush=True)
            self.on_event(Event.CHECKPOINT_UNSAVED, step=p.step, message=self.unsaved)
            return None

    def settle(self) -> None:
        """Waits for the asynchronous save in flight, if any; one that failed is abandoned (training may
        go on: it was a periodic one)."""
        try:
            self.checkpointer.wait()
        except save_failures() as exc:
            self._abandoned(exc)

    def _abandoned(self, exc: BaseException) -> None:
        line = abandon(self.checkpointer.root, self.step.progress.step, exc)
        print(f"recover: warning: {line}", file=sys.stderr, flush=True)
        self.on_event(Event.CHECKPOINT_ABANDONED, step=self.step.progress.step, message=line)

    def save(self, blocking: bool | None = None) -> Any:
        """A checkpoint of the committed progress (collective in a replica of several ranks)."""
        p = self.step.progress
        path = self.checkpointer.save(p.step, p.data_step, p.tokens, blocking)
        if path is None:  # the previous save is still being written: this one is not made, nor queued
            writing = self.checkpointer.writing()
            line = (f"checkpoint of step {p.step} skipped: the one of step {writing} is still being written (saves "
                    "take longer than their interval; raise training.checkpoint_every or use faster storage)")
            print(f"recover: warning: {line}", file=sys.stderr, flush=True)
            self.on_event(Event.CHECKPOINT_SKIPPED, step=p.step, writing=writing, message=line)
            return None
        self.on_event(Event.CHECKPOINT, step=p.step, blocking_s=round(self.checkpointer.last_blocking_s, 6))
        return path
