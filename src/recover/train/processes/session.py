"""One replica's membership of a launched job: the part every kind of replica shares.

A replica of ``recover launch`` is either the built-in trainer (``recover worker``,
:mod:`recover.train.processes.worker`) or a user's script on :mod:`recover.api`. Both run through one
:class:`Session`, so both get the same coordinator, fault injections, files and exit statuses:

    session = Session(cfg, out, replica_id, host, port, token, failures, join=..., rank=k, ranks=P)
    step = session.connect(replica, M, ...)     # register, this generation's group, the step protocol
    ... committed steps (session.hook at every phase point, session.write(record) after each) ...
    return session.close(stopped)              # or session.status(exc, save) when the job cannot go on

Contract:
- :meth:`connect` registers this rank with the coordinator (through the replica's relay in rank 0 when
  the replica has several ranks and ``fault_tolerance.connections`` is ``replica``), forms layer 1's
  fault-tolerant group (rank k of a multi-rank replica: *lane* k, rank k of every live replica) and
  builds the step protocol over ``replica``. A replica the launcher restarted (``join``), or one that
  registers after the job began, joins: it takes the live replicas' state at a step boundary.
- :meth:`hook` is every phase point: progress for the coordinator's hang rule, then the fault injections
  (:class:`~recover.faults.Perturbation`, built from this replica's specs and installed on the replica
  and the coordinator client: the only way a fault of any kind reaches them).
- Records go to the replica's log (rank 0 only; the launcher merges them into ``metrics.jsonl``) and
  to the dashboards ``observe`` asks for (:mod:`recover.observe.sinks`: ``tensorboard/replica_R/``,
  a W&B run), events to ``events.jsonl``.
- SIGTERM (:meth:`request_stop`): a graceful leave (a preempted node): the next vote asks to leave,
  and at its commit this replica leaves the job (it computed its share of that step; the others
  train on in the next generation, with no failure round and nothing recomputed); it saves nothing
  and :meth:`close` ends with 0. SIGINT (Ctrl-C; the launcher's graceful stop): the next vote asks
  for a stop of the whole job. A process not yet training exits at once: 0 on SIGTERM,
  :data:`EXIT_STOPPED` on SIGINT.
- :meth:`status` maps the end of a job this replica cannot go on in to its exit status, with one line
  and the saves the worker's docstring lists (quorum lost, coordinator lost: the lowest member saves the
  committed state; divergence: each side's lowest replica saves its side; non-finite: the last
  committed state; a token id beyond the vocabulary (:class:`~recover.errors.DataError`, the same on every
  replica): its line, the committed state saved by the lowest member that meets it, :data:`EXIT_BAD_DATA`);
  a fenced replica whose training thread is stuck is ended by the watchdog
  (:meth:`exit_fenced`). A replica cut off from the coordinator (its client's read deadline,
  :mod:`recover.coord.deadline`) leaves like a fenced one, with one line; so does one whose
  training thread meets a torch.distributed network error (:data:`NETWORK_ERRORS`, a store or peer
  out of reach) while its client finds the coordinator lost; a coordinator silent beyond
  ``fault_tolerance.coordinator_reconnect_s`` (paused) is lost like one that did not come back.
- Total loss: when every replica that held the state was lost, the members of the next generation load
  the newest complete checkpoint through ``restore`` (the job goes on from its step); with none there
  (:class:`~recover.errors.StateLost`) each exits with its line and :data:`EXIT_STATE_LOST`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError

from recover.baselines import JobFailed
from recover.config import Config
from recover.coord.client import CoordinatorLost, Diverged
from recover.errors import DataError, QuorumLost, StateLost
from recover.faults import FailureSpec, Perturbation
from recover.lifeline import ENV as LAUNCHER_ENV
from recover.names import Baseline, Event
from recover.observe.events import EventLog, JsonlWriter
from recover.observe.rundir import CUT_OFF_DIR
from recover.observe.sinks import StepSinks
from recover.recovery.protocol import Progress, ResilientStep
from recover.train.processes.exits import (
    EXIT_BAD_DATA,
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_FENCED,
    EXIT_JOB_FAILED,
    EXIT_NONFINITE,
    EXIT_QUORUM_LOST,
    EXIT_STATE_LOST,
    EXIT_STOPPED,
    replica_log_path,
)
from recover.train.processes.process import Launched, build_step, exit_process

NETWORK_ERRORS = (DistNetworkError, DistStoreError)
"""torch.distributed's errors of a path that broke (a store or peer that cannot be reached): the end
of a replica cut off from the coordinator's host, when its coordinator client finds it so."""

