"""A user's script as one replica of a ``recover launch`` job (the launched half of :mod:`recover.api`).

Contract: :func:`connect` joins the script's :class:`~recover.api.Job` to its launched job through the
:class:`~recover.train.processes.session.Session` the built-in worker uses, so a script has the same
coordinator, fault injections (``--fail``/``--hang``/``--slow``/``--corrupt``/``--nan``, the
launcher's random faults), step records, events, graceful stop on SIGTERM/SIGINT and exit statuses
(:mod:`recover.train.processes.exits`) as a built-in replica; :func:`end` is the end of its ``steps()``:
:func:`fail` the end of a job the replica cannot go on in (its line, its saves and its status: the
process exits; the user's own errors propagate).

An exception the script does not catch (the user's own, or a :class:`~recover.errors.ContractError`)
ends the process through :class:`ScriptErrors`, installed by :func:`recover.api.init` in a launched
script: the traceback goes to the replica's log as Python prints it, a ``script_error`` event names the
replica, rank, step, the exception's type, place (the innermost frame: file and line) and message, and its
last lines (the launcher shows them with the log's path). The first time in a launch it is the loss of
this replica (:data:`EXIT_RAISED`: the others recover in-step and ``--rejoin-after`` brings it back); the
same type at the same place raised again, by this replica or another, at the same or a later step (an
earlier ``script_error`` since the launch's ``launch`` event), or a broken contract, is a bug and not a
fault: :data:`EXIT_SCRIPT_ERROR`, which ends the job (the launcher stops the other replicas, whose leader
saves the committed state at the next commit; a replica that is the last member saves it itself).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from recover.coord.client import CoordinatorLost
from recover.errors import ContractError, StateLost
from recover.names import Event, Phase
from recover.observe.events import EventLog, read_jsonl
from recover.recovery.protocol import ResilientStep, StepOutcome
from recover.train.processes.exits import EXIT_RAISED, EXIT_SCRIPT_ERROR, EXIT_STOPPED
from recover.train.processes.loop import step_record
from recover.train.processes.process import Launched, exit_process
from recover.train.processes.session import Save, Session

SETTLE_S = 10.0
"""How long the end of a script waits for its retired groups' release (those a parked thread holds are skipped)."""


def connect(job: Any) -> tuple[Session, ResilientStep]:
    """The launched session of ``job`` (a Job whose runtime came from ``recover launch``) and its step protocol."""
    rt, info = job.runtime, job.runtime.launched
    launched = Launched.from_env(info)
    session = Session.of(launched, info["config"], rank=rt.rank, ranks=rt.ranks, start=job.start,
                         restore=lambda: restore(job, launched.out))
    session.stop_on_signals()
    try:
        return session, session.connect(job.replica, job.M, seed=job.seed, overlap=False)
    except CoordinatorLost as exc:
        if session.client is None or not session.client.stopping:
            raise
        print(f"recover: replica {rt.replica}: {exc}", file=sys.stderr, flush=True)  # e.g. nothing left to join
        exit_process(0 if session.client.finished else EXIT_STOPPED)
    except StateLost as exc:  # admitted where nobody holds the state, and no checkpoint to restore
        fail(session, exc)
        raise


def restore(job: Any, out: Path) -> Any:
    """Every replica holding the state was lost: the newest intact checkpoint of ``job.save()`` in the run,
    loaded into the job's replica (None: there is none, or every one is damaged or of another model)."""
    from recover.errors import CheckpointError
    from recover.train.checkpoints import own_checkpoint
    from recover.train.checkpoints.integrity import list_checkpoints

    root = own_checkpoint.checkpoints_of(out)
    try:
        return own_checkpoint.resume(root, job.replica, clean=False) if list_checkpoints(root) else None
    except CheckpointError:  # each damaged one was named on stderr
        return None


def record(session: Session, job: Any, outcome: StepOutcome, dt: float) -> None:
    """The committed step's record (``metrics.jsonl`` once merged, with the script's own metrics under ``user`` and
    its evaluation's ``val_loss``), then the ``idle`` phase point."""
    rec = step_record(outcome, dt, job.replica.applied_lr)
    rec["total_tokens"] = session.step.progress.tokens
    rec["data_wait_ms"] = round(job.reads.take().wait_s * 1000, 3)
    rec.update(job.record_fields())  # job.log's metrics, an evaluation's val_loss
    session.write(rec)
    session.hook(outcome.step, Phase.IDLE)


def end(session: Session, stopped: bool, save: Save | None = None) -> None:
    """Every step committed, a committed stop (the leader saves first, when it can; then the process exits
    with its status, through ``SystemExit`` so the script's own cleanup runs), or this replica's leave
    (nothing saved, status 0). The script's remaining code and its exit handlers run; the interpreter's
    teardown does not (:func:`skip_teardown`)."""
    stopped = stopped and not session.client.left
    saved = save(None) if stopped and save is not None and session.leader else None
    code = session.close(stopped, saved)
    session.step.group.graveyard.settle(SETTLE_S)  # retired groups released before the interpreter tears down
    _ENDED[0] = code  # the process ends with it once the script's own code has run (no teardown)
    if code:
        raise SystemExit(code)


