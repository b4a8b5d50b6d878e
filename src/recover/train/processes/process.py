"""The start of every replica process of a launched job, one path for both kinds: the built-in trainer
(``recover worker``, :mod:`recover.train.processes.worker`) and a user's script on :mod:`recover.api`
(:mod:`recover.train.processes.script`). A feature of the replica process edits this module, not two front doors:

    launched = Launched.from_flags(...)            # recover worker's command line
    launched = Launched.from_env(job)              # a script's environment (recover.names.WORKER_ENV)
    prepare(cfg)                                   # dies with the launcher, the launcher's random hangs, NCCL
    session = Session.of(launched, cfg, rank=..., ranks=..., start=..., restore=...)  # fault specs, coordinator
    step = session.connect(replica, M, ...)        # registration; the step protocol from build_step
    ... committed steps ...
    exit_process(session.close(...))               # or session.status(exc, save): the exits and their saves

Contract:
- :class:`Launched` is what the launcher told this process, whichever way it was told: the run directory,
  the replica id, the coordinator's address and token, this replica's fault injections (``R@STEP:PHASE``,
  ``#RANK`` when ``--fail-rank`` named one), whether it joins a running job or resumes, and TLS; from it
  :meth:`Session.of <recover.train.processes.session.Session.of>` makes the one session (registration, injections,
  records, stops, exit statuses and their saves) every replica process runs through.
- :func:`prepare` is the process set-up both kinds need before torch.distributed or CUDA is used:
  the process dies with the launcher (:mod:`recover.lifeline`), its death is seen by the launcher at once
  (:mod:`recover.deathwatch`; every exit of its own goes through :func:`exit_process` or the interpreter's
  exit, which release the watch), SIGUSR1 stops its training thread (the
  launcher's random hangs), NCCL's environment defaults carry the collective timeout.
- :func:`build_step` builds the step protocol (or a baseline's variant) of any replica from the config, in
  one place: a launched replica (:meth:`Session.connect`), ``recover train`` and a Job run alone.
- :func:`exit_process` ends the process with its status after flushing, skipping the interpreter's
  teardown (a retired gloo group still held by the graveyard's daemon thread would be destroyed
  mid-shutdown: std::terminate).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from recover.errors import RecoverError
from recover.faults import FailureSpec, parse_failure

if TYPE_CHECKING:
    from recover.config import Config
    from recover.recovery.protocol import Progress, ResilientStep


def parse_faults(texts: Iterable[str]) -> tuple[FailureSpec, ...]:
    """This replica's fault specs as the launcher passes them: ``R@STEP:PHASE[=FAULT]``, ``#RANK`` appended when
    ``--fail-rank`` named the rank they hit."""
    specs = []
    for text in texts:
        spec, _, rank = text.partition("#")
        specs.append(parse_failure(spec, int(rank) if rank else None))
    return tuple(specs)


def coordinator_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``. Raises RecoverError."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise RecoverError(f"--coordinator {text!r}: expected HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class Launched:
    """What ``recover launch`` (or a cluster recipe) told this replica process (see the module docstring)."""

    out: Path
    replica: int
    host: str
    port: int
    token: str
    failures: tuple[FailureSpec, ...] = ()
    join: bool = False
    resume: bool = False
    tls: Any = None
    """A :class:`recover.coord.tls.Tls` (None: plain TCP)."""

    @classmethod
    def from_flags(cls, out: str, replica: int, coordinator: str, token_file: str, fails: Iterable[str] = (),
                   join: bool = False, resume: bool = False, tls: Any = None) -> Launched:
        """``recover worker``'s command line."""
        host, port = coordinator_address(coordinator)
        return cls(Path(out), int(replica), host, port, Path(token_file).read_text().strip(), parse_faults(fails),
                   join, resume, tls)

    @classmethod
    def from_env(cls, job: dict[str, Any]) -> Launched:
        """A script's environment (:data:`recover.names.WORKER_ENV`, parsed)."""
        from recover.coord.tls import Tls

        host, port = coordinator_address(job["coordinator"])
        return cls(Path(job["out"]), int(job["replica"]), host, port, Path(job["token_file"]).read_text().strip(),
                   parse_faults(job.get("fail", [])), bool(job.get("join")), bool(job.get("resume")),
                   Tls(**job["tls"]) if job.get("tls") else None)


def prepare(cfg: Config) -> None:
    """The process set-up (see the module docstring)."""
    from recover import deathwatch
    from recover.comm.nccl import apply_env_defaults
    from recover.faults import hang_on_signal
    from recover.lifeline import die_with_launcher

    die_with_launcher()
    deathwatch.hold()  # the launcher sees this process die at once, not when its connections close
    hang_on_signal()
    apply_env_defaults(collective_timeout_s=cfg.fault_tolerance.collective_timeout_s)  # before any NCCL use


def build_step(replica: Any, group: Any, coordinator: Any, M: int, start: Progress | None, cfg: Config | None,
               *, baseline: Any = None, launched: bool = True, **given: Any) -> ResilientStep:
    """The step protocol of a replica (a baseline's variant under ``baseline``), from ``cfg``: its assignment and
    seed; launched, also the quorum, the fingerprint cadence, the workload policy and the first generation's
    size a shrinking baseline divides by. ``given`` (hook, on_event, restore, overlap, audit_every, a Job's own
    seed) overrides. ``cfg`` None: a Job run alone (the protocol's defaults)."""
    from recover.baselines import ShrinkStep, step_class

    kind = step_class(baseline)
    kwargs: dict[str, Any] = {}
    if cfg is not None:
        tc, ft = cfg.training, cfg.fault_tolerance
        kwargs.update(assignment=tc.assignment, seed=tc.seed)
        if launched:
            kwargs.update(min_replicas=ft.min_replicas, fingerprint_every=ft.fingerprint_every,
                          policy=cfg.workload.policy)
        if kind is ShrinkStep:
            kwargs["initial_replicas"] = cfg.parallel.replicas
    kwargs.update(given)
    return kind(replica, group, coordinator, M, start, **kwargs)


def exit_process(code: int) -> NoReturn:
    """Ends the process with ``code`` (see the module docstring), recorded for a wrapper that reads it
    (:func:`~recover.train.processes.exits.record_exit`: torchrun reports every rank's failure as 1)."""
    from recover import deathwatch
    from recover.train.processes.exits import record_exit

    record_exit(code)
    deathwatch.release()  # an end of its own, not a death
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
