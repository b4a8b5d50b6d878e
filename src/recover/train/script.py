"""A user's script as one replica of a ``recover launch`` job (the launched half of :mod:`recover.api`).

Contract: :func:`connect` joins the script's :class:`~recover.api.Job` to its launched job through the
:class:`~recover.train.session.Session` the built-in worker uses, so a script has the same
coordinator, fault injections (``--fail``/``--hang``/``--slow``/``--corrupt``/``--nan``, the
launcher's random faults), step records, events, graceful stop on SIGTERM/SIGINT and exit statuses
(:mod:`recover.train.exits`) as a built-in replica; :func:`end` is the end of its ``steps()``:
:func:`fail` the end of a job the replica cannot go on in (its line, its saves and its status: the
process exits; the user's own errors propagate).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from recover.coord.client import CoordinatorLost
from recover.coord.tls import Tls
from recover.errors import StateLost
from recover.faults import hang_on_signal, parse_failure
from recover.names import Phase
from recover.recovery.protocol import ResilientStep, StepOutcome
from recover.train.exits import EXIT_STOPPED
from recover.train.loop import step_record
from recover.train.session import Save, Session

SETTLE_S = 10.0
"""How long the end of a script waits for its retired groups' release (those a parked thread holds are skipped)."""


def connect(job: Any) -> tuple[Session, ResilientStep]:
    """The launched session of ``job`` (a Job whose runtime came from ``recover launch``) and its step protocol."""
    rt, info = job.runtime, job.runtime.launched
    specs = []
    for text in info.get("fail", []):  # R@STEP:PHASE, with #RANK when the launcher was given --fail-rank
        spec, _, rank = text.partition("#")
        specs.append(parse_failure(spec, int(rank) if rank else None))
    hang_on_signal()  # the launcher's random hangs: the training thread stops, heartbeats go on
    host, _, port = info["coordinator"].rpartition(":")
    token = Path(info["token_file"]).read_text().strip()
    tls = Tls(**info["tls"]) if info.get("tls") else None
    session = Session(info["config"], info["out"], rt.replica, host, int(port), token, specs,
                      join=bool(info.get("join")), rank=rt.rank, ranks=rt.ranks, start=job.start,
                      restore=lambda: restore(job, Path(info["out"])), tls=tls)
    session.stop_on_signals()
    try:
        return session, session.connect(job.replica, job.M, seed=job.seed, overlap=False)
    except CoordinatorLost as exc:
        if session.client is None or not session.client.stopping:
            raise
        print(f"recover: replica {rt.replica}: {exc}", file=sys.stderr, flush=True)  # e.g. nothing left to join
        sys.stdout.flush()
        os._exit(0 if session.client.finished else EXIT_STOPPED)
    except StateLost as exc:  # admitted where nobody holds the state, and no checkpoint to restore
        fail(session, exc)
        raise


def restore(job: Any, out: Path) -> Any:
    """Every replica holding the state was lost: the newest intact checkpoint of ``job.save()`` in the run,
    loaded into the job's replica (None: there is none, or every one is damaged or of another model)."""
    from recover.errors import CheckpointError
    from recover.train import own_checkpoint
    from recover.train.integrity import list_checkpoints

    root = own_checkpoint.checkpoints_of(out)
    try:
        return own_checkpoint.resume(root, job.replica, clean=False) if list_checkpoints(root) else None
    except CheckpointError:  # each damaged one was named on stderr
        return None


def record(session: Session, job: Any, outcome: StepOutcome, dt: float) -> None:
    """The committed step's record (``metrics.jsonl`` once merged), then the ``idle`` phase point."""
    rec = step_record(outcome, dt, float(job.replica.optimizer.param_groups[0]["lr"]))
    rec["total_tokens"] = session.step.progress.tokens
    rec["data_wait_ms"] = round(job.reads.take().wait_s * 1000, 3)
    session.write(rec)
    session.hook(outcome.step, Phase.IDLE)


def end(session: Session, stopped: bool, save: Save | None = None) -> None:
    """Every step committed, a committed stop (the leader saves first, when it can; then the process exits
    with its status, through ``SystemExit`` so the script's own cleanup runs), or this replica's leave
    (nothing saved, status 0)."""
    stopped = stopped and not session.client.left
    saved = save(None) if stopped and save is not None and session.leader else None
    code = session.close(stopped, saved)
    session.step.group.graveyard.settle(SETTLE_S)  # retired groups released before the interpreter tears down
    if code:
        raise SystemExit(code)


def fail(session: Session, exc: BaseException, save: Save | None = None) -> None:
    """The job cannot go on for this replica: its line, saves and exit status (the process ends here,
    skipping interpreter teardown: a retired gloo group still held by the graveyard's thread would be
    destroyed mid-shutdown); any other exception (the user's own error) returns, to propagate."""
    code = session.status(exc, save)
    if code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