Save = Callable[[Path | None], Any]
"""``save(root)``: a complete checkpoint of the committed state (``root`` None: the run's own
``checkpoints/``); returns where it went (None if the replica cannot save)."""

Restore = Callable[[], Progress | None]
"""``restore()``: loads the newest complete checkpoint of the run into the replica and returns its counters
(None: there is none)."""


class Session:
    """Rank ``rank`` of replica ``replica_id`` in the job whose coordinator listens at ``host:port``."""

    def __init__(self, cfg: Config, out: str | os.PathLike[str], replica_id: int, host: str, port: int, token: str,
                 failures: list[FailureSpec] = (), *, join: bool = False, rank: int = 0, ranks: int = 1,
                 start: Progress | None = None, baseline: Baseline | str | None = None,
                 restore: Restore | None = None, tls: Any = None) -> None:
        self.cfg, self.out, self.replica_id = cfg, Path(out), replica_id
        self.host, self.port, self.token, self.join = host, port, token, join
        self.rank, self.ranks = rank, ranks
        self.start = start or Progress()
        self.baseline = Baseline(baseline) if baseline else None
        self.failures = list(failures)
        self.restore = restore
        self.tls = tls  # a recover.coord.tls.Tls: the coordinator wire over TLS (None: plain TCP)
        self.events = EventLog(self.out / "events.jsonl")
        self.log = JsonlWriter(replica_log_path(self.out, replica_id)) if rank == 0 else None
        self.sinks = StepSinks.open(cfg, self.out, f"replica_{replica_id}") if rank == 0 else None
        self.client: Any = None  # the coordinator client, once connected
        self.relay: Any = None  # rank 0's relay of the replica's coordinator connection, if any
        self.perturbation: Perturbation | None = None
        self.step: ResilientStep | None = None

    @classmethod
    def of(cls, launched: Launched, cfg: Config, *, rank: int = 0, ranks: int = 1, start: Progress | None = None,
           restore: Restore | None = None, baseline: Baseline | str | None = None) -> Session:
        """The session of a replica process the launcher started (:mod:`recover.train.processes.process`)."""
        return cls(cfg, launched.out, launched.replica, launched.host, launched.port, launched.token,
                   list(launched.failures), join=launched.join, rank=rank, ranks=ranks, start=start,
                   baseline=baseline, restore=restore, tls=launched.tls)

    # ---- start ----------------------------------------------------------------------------------
    def connect(self, replica: Any, M: int, **step_kwargs: Any) -> ResilientStep:
        """Registers with the coordinator, forms the group and builds the step protocol over ``replica``
        (``step_kwargs`` go to it: ``assignment``, ``audit_every``, ``overlap``)."""
        from recover.comm import FaultTolerantGroup
        from recover.comm.netaddr import bind_gloo_towards
        from recover.coord.client import CoordinatorClient

        ft = self.cfg.fault_tolerance
        self.perturbation = replica.perturb = Perturbation(
            self.failures, self.replica_id, self.rank, self.ranks, target=replica,
            record=lambda spec, kind, fields: self.event(kind, **fields, spec=spec.label))
        host, port = self._coordinator_address()
        bind_gloo_towards(host)  # the generations' groups span hosts: bind what reaches the coordinator
        self.client = client = CoordinatorClient(
            host, port, self.token, self.replica_id, heartbeat_interval_s=ft.heartbeat_interval_s, rank=self.rank,
            ranks=self.ranks, fence_exit_s=ft.fence_exit_s, on_fenced=self.exit_fenced,
            reconnect_s=ft.coordinator_reconnect_s,
            on_reconnected=lambda s: self.event(Event.COORDINATOR_RECONNECTED, outage_ms=round(s * 1000, 1)),
            tls=self.tls)
        client.committed_step = self.start.step - 1
        client.perturb = self.perturbation
        membership = client.register(join=self.join)
        group = FaultTolerantGroup.create(client, membership, backend=self.cfg.parallel.backend,
                                          timeout_s=ft.collective_timeout_s, bucket_bytes=int(ft.bucket_mb * 2**20))
        step_kwargs.setdefault("restore", self.restore)
        self.step = step = build_step(replica, group, client, M, self.start, self.cfg, baseline=self.baseline,
                                      hook=self.hook, on_event=self.event, **step_kwargs)
        # admitted as a joiner: --join, or started after the job began (a restarted pod or srun step)
        self.join = self.join or self.replica_id in membership.joined
        if self.join:
            step.join()
        self.event(Event.STARTED, generation=step.group.generation, members=list(step.group.members),
                   step=step.progress.step, joined=self.join)
        return step

    def _coordinator_address(self) -> tuple[str, int]:
        """Where this rank's client connects: the coordinator, or its replica's relay (one connection per
        replica, ``fault_tolerance.connections = "replica"``): rank 0 starts it and publishes its address
        in the replica's own store, the other ranks read it there."""
        if self.ranks == 1 or self.cfg.fault_tolerance.connections != "replica":
            return self.host, self.port
        from torch.distributed.distributed_c10d import _get_default_store  # private, no public twin: loud if moved

        from recover.coord.relay import Relay

        store, key = _get_default_store(), f"recover/relay/{self.replica_id}"
        if self.rank == 0:
            try:
                ft = self.cfg.fault_tolerance
                self.relay = Relay(self.host, self.port, self.token, self.replica_id, self.ranks,
                                   ft.heartbeat_interval_s, reconnect_s=ft.coordinator_reconnect_s,
                                   tls=self.tls).start()
            except OSError as exc:
                raise CoordinatorLost(f"replica {self.replica_id}: its relay cannot reach the coordinator at "
                                      f"{self.host}:{self.port}: {exc}") from None
            store.set(key, "{}:{}".format(*self.relay.address))
        host, _, port = store.get(key).decode().rpartition(":")
        return host, int(port)

    def stop_on_signals(self) -> None:
        """SIGTERM (a leave) and SIGINT (a stop) call :meth:`request_stop` (from the main thread only;
        elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: self.request_stop(signum))

    # ---- during the job --------------------------------------------------------------------------
    def hook(self, step: int, phase: str) -> None:
        """Every phase point: progress for the coordinator's hang rule, then the fault injections."""
        self.client.advance()
        if self.perturbation is not None:
            self.perturbation.at_phase(step, phase)

    def event(self, kind: Event, **fields: Any) -> None:
        if self.ranks > 1:
            fields["rank"] = self.rank
        self.events.event(kind, replica=self.replica_id, **fields)

    def write(self, record: dict[str, Any]) -> None:
        """A committed step's record into the replica's log (rank 0)."""
        if self.log is not None:  # "mono": when, on this host's monotonic clock (the launcher's, on its host)
            self.log.write({**record, "replica": self.replica_id, "mono": round(time.monotonic(), 6)})
        if self.sinks is not None:
            self.sinks.step(record)

    @property
    def leader(self) -> bool:
        """Whether this replica is the lowest live one (it validates and saves for the job)."""
        return self.step is not None and self.step.me == min(self.step.group.members)

    def request_stop(self, signum: int) -> None:
        """SIGTERM: leave the job after the next commit; SIGINT: stop it after the next commit (see the
        module docstring). Signal handler."""
        leave = signum == signal.SIGTERM
        if self.client is None or self.client.membership is None:
            print(f"recover: replica {self.replica_id} rank {self.rank}: {'left' if leave else 'stopped'} by "
                  f"signal {signum} before training", file=sys.stderr, flush=True)
            exit_process(0 if leave else EXIT_STOPPED)
        if leave and not self.client.leave_requested:
            self.client.leave_requested = True
            self.event(Event.LEAVE_SIGNAL, signal=signum)
        elif not leave and not self.client.stop_requested:
            self.client.stop_requested = True
            self.event(Event.STOP_SIGNAL, signal=signum)

    # ---- the end ---------------------------------------------------------------------------------
    def close(self, stopped: bool, saved_in: Path | None = None) -> int:
        """Every step committed (or a committed stop, or this replica's leave): the events, then the group,
        the connection and the relay closed; returns the exit status (0, or :data:`EXIT_STOPPED`)."""
        step = self.step
        assert step is not None
        self._close_logs()
        if stopped:
            self.event(Event.STOPPED, step=step.progress.step, generation=step.group.generation)
            if self.rank == 0 and self.leader:
                where = f"; a complete checkpoint is in {saved_in}" if saved_in else ""
                print(f"recover: stopped on request after {step.progress.step} committed steps{where}; continue "
                      "with --resume", file=sys.stderr, flush=True)
        elif self.client.left:
            self.event(Event.LEFT, step=step.progress.step, generation=step.group.generation)
            if self.rank == 0:
                print(f"recover: replica {self.replica_id} left the job after {step.progress.step} committed "
                      "steps (SIGTERM, or `recover drain`); the others train on", file=sys.stderr, flush=True)
        else:
            self.event(Event.FINISHED, step=step.progress.step, generation=step.group.generation)
        step.group.close()
        self.client.close()
        if self.relay is not None:
            self.relay.stop()
        return EXIT_STOPPED if stopped else 0

    def _close_logs(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None

    def status(self, exc: BaseException, save: Save | None) -> int | None:
        """The exit status of an end this replica cannot go on from (see the module docstring), after its
        line and saves; None for any other exception (the caller's own error: it propagates)."""
        self._close_logs()
        client = self.client
        if isinstance(exc, NETWORK_ERRORS) and client is not None and client.settle() is not None:
            exc = CoordinatorLost(f"{client.lost} ({type(exc).__name__} meanwhile)")
        if isinstance(exc, QuorumLost):
            return self._save_and_stop(save, Event.QUORUM_LOST, exc, "resume with more replicas", EXIT_QUORUM_LOST)
        if isinstance(exc, JobFailed):
            return EXIT_JOB_FAILED
        if isinstance(exc, StateLost):
            if self.rank == 0:
                print(f"recover: replica {self.replica_id}: {exc}; start the job afresh, with "
                      "training.checkpoint_every set so that a checkpoint is there to fall back to",
                      file=sys.stderr, flush=True)
            return EXIT_STATE_LOST
        if isinstance(exc, Diverged) or (isinstance(exc, CoordinatorLost) and client.diverged is not None):
            return self._on_divergence(save, exc if isinstance(exc, Diverged) else client.diverged)
        if isinstance(exc, DataError):
            self.event(Event.BAD_DATA, step=self.step.progress.step if self.step else None, message=str(exc))
            if self.rank == 0:
                print(f"recover: replica {self.replica_id}: {exc}", file=sys.stderr, flush=True)
            return self._save_and_stop(save, Event.BAD_DATA_STOP, exc, "fix the data (`recover prepare --verify DIR` "
                                       "finds every bad id) and continue with --resume", EXIT_BAD_DATA)
        if isinstance(exc, CoordinatorLost):
            if client.gone:  # it did not come back
                return self._save_and_stop(save, Event.COORDINATOR_LOST, exc, "continue with --resume",
                                           EXIT_COORDINATOR_LOST)
            if client.cut_off is not None:  # the lowest member keeps the committed state, in case all were cut off
                rescue = self.out / "checkpoints" / CUT_OFF_DIR / f"replica_{self.replica_id}"
                then = ("`recover launch` puts it in place for --resume" if os.environ.get(LAUNCHER_ENV) else
                        f"move it into {self.out / 'checkpoints'} and continue with --resume")
                return self._save_and_stop(save, Event.COORDINATOR_CUT_OFF, exc, "the coordinator has fenced this "
                                           f"replica by now, unless every replica was cut off: then {then}",
                                           EXIT_FENCED, rescue)
            print(f"recover: replica {self.replica_id} rank {self.rank}: {exc}; stopping ({restart_hint()})",
                  file=sys.stderr, flush=True)
            return EXIT_FENCED
        return None

    def _on_divergence(self, save: Save | None, exc: Diverged) -> int:
        """``nonfinite``: the lowest live replica saves the last committed state. ``diverged``: the lowest
        replica of each side saves that side's state under ``checkpoints/diverged/replicas_A-B/`` (never
        over a checkpoint of the run)."""
        print(f"recover: replica {self.replica_id} rank {self.rank}: {exc}", file=sys.stderr, flush=True)
        step, members = self.step, self.client.membership.members
        assert step is not None
        if exc.code == "nonfinite":
            if step.me == min(members) and save is not None:
                path = save(None)
                self.event(Event.NONFINITE_STOP, step=step.progress.step, checkpoint=str(path), message=str(exc))
            return EXIT_NONFINITE
        side = next((sorted(rs) for rs in exc.sides.values() if step.me in rs), [step.me])
        if step.me == side[0] and save is not None:
            path = save(self.out / "checkpoints" / "diverged" / f"replicas_{'-'.join(map(str, side))}")
            self.event(Event.DIVERGED_STOP, step=step.progress.step, checkpoint=str(path), side=side)
        return EXIT_DIVERGED

    def _save_and_stop(self, save: Save | None, kind: Event, exc: Exception, advice: str, status: int,
                       where: Path | None = None) -> int:
        """The job cannot go on (``kind``: ``quorum_lost``, ``coordinator_lost``, ...): the lowest member of the
        last generation saves a complete checkpoint of the committed state (under ``checkpoints/``, or at
        ``where``); returns ``status``."""
        step = self.step
        if step is None or step.me != min(step.group.members):
            if self.rank == 0 and kind is Event.COORDINATOR_CUT_OFF:
                print(f"recover: replica {self.replica_id}: {exc}; stopping ({restart_hint()})", file=sys.stderr,
                      flush=True)
            return status
        path = save(where) if save is not None else None
        self.event(kind, step=step.progress.step, checkpoint=str(path) if path else None, message=str(exc))
        if self.rank == 0:
            saved = f"Saved a complete checkpoint of step {step.progress.step} at {path}; " if path else ""
            print(f"recover: replica {self.replica_id}: {exc}. {saved}{advice}.", file=sys.stderr, flush=True)
        return status

    def exit_fenced(self, why: str) -> None:
        """The watchdog's end of a fenced process whose training thread did not stop by itself (it may be
        stuck in a kernel, a collective inside the replica, or a hang): one line, no traceback."""
        print(f"recover: replica {self.replica_id} rank {self.rank}: fenced by the coordinator ({why}); "
              f"exiting ({restart_hint()})", file=sys.stderr, flush=True)
        self.event(Event.FENCED_EXIT, reason=why)
        sys.stdout.flush()
        os._exit(EXIT_FENCED)


def restart_hint() -> str:
    """How a fenced replica comes back: the launcher's ``--rejoin-after`` when a launcher started this
    process (:mod:`recover.lifeline` marks its environment), else starting it again by hand."""
    if os.environ.get(LAUNCHER_ENV):
        return "the launcher restarts the replica if --rejoin-after is set"
    return "start the replica again (`recover worker ... --join`) to rejoin"
