"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), visible only once complete.

Layout: ``CKPT_ROOT/step_000010/`` holds the DCP files (model, optimizer, RNG), ``meta.json``
(step, data cursor, model config, tokens; from a :class:`Checkpointer` also the run config and the
tokenizer's record, with a copy of a HuggingFace ``tokenizer.json``: :mod:`recover.train.checkpoints.describe`)
and ``manifest.json`` (size and SHA-256 of every file: :mod:`recover.train.checkpoints.integrity`). It is
written as ``step_000010.partial/`` first; the ``COMMITTED`` marker is written and fsynced last
and the directory renamed into place, so a
checkpoint directory without the marker (a save killed halfway) is never loaded and never
replaces an older complete one. An older complete save of the same step is first renamed aside
(``.replaced``), never deleted in place, so a crash between the renames leaves no torn
``step_*`` directory either.

Contract:
- :func:`save_checkpoint` is called by every rank that holds a shard of the state (with the
  group they share), or by one rank with ``process_group=None`` when every rank holds a full copy.
- :func:`save_checkpoint_async` (one rank, full copy) returns once the state is copied out: into the
  shared buffer of a :class:`~recover.train.checkpoints.writer.Writer`, whose process writes and commits
  it, or, while none is ready, into CPU memory that ``torch.distributed.checkpoint.async_save`` writes
  from a thread of this process, which commits it. Either way the same commit (``meta.json``, fsynced
  marker, rename) runs only after the write succeeded; until then the checkpoint is invisible: a
  process killed during the write leaves only a ``.partial`` directory. :meth:`AsyncSave.wait` blocks
  until it is committed (or raises :class:`CheckpointError` if the write failed); the caller must wait
  before the next save and before the process exits.
- :func:`latest_checkpoint` returns the newest complete checkpoint or None.
- :func:`load_checkpoint` verifies the checkpoint against its manifest, then restores model and
  optimizer in place and returns the metadata; a damaged checkpoint, or one written for another
  model shape, is refused with a :class:`CheckpointError` before anything is loaded (for another
  model: :class:`~recover.errors.IncompatibleCheckpoint`); :func:`load_newest` falls back from a
  damaged one to the next older.
- :func:`save_state` and :func:`load_state` are the same for any model (a user's:
  :mod:`recover.train.checkpoints.own_checkpoint`): the caller's ``meta`` says what model it is, the caller's
  check refuses another.
- After each save the writer deletes complete checkpoints older than the newest ``keep``
  (``training.keep_checkpoints``); :func:`remove_leftovers` deletes what interrupted saves left
  (``.partial``, ``.replaced``): call it only when no save can be in flight (at the start of a run).
- :class:`Checkpointer` is one replica's policy on top: when a save blocks, asynchronous saves in
  flight and the writer process they use (started ahead of the first periodic save by
  :meth:`Checkpointer.prepare`, or by the first save that does not block; ended by
  :meth:`Checkpointer.close`), and resuming from the newest intact checkpoint (a damaged one is named
  in one line and the next older one is tried).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from recover.config import ModelConfig
from recover.errors import CheckpointError
from recover.train.checkpoints.describe import RunDescription, describe_run
from recover.train.checkpoints.integrity import (  # noqa: F401 - the on-disk helpers are part of this module's API
    MARKER,
    begin_save,
    check_compatible,
    checkpoint_path,
    commit_save,
    latest_checkpoint,
    list_checkpoints,
    load_newest,
    read_meta,
    remove_leftovers,
    verify,
    write_manifest,
)
from recover.train.checkpoints.writer import Writer, close_spare, prefork

if TYPE_CHECKING:
    from recover.config import Config

def _state(model: nn.Module, optimizer: torch.optim.Optimizer,
           extra: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The DCP state dict: ``model``, ``optim``, ``rng`` and, when given, ``extra`` (tensors by name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # imported on use: ~1 s

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {"cpu": torch.get_rng_state()}}
    return {**state, "extra": extra} if extra else state


def save_checkpoint(root: str | os.PathLike[str], step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict[str, Any], model_cfg: ModelConfig,
                    process_group: Any = None, is_writer: bool = True, keep: int = 0,
                    files: dict[str, bytes] | None = None) -> Path:
    """Saves the state after ``step`` committed steps; returns the final directory.

    Args:
        meta: JSON-serialisable extras (data cursor, tokens, ...), stored in ``meta.json``.
        files: name -> bytes stored in the checkpoint directory too (before its manifest and marker).
        process_group: the group whose ranks share the state's shards; None saves from this rank alone.
        is_writer: the one rank that writes ``meta.json``, the manifest and the marker, renames the
            directory and deletes older checkpoints beyond ``keep`` (0: none).
    """
    return save_state(root, step, model, optimizer, {"model": dataclasses.asdict(model_cfg), **meta},
                      process_group=process_group, is_writer=is_writer, keep=keep, files=files)


def save_state(root: str | os.PathLike[str], step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               meta: dict[str, Any], process_group: Any = None, is_writer: bool = True, keep: int = 0,
               files: dict[str, bytes] | None = None, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """:func:`save_checkpoint` of any model: ``meta`` is ``meta.json`` whole (but ``step``), which must say
    what model the state is of; ``extra`` tensors are saved beside the model's under ``extra``."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(root, step)
    partial = final.with_name(final.name + ".partial")
    if is_writer:
        begin_save(root, step)
    if process_group is not None:
        torch.distributed.barrier(group=process_group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is intended
        dcp.save(_state(model, optimizer, extra), checkpoint_id=str(partial), process_group=process_group,
                 no_dist=process_group is None)
    if is_writer:  # DCP's save returns on its coordinator (this rank) once every rank's files are written
        commit_save(partial, final, step, meta, keep, files)
    return final


class AsyncSave:
    """A checkpoint being written in the background by :func:`save_checkpoint_async`.

    Attributes:
        step: the checkpoint's step.
        path: its final directory (it exists, complete, only once :meth:`done` is true and no error).
        partial: the directory it is written into.
        blocking_s: seconds the caller was blocked (state dict + staging copy + handing it to the writer).
        committed: resolves to ``path`` once committed, or to the write's or commit's error.
    """

    def __init__(self, step: int, path: Path, partial: Path, blocking_s: float, committed: Future[Path]) -> None:
        self.step, self.path, self.partial, self.blocking_s = step, path, partial, blocking_s
        self.committed = committed

    def done(self) -> bool:
        return self.committed.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Blocks until the checkpoint is committed; returns its path.

        Raises:
            CheckpointError: the background write or commit failed (nothing was committed; older
                checkpoints are untouched).
            TimeoutError: still writing after ``timeout`` seconds (``concurrent.futures.TimeoutError``).
        """
        try:
            return self.committed.result(timeout)
        except futures.TimeoutError:
            raise
        except Exception as exc:
            raise CheckpointError(f"the asynchronous checkpoint of step {self.step} failed while writing "
                                  f"{self.partial} ({type(exc).__name__}: {exc}); it was not committed") from exc


def save_checkpoint_async(root: str | os.PathLike[str], step: int, model: nn.Module,
                          optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                          model_cfg: ModelConfig, keep: int = 0, files: dict[str, bytes] | None = None,
                          writer: Writer | None = None) -> AsyncSave:
    """Like :func:`save_checkpoint` from one rank holding the full state, but the write runs in the background.

    Returns as soon as the state is copied out of the model and optimizer (training may then change them
    freely): into ``writer``'s shared buffer when given and the state allows
    (:mod:`~recover.train.checkpoints.writer`: a process of its own writes and commits it), else into CPU
    memory that ``torch.distributed.checkpoint.async_save`` writes from a thread of this process, which
    commits it. Either way the checkpoint is committed with the same atomic protocol only after the write
    succeeded. Call :meth:`AsyncSave.wait` before the next save and before the process exits: a process
    that dies first leaves only a ``.partial`` directory, never a loadable checkpoint.
    """
    t0 = time.perf_counter()
    final, partial = begin_save(root, step)
    meta = json.loads(json.dumps({"model": dataclasses.asdict(model_cfg), **meta}))  # now's values, not the end's
    state = _state(model, optimizer)
    if writer is not None and writer.takes(state):
        committed = writer.submit(state, partial, final, step, meta, keep, files)
        return AsyncSave(step, final, partial, time.perf_counter() - t0, committed)
    import torch.distributed.checkpoint as dcp

    # DCP's writer thread warns that it saves from one process, which is intended; catch_warnings
    # here would be left before that thread warns, so this one message is silenced for good.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled.*save in a single process",
                            category=UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is intended
        upload = dcp.async_save(state, checkpoint_id=str(partial), no_dist=True)
    in_thread: Future[Path] = Future()

    def finish(fut: Future[Any]) -> None:  # in DCP's writer thread: commit only a successful write
        try:
            fut.result()
            commit_save(partial, final, step, meta, keep, files)
        except BaseException as exc:  # handed to whoever waits
            in_thread.set_exception(exc)
        else:
            in_thread.set_result(final)

    upload.add_done_callback(finish)
    return AsyncSave(step, final, partial, time.perf_counter() - t0, in_thread)


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    model_cfg: ModelConfig, process_group: Any = None) -> dict[str, Any]:
    """Restores model, optimizer and RNG from a complete checkpoint; returns its ``meta.json``."""
    return load_state(path, model, optimizer, lambda meta, p: check_compatible(meta, model_cfg, p), process_group)


def load_state(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
               check: Callable[[dict[str, Any], Path], None], process_group: Any = None,
               extra: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """:func:`load_checkpoint` of any model: ``check(meta, path)`` raises :class:`IncompatibleCheckpoint`
    when the checkpoint does not fit, before anything is read; ``extra`` tensors (as saved by
    :func:`save_state`) are loaded in place. Returns ``meta.json``.

    Raises:
        CheckpointError: incomplete, damaged (its manifest) or unreadable; IncompatibleCheckpoint: ``check``'s.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    meta = read_meta(path)
    check(meta, path)
    verify(path)  # never load bytes that changed after the save
    state = _state(model, optimizer, extra)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), process_group=process_group,
                     no_dist=process_group is None)
    except Exception as exc:  # DCP raises a variety of errors on damaged files
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); it is damaged") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["cpu"])
    return meta


def save_failures() -> tuple[type[BaseException], ...]:
    """What a failed save raises: the storage's own errors, torch.save's writer errors (a full disk shows
    as "unexpected pos" or "file write failed", its errno lost) and DCP's per-rank wrapper (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return OSError, RuntimeError, CheckpointError, CheckpointException


GOES_ON = "training goes on, older checkpoints are kept"
"""What follows an abandoned periodic checkpoint (:func:`abandon`'s default ``then``)."""
UNSAVED = ("the job's final state is NOT saved; the committed steps stay recorded and older checkpoints are kept "
           "(--resume continues from the newest)")
"""What follows an abandoned checkpoint the job ends with (at the end, a stop, too few replicas, the
coordinator lost): the process exits with :data:`~recover.train.processes.exits.EXIT_UNSAVED`. :func:`abandon`
says instead that there is none to resume from when no complete checkpoint is left."""
UNSAVED_NONE = ("the job's final state is NOT saved and no older checkpoint exists; the committed steps stay "
                "recorded (a new run starts from step 0)")


def abandon(root: str | os.PathLike[str], step: int, exc: BaseException, then: str = GOES_ON) -> str:
    """Removes what failed saves wrote (every ``.partial`` directory: after a failed save none is in flight,
    and an asynchronous one that failed earlier, reported now, left one too; complete checkpoints and
    ``.replaced`` ones stay) and returns one line naming the path of ``step``'s, the free space and the
    cause, ending with ``then`` (:data:`GOES_ON` or :data:`UNSAVED`)."""
    final = Path(root) / f"step_{step:06d}"
    full = _free_bytes(root) < FULL_BYTES  # before the partial files go: what the save met
    for partial in Path(root).glob("step_*.partial"):
        shutil.rmtree(partial, ignore_errors=True)
    free = _free_bytes(root)
    free_text = f"{free / 2**20:,.1f} MiB free" if free != math.inf else "free space unknown"
    failures = getattr(exc, "failures", None)  # DCP's wrapper: rank -> (exception, traceback)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    cause = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    what = f"{type(exc).__name__}{': ' + cause if cause else ''}"
    if full and not (isinstance(exc, OSError) and exc.errno):  # torch's zip writer loses the errno
        what = f"ENOSPC: no space left on device (torch's writer said {what})"
    if then == UNSAVED and not list_checkpoints(root):
        then = UNSAVED_NONE
    return f"checkpoint of step {step} abandoned: could not write {final} ({free_text}; {what}); {then}"


FULL_BYTES = 1 << 20
"""Below this much free space a save that failed without an errno (torch's zip writer: "unexpected pos",
"file write failed") is named as what it is, ENOSPC."""


def _free_bytes(root: str | os.PathLike[str]) -> float:
    """Free bytes for this user on ``root``'s file system (inf when the system does not say)."""
    try:
        return float(shutil.disk_usage(root).free)
    except OSError:
        return math.inf


class Saved(Protocol):
    """What a :class:`Checkpointer` saves and resumes: one replica's model and optimizer, and how its ranks
    share them (the built-in :class:`~recover.train.replicas.replica.Replica` is one). Declared here, so that
    checkpoints do not import the replica they save."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def group(self) -> Any:
        """The process group the replica's ranks share its state's shards over; None: one process."""

    @property
    def is_writer(self) -> bool:
        """The rank that writes the metadata, the manifest and the marker."""


def prefork_writer(cfg: Config) -> bool:
    """At the start of a one-process replica that saves periodically with ``training.checkpoint_async``, before
    it starts a thread: forks the writer process its saves will use (:func:`~recover.train.checkpoints.writer.
    prefork`), so that none is started as a new interpreter at the first save. Returns whether one was forked."""
    tc = cfg.training
    if not (tc.checkpoint_async and tc.checkpoint_every != 0 and cfg.parallel.procs_per_replica == 1):
        return False
    return prefork()


class Checkpointer:
    """Saves and resumes one replica's state under ``root``.

    A one-process replica saves from this process alone (asynchronously with
    ``training.checkpoint_async``); a replica of several ranks saves its shards together over its
    group, collectively (every rank calls :meth:`save`; its rank 0 writes the metadata).

    Args:
        root: the run's checkpoint directory.
        replica: whose model and optimizer are saved (``model``, ``optimizer``, ``group``, ``is_writer``).
        cfg: the job's config (model shape check, seed, ``training.checkpoint_async``, ``training.steps``).
        epoch_of: the data epoch of a step (recorded with the data cursor).
    """

    def __init__(self, root: str | os.PathLike[str], replica: Saved, cfg: Config,
                 epoch_of: Callable[[int], float] = lambda step: 0) -> None:
        self.root, self.replica, self.cfg, self.epoch_of = Path(root), replica, cfg, epoch_of
        self._pending: AsyncSave | None = None
        self._writer: Writer | None = None
        self._description: RunDescription | None = None
        self.last_blocking_s = 0.0
        """Seconds the last :meth:`save` blocked training (with an asynchronous save: staging only)."""

    def writing(self) -> int | None:
        """The step of the asynchronous save still being written, None when none is."""
        pending = self._pending
        return pending.step if pending is not None and not pending.done() else None

    def save(self, step: int, data_step: int, total_tokens: int, blocking: bool | None = None) -> Path | None:
        """Checkpoint after ``step`` committed steps.

        An asynchronous save returns once the state is staged in CPU memory; it becomes loadable only
        when complete. At most one is in flight: a periodic asynchronous save due while the previous one
        is still being written is not made (None: the caller reports it, the saves are slower than their
        interval), never queued behind it. Every other save first waits for the previous asynchronous one
        (and raises its error, if any). A save blocks until committed when ``blocking`` is true, or, by
        default, at the end of training (``step >= training.steps``) and when made while an exception is
        being handled (a stop, such as a lost quorum, after which the process exits).
        """
        t0 = time.perf_counter()
        r, tc = self.replica, self.cfg.training
        if blocking is None:
            blocking = step >= tc.steps or sys.exc_info()[0] is not None
        if not blocking and tc.checkpoint_async and r.group is None and self.writing() is not None:
            self.last_blocking_s = 0.0
            return None
        self.wait()
        if self._description is None:  # the run config and tokenizer every checkpoint carries
            self._description = describe_run(self.cfg)
        meta = {"total_tokens": total_tokens, "seed": tc.seed,
                "data_cursor": {"step": data_step, "epoch": self.epoch_of(data_step)}, **self._description.meta}
        files = self._description.files
        if tc.checkpoint_async and r.group is None and not (blocking and self._writer is None):
            if self._writer is None:  # made by the first save that does not block (or prepare): a job that
                self._writer = Writer()  # never makes one starts no process
            self._pending = save_checkpoint_async(self.root, step, r.model, r.optimizer, meta, self.cfg.model,
                                                  tc.keep_checkpoints, files, self._writer)
            path = self._pending.path
            if blocking:
                self.wait()
        else:
            path = save_checkpoint(self.root, step, r.model, r.optimizer, meta, self.cfg.model,
                                   process_group=r.group, is_writer=r.is_writer, keep=tc.keep_checkpoints,
                                   files=files)
        self.last_blocking_s = time.perf_counter() - t0
        return path

    def wait(self) -> Path | None:
        """Waits until the asynchronous save in flight (if any) is committed; returns its path.

        Raises:
            CheckpointError: its background write failed (nothing of it was committed).
        """
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def prepare(self) -> None:
        """Starts the writer process asynchronous saves use, where they use one (a one-process replica with
        ``training.checkpoint_async``), so that it is ready by the first; returns at once (idempotent)."""
        if self.cfg.training.checkpoint_async and self.replica.group is None:
            if self._writer is None:
                self._writer = Writer()
            self._writer.start()

    def close(self) -> None:
        """Ends the writer process, if one was started (after the save it is writing: call :meth:`wait` first
        to know how that ended)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        close_spare()

    def resume(self) -> tuple[Path, dict[str, int]]:
        """Loads the newest intact checkpoint into the replica; returns its path and the counters
        ``step``, ``data_step``, ``total_tokens``. A damaged one (a file changed, truncated or missing
        since the save, or unreadable) is named in one line on stderr and the next older one is tried.

        Raises:
            CheckpointError: there is none, none is intact, or they do not fit this model.
        """
        r = self.replica
        found = load_newest(self.root, lambda path: load_checkpoint(path, r.model, r.optimizer, self.cfg.model,
                                                                    process_group=r.group),
                            "--resume", "run without --resume to start afresh")
        if found is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.root}; "
                                  "run without --resume to start afresh")
        path, meta = found
        step = int(meta["step"])
        tokens_per_step = (self.cfg.training.global_microbatches * self.cfg.data.microbatch_size
                           * self.cfg.data.seq_len)
        return path, {"step": step, "data_step": int(meta.get("data_cursor", {}).get("step", step)),
                      "total_tokens": int(meta.get("total_tokens", step * tokens_per_step))}