_ENDED: list[int | None] = [None]
"""The status :func:`end` chose, once it ran; a later ``sys.exit(n)`` of the script replaces it."""


def skip_teardown() -> None:
    """Registered first at :func:`recover.api.init` of a launched script, so that it runs last of the exit
    handlers: once :func:`end` has run, the process ends with its status (or the script's later ``sys.exit``'s)
    without the interpreter's teardown, which can destroy a gloo group or a thread still held by a daemon
    thread mid-shutdown (``std::terminate``: SIGABRT, status 134, after a run that trained to its end; seen
    after a replica joined). A ``raise SystemExit(n)`` of the script's own is not seen: use ``sys.exit(n)``."""
    import atexit

    real_exit = sys.exit

    def recorded_exit(status: object = None) -> None:
        if _ENDED[0] is not None:
            _ENDED[0] = status if isinstance(status, int) else (0 if status is None else 1)
        real_exit(status)

    def at_exit() -> None:
        if _ENDED[0] is not None:
            exit_process(_ENDED[0])

    sys.exit = recorded_exit
    atexit.register(at_exit)


def fail(session: Session, exc: BaseException, save: Save | None = None) -> None:
    """The job cannot go on for this replica: its line, saves and exit status (the process ends here,
    skipping interpreter teardown: a retired gloo group still held by the graveyard's thread would be
    destroyed mid-shutdown); any other exception (the user's own error) returns, to propagate."""
    code = session.status(exc, save)
    if code is not None:
        exit_process(code)


LAST_LINES = 6
"""How many of the traceback's last lines the ``script_error`` event carries (the log holds all of them)."""


class ScriptErrors:
    """The end of a launched script by an exception it did not catch (see the module docstring): installed as
    ``sys.excepthook`` (the main thread's uncaught exceptions). ``job``: the script's Job once it has one."""

    def __init__(self, out: Path, replica: int, rank: int = 0) -> None:
        self.out, self.replica, self.rank = Path(out), replica, rank
        self.job: Any = None
        self.previous = sys.excepthook

    def install(self) -> ScriptErrors:
        self.previous, sys.excepthook = sys.excepthook, self.hook
        return self

    def hook(self, etype: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        self.previous(etype, exc, tb)  # the whole traceback into the replica's log
        if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: Python's own end
            return
        try:
            code = self.report(exc, tb)
        except Exception as inner:  # reporting must not hide the user's error
            print(f"recover: replica {self.replica}: the script's exception could not be reported: {inner}",
                  file=sys.stderr)
            code = EXIT_RAISED
        exit_process(code)

    def report(self, exc: Exception, tb: TracebackType | None) -> int:
        """Logs the ``script_error`` event, saves when this is the job's end and this replica is its last
        member; returns the exit status."""
        frames = traceback.extract_tb(tb)
        place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        lines = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip().splitlines()[-LAST_LINES:]
        kind = type(exc).__qualname__
        events = self.out / "events.jsonl"
        step = self._step()
        recurring = isinstance(exc, ContractError) or (kind, place) in raised_since_launch(events, self.replica,
                                                                                          self.rank, step)
        with EventLog(events) as log:
            log.event(Event.SCRIPT_ERROR, replica=self.replica, rank=self.rank, step=step, type=kind, place=place,
                      message=str(exc)[:2000], lines=lines, recurring=recurring, pid=os.getpid())
            if recurring:
                saved = self._save_if_last()
                if saved is not None:
                    log.event(Event.SCRIPT_ERROR_STOP, replica=self.replica, step=step, checkpoint=str(saved))
        return EXIT_SCRIPT_ERROR if recurring else EXIT_RAISED

    def _step(self) -> int | None:
        protocol = getattr(self.job, "protocol", None)
        return protocol.progress.step if protocol is not None else None

    def _save_if_last(self) -> Path | None:
        """A checkpoint of the committed state when this replica (of one rank) is the job's last live member:
        nobody else holds the state to save it at a stop. Its parameters are the committed ones (an exception
        in the loop comes before the step's update)."""
        job = self.job
        session = getattr(job, "_session", None)
        if session is None or session.step is None or job.runtime.ranks > 1:
            return None
        if list(session.step.group.members) != [session.step.me]:
            return None
        try:
            return job._write(None)
        except Exception as exc:
            print(f"recover: replica {self.replica}: the committed state could not be saved: {exc}", file=sys.stderr)
            return None


def raised_since_launch(events: Path, replica: int, rank: int, step: int | None) -> set[tuple[str, str]]:
    """The (type, place) of every ``script_error`` in ``events`` since its last ``launch`` event, except those of
    another rank of ``replica`` at ``step`` (the same occurrence, met by each rank of the replica)."""
    seen: set[tuple[str, str]] = set()
    if not events.is_file():
        return seen
    for rec in read_jsonl(events):
        if rec.get("kind") == Event.LAUNCH:
            seen.clear()
        elif rec.get("kind") == Event.SCRIPT_ERROR and not (
                rec.get("replica") == replica and rec.get("rank") != rank and rec.get("step") == step):
            seen.add((str(rec.get("type")), str(rec.get("place"))))
    return seen
