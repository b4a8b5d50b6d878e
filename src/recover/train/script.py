"""A user's script as one replica of a ``recover launch`` job (the launched half of :mod:`recover.api`).

Contract: :class:`Session` does for a script what :class:`~recover.train.worker.ReplicaWorker` does for the
built-in trainer, with the same files and exit statuses: it registers this replica with the coordinator
(as a joiner when the launcher restarted it), forms layer 1's fault-tolerant group, runs the step
protocol over the user's :class:`~recover.train.own.OwnReplica`, calls the fault injections of its
``--fail``/``--hang``/``--corrupt``/``--nan`` specs at the same phase points, writes one record per
committed step into the replica's log (the launcher merges them into ``metrics.jsonl``) and events into
``events.jsonl``. A replica the coordinator fences exits with :data:`~recover.train.exits.EXIT_FENCED`
(the watchdog ends it if its training thread is stuck); quorum loss, divergence and a lost coordinator
end the process with their statuses and one line, never a traceback.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from recover.faults import FaultInjector, hang_on_signal, parse_failure
from recover.names import Fault, Phase
from recover.observe.events import EventLog, JsonlWriter
from recover.recovery.protocol import ResilientStep, StepOutcome
from recover.train.exits import (
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_FENCED,
    EXIT_QUORUM_LOST,
    replica_log_path,
)
from recover.train.loop import step_record


class Session:
    """The launched job of ``job`` (an :class:`recover.api.Job` whose runtime came from ``recover launch``)."""

    def __init__(self, job: Any) -> None:
        from recover.comm import FaultTolerantGroup
        from recover.coord.client import CoordinatorClient

        rt, info = job.runtime, job.runtime.launched
        cfg, out = info["config"], Path(info["out"])
        ft = cfg.fault_tolerance
        self.job, self.replica_id, self.out = job, rt.replica, out
        self.events = EventLog(out / "events.jsonl")
        self.log = JsonlWriter(replica_log_path(out, rt.replica))
        specs = []
        for text in info.get("fail", []):
            spec, _, rank = text.partition("#")
            specs.append(parse_failure(spec, int(rank) if rank else None))
        hang_on_signal()  # the launcher's random hangs: the training thread stops, heartbeats go on
        self.injector = FaultInjector(specs, rt.replica, before_kill=self._before_kill,
                                      corrupt=lambda arithmetic: job.replica.corrupt(),
                                      nan=lambda step, mb: job.replica.poison.add(mb))
        host, _, port = info["coordinator"].rpartition(":")
        token = Path(info["token_file"]).read_text().strip()
        self.client = CoordinatorClient(host, int(port), token, rt.replica,
                                        heartbeat_interval_s=ft.heartbeat_interval_s, fence_exit_s=ft.fence_exit_s,
                                        on_fenced=self._exit_fenced, reconnect_s=ft.coordinator_reconnect_s)
        self.client.committed_step = job.start.step - 1  # a resumed job's checkpoint
        membership = self.client.register(join=bool(info.get("join")))
        group = FaultTolerantGroup.create(self.client, membership, backend=cfg.parallel.backend,
                                          timeout_s=ft.collective_timeout_s, bucket_bytes=int(ft.bucket_mb * 2**20))
        self.protocol = ResilientStep(job.replica, group, self.client, job.M, job.start, ft.min_replicas,
                                      hook=self.hook, on_event=self.event, seed=job.seed, policy=cfg.workload.policy,
                                      fingerprint_every=ft.fingerprint_every, overlap=False)
        joined = bool(info.get("join")) or rt.replica in membership.joined
        if joined:
            self.protocol.join()
        self.event("started", generation=self.protocol.group.generation, members=list(self.protocol.group.members),
                   step=self.protocol.progress.step, joined=joined)

    def hook(self, step: int, phase: str) -> None:
        """Every phase point: progress for the coordinator's hang rule, then the fault injections."""
        self.client.advance()
        self.injector.maybe_fail(step, phase)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.event(kind, replica=self.replica_id, **fields)

    def record(self, outcome: StepOutcome, dt: float) -> None:
        """The committed step's record (``metrics.jsonl`` once merged), then the ``idle`` phase point."""
        lr = float(self.job.replica.optimizer.param_groups[0]["lr"])
        record = step_record(outcome, dt, lr)
        record["total_tokens"] = self.protocol.progress.tokens
        self.log.write({**record, "replica": self.replica_id})
        self.hook(outcome.step, Phase.IDLE)

    def finish(self) -> None:
        """Every step committed: the events, then the group and the connection closed."""
        self.event("finished", step=self.protocol.progress.step, generation=self.protocol.group.generation)
        self.log.close()
        self.protocol.group.close()
        self.client.close()
        yard = self.protocol.group.graveyard
        deadline = time.monotonic() + 10.0  # retired groups released before the interpreter tears down
        while yard.released < yard.parked and time.monotonic() < deadline:
            time.sleep(0.01)

    def fail(self, exc: BaseException) -> None:
        """The job cannot go on for this replica: one line and its exit status (see the module docstring);
        anything else (the user's own error) propagates."""
        from recover.coord.client import CoordinatorLost, Diverged
        from recover.errors import QuorumLost

        self.log.close()
        if isinstance(exc, QuorumLost):
            _exit(EXIT_QUORUM_LOST, f"recover: replica {self.replica_id}: {exc}")
        if isinstance(exc, Diverged) or self.client.diverged is not None:
            _exit(EXIT_DIVERGED, f"recover: replica {self.replica_id}: {self.client.diverged or exc}")
        if isinstance(exc, CoordinatorLost):
            if self.client.gone:
                _exit(EXIT_COORDINATOR_LOST, f"recover: replica {self.replica_id}: {exc}")
            _exit(EXIT_FENCED, f"recover: replica {self.replica_id}: {exc}; stopping (the launcher restarts the "
                               "replica if --rejoin-after is set)")

    def _before_kill(self, spec: Any) -> None:
        if spec.fault in (Fault.CORRUPT, Fault.MISCOMPUTE, Fault.NAN):
            self.event("injected", fault=spec.fault, step=spec.step,
                       **({"microbatch": int(spec.factor)} if spec.fault is Fault.NAN else {}))
        elif spec.kills:
            self.events.event("kill", replica=self.replica_id, rank=0, step=spec.step, phase=spec.phase,
                              fault=spec.fault, pid=os.getpid())

    def _exit_fenced(self, why: str) -> None:
        self.event("fenced_exit", reason=why)
        _exit(EXIT_FENCED, f"recover: replica {self.replica_id}: fenced by the coordinator ({why}); exiting")


def _exit(code: int, line: str) -> None:
    """One line on stderr and the exit status, skipping interpreter teardown (a retired gloo group still held
    by the graveyard's thread would be destroyed mid-shutdown)."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
