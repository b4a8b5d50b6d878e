"""``recover launch``: one coordinator and N replica processes on this machine, with real failures.

Contract:
- Everything is validated before any process starts (config, failure schedule, flags).
- The coordinator starts first, as its own process (a worker's death never takes it down).
- Replica processes are started in their own sessions and tracked by PID; on exit, error or
  Ctrl-C every process the launcher started is killed by PID, never by name.
- A replica of P = pp x fsdp x tp ranks is P processes given torchrun's environment (RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a port of its own); the launcher acts as
  their torchrun agent: when one rank exits abnormally it SIGKILLs the replica's other ranks at
  once (by PID), and the replica counts as lost if any rank died by SIGKILL or was fenced.
- Every replica the coordinator declares dead (fenced, hung, silent) is gone soon after: its own
  watchdog ends it ``fault_tolerance.fence_exit_s`` after the fence, and one still running a second
  later (frozen, or stuck below Python) is SIGKILLed by the launcher; it then rejoins like a killed
  replica. So the launcher always finishes and writes its summary.
- Failures are real: ``--fail`` specs make a replica SIGKILL itself at (step, phase), ``--hang``
  stop its training thread for good, ``--freeze`` SIGSTOP it for good;
  ``--random-failures MTBF`` makes the launcher SIGKILL a random live replica at exponentially
  distributed times (never below ``min_replicas``). ``--rejoin-after S`` restarts a killed
  replica S seconds later; it joins back at the next step boundary.
- The launcher is the single writer of ``metrics.jsonl``: one record per committed step, merged
  from the replicas' own logs (``replicas/replica_R.jsonl``), plus ``summary.json`` and the plots.
- The coordinator is restarted at once, on the same ports and token, whenever it exits while the job
  runs: the replicas keep their state, reconnect and register again with what they hold, and the new
  coordinator rebuilds the membership from them (:mod:`recover.coord.state`).
- SIGTERM or SIGINT is a graceful stop: the coordinator and every worker are sent SIGTERM, the next
  commit is a stop, the lowest live replica saves a complete checkpoint, and everything exits; after
  ``fault_tolerance.stop_grace_s`` whatever still runs is killed. A second signal kills at once.
  Exit statuses: 0 every step committed, 3 quorum lost, 6 stopped with a checkpoint (continue with
  ``--resume``), 7 the coordinator was lost for good (a checkpoint was saved), 8 the replicas'
  parameters disagree with no majority (each side saved), 9 the training diverged (a microbatch not
  finite on two replicas), 1 otherwise.
- ``resume``: the workers start from the newest complete checkpoint in ``out``; the records of
  ``metrics.jsonl`` before it are kept (it holds each step once).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.config import Config
from recover.faults import FailureSchedule, kind
from recover.launch.placement import Placement
from recover.lifeline import child_env
from recover.names import WORKER_ENV, Baseline
from recover.observe.events import EventLog, JsonlWriter
from recover.observe.progress import ProgressDisplay
from recover.train.exits import (
    EXIT_BAD_DATA,
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_FENCED,
    EXIT_JOB_FAILED,
    EXIT_NONFINITE,
    EXIT_QUORUM_LOST,
    EXIT_STOPPED,
)

POLL_S = 0.05
MAX_COORDINATOR_RESTARTS = 10
JOINER_GRACE_S = 3.0
"""How long joiners left alone after the last committed step get to exit on their own before being stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LaunchOptions:
    config: Config
    config_arg: str
    overrides: list[str]
    out: Path
    failures: FailureSchedule = field(default_factory=FailureSchedule)
    random_mtbf_s: float | None = None
    random_faults: tuple[str, ...] = ("kill",)
    """What each random failure does (drawn uniformly): SIGKILL, a hung training thread (SIGUSR1 to
    the worker) or SIGSTOP."""
    rejoin_after_s: float | None = None
    baseline: Baseline | None = None
    """None (recover) or the baseline run instead (see :class:`recover.names.Baseline`)."""
    rejoin_replicas: frozenset[int] | None = None
    """Which killed replicas rejoin (None: all)."""
    seed: int = 0
    host: str = "127.0.0.1"
    progress: bool = True
    title: str = "launch"
    resume: bool = False
    """Start from the newest complete checkpoint in ``out`` (keeping the step records before it)."""
    placement: Placement = field(default_factory=Placement)
    """The device of every rank (:mod:`recover.launch.placement`)."""
    script: tuple[str, ...] = ()
    """Each replica runs this command (a user's script on :mod:`recover.api`) instead of ``recover worker``;
    it learns its job from :data:`recover.api.WORKER_ENV`. No hot spare is kept for a script."""
    kill_coordinator: str | None = None
    """Fault injection ``STEP[:SENT]``: the first coordinator SIGKILLs itself in step STEP's commit after
    SENT of its replies went out (the launcher then restarts it)."""


def signal_processes(procs: list[subprocess.Popen[bytes]], sig: int) -> None:
    """Sends ``sig`` to each process still running (by PID: each leads its own session)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def kill_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILLs each process still running, then reaps them all."""
    signal_processes(procs, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


LOST = -signal.SIGKILL
"""A replica's exit code when it was lost to a failure (a rank SIGKILLed, or the replica fenced)."""


@dataclass
class Replica:
    """The P processes (ranks) of one replica; rank 0 first."""

    rid: int
    procs: list[subprocess.Popen[bytes]]
    logs: list[Any]
    log_paths: list[Path]
    started: float
    joined: bool
    exit_code: int | None = None
    codes: dict[int, int] = field(default_factory=dict)
    """rank -> exit code, for ranks that ended on their own (not reaped by the launcher)."""

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> int | None:
        """None while the replica runs; else its exit code (:data:`LOST` when a rank was killed or fenced).

        Like a torchrun agent: once any rank ends abnormally, the others are SIGKILLed at once.
        """
        if self.exit_code is not None:
            return self.exit_code
        for k, proc in enumerate(self.procs):
            if k not in self.codes and (code := proc.poll()) is not None:
                self.codes[k] = code
        if not self.codes:
            return None
        bad = [c for c in self.codes.values() if c != 0]
        if bad:
            self.kill()
        elif len(self.codes) < len(self.procs):
            return None  # some ranks finished, the others are finishing
        self.exit_code = LOST if any(c in (-signal.SIGKILL, EXIT_FENCED) for c in bad) else (bad[0] if bad else 0)
        return self.exit_code

    def kill(self) -> None:
        """SIGKILLs every rank still running and reaps it."""
        kill_processes(self.procs)

    def close_logs(self) -> None:
        for log in self.logs:
            log.close()


class Launcher:
    def __init__(self, opts: LaunchOptions) -> None:
        self.o = opts
        self.cfg = opts.config
        self.n = self.cfg.parallel.replicas
        self.out = opts.out
        self.rng = random.Random(opts.seed)
        self.replicas: dict[int, Replica] = {}
        self.rejoin_at: dict[int, float] = {}
        self.P = self.cfg.parallel.procs_per_replica
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.spare: list[tuple[subprocess.Popen[bytes], Any, Path]] | None = None
        self.spares_started = 0
        self.resume = False
        self.restarts = 0
        self.records: dict[int, dict[str, Any]] = {}
        self.offsets: dict[Path, int] = {}
        self.written = -1
        self.kills = 0
        self.active: dict[int, float] = {}
        """replica -> when a step record of it was last seen (it is a training member)."""
        self.fenced_at: dict[int, float] = {}
        """replica -> when the launcher read that the coordinator declared it dead while it ran."""
        self.known_kills: set[int] = set()
        """PIDs whose SIGKILL is accounted for (a ``kill`` event names them, or the launcher reaped them)."""
        self.lost_at: dict[int, float] = {}
        """replica -> when the coordinator last declared it dead (``failure_detected``)."""
        self.stop_signal: int | None = None
        """The signal (SIGTERM, SIGINT) that asked for a graceful stop, once one did."""
        self.stop_started: float | None = None
        self.coordinator_restarts = 0
        self.seen_events: list[dict[str, Any]] = []
        """Every record of ``events.jsonl`` read so far (the live goodput reads them)."""
        self.goodput_at, self.goodput_line = 0.0, None

    # ---- processes -------------------------------------------------------------------------
    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "recover", *args]

    def _new_coordinator_identity(self) -> None:
        """Ports and token of a new job's coordinator (a restarted coordinator keeps them)."""
        self.port, self.store_port = free_port(self.o.host), free_port(self.o.host)
        token_file = self.out / "token"
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
        self.token_file = token_file

    def _start_coordinator(self, expected: int) -> None:
        ft = self.cfg.fault_tolerance
        cmd = self._python("coordinator", "--host", self.o.host, "--port", str(self.port), "--store-port",
                           str(self.store_port), "--token-file", str(self.token_file), "--events",
                           str(self.out / "events.jsonl"), "--replicas", str(expected), "--min-replicas",
                           str(ft.min_replicas), "--heartbeat-interval", str(ft.heartbeat_interval_s),
                           "--heartbeat-timeout", str(ft.heartbeat_timeout_s), "--hang-timeout", str(ft.hang_timeout_s),
                           "--ranks-per-replica", str(self.cfg.parallel.procs_per_replica), "--connections",
                           ft.connections)
        if self.o.kill_coordinator and not self.coordinator_restarts:
            cmd += ["--die-at-commit", self.o.kill_coordinator]
        log = open(self.out / "logs" / "coordinator.log", "ab")  # noqa: SIM115 - lives with the process
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=child_env())
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.coordinator.returncode}; see "
                                   f"{self.out / 'logs' / 'coordinator.log'}")
            try:
                socket.create_connection((self.o.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the coordinator did not start listening within 30 s")

    def _worker_cmd(self) -> list[str]:
        cmd = self._python("worker", "--config", self.o.config_arg, "--out", str(self.out), "--coordinator",
                           f"{self.o.host}:{self.port}", "--token-file", str(self.token_file), "--procs",
                           str(self.n * self.P), *self.o.overrides)
        if self.o.baseline:
            cmd += ["--baseline", Baseline(self.o.baseline).value]
        if self.resume:
            cmd.append("--resume")
        return cmd

    def _fails(self, rid: int) -> list[str]:
        """Failure specs of replica ``rid`` as the worker reads them: ``R@STEP:PHASE[#RANK]``."""
        return [str(spec) if spec.rank is None else f"{spec}#{spec.rank}" for spec in self.o.failures.for_replica(rid)]

    def _env(self, rid: int | None, k: int, port: int | str) -> dict[str, str]:
        """What rank ``k`` of replica ``rid`` gets on top of this environment: torchrun's variables
        (P > 1) and its device (:mod:`recover.launch.placement`; a spare, ``rid`` None, none)."""
        env = self.o.placement.env(rid, k)
        if self.P > 1:
            env.update({"RANK": str(k), "LOCAL_RANK": str(k), "WORLD_SIZE": str(self.P),
                        "LOCAL_WORLD_SIZE": str(self.P), "MASTER_ADDR": self.o.host, "MASTER_PORT": str(port)})
        return env

    def _spawn(self, cmd: list[str], name: str, rid: int | None, stdin: Any = None,
               extra_env: dict[str, str] | None = None) -> list[tuple[subprocess.Popen[bytes], Any, Path]]:
        """The P processes of one replica, each in its own session; P > 1 get torchrun's environment."""
        port = free_port(self.o.host) if self.P > 1 else 0
        out = []
        for k in range(self.P):
            path = self.out / "logs" / (f"{name}.log" if self.P == 1 else f"{name}_rank{k}.log")
            log = open(path, "ab")  # noqa: SIM115 - lives with the process
            proc = subprocess.Popen(cmd, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**child_env(), **self._env(rid, k, port), **(extra_env or {})})
            out.append((proc, log, path))
        return out

    def plan(self) -> list[str]:
        """``--dry-run``: one line per process it would start (replica, rank, device, environment,
        command), starting nothing."""
        self.port, self.token_file = "<port>", self.out / "token"  # type: ignore[assignment]
        lines = [f"coordinator: {' '.join(self._python('coordinator', '--port', '<port>', '...'))}"]
        for rid in range(self.n):
            cmd = " ".join([*self._worker_cmd(), "--replica", str(rid)])
            for k in range(self.P):
                env = " ".join(f"{key}={v}" for key, v in sorted(self._env(rid, k, "<port>").items()))
                lines.append(f"replica {rid} rank {k}: {self.o.placement.device(rid, k)}; env {env or '-'}; {cmd}")
        if self.o.rejoin_after_s is not None:
            lines.append("rejoins: a replica restarts on the devices of the one it replaces"
                         + ("" if self.o.placement.gpus else "; a hot spare waits on the CPU"))
        return lines

    def _start_spare(self) -> None:
        """A hot spare: a replica's workers that have started up (torch, model, data) and wait to be told who to be."""
        if self.o.script:
            return  # a user's script starts as the replica it is told to be
        name = f"spare_{self.spares_started}"
        self.spares_started += 1
        self.spare = self._spawn([*self._worker_cmd(), "--spare"], name, None, stdin=subprocess.PIPE)

    def _start_replica(self, rid: int, join: bool) -> None:
        if join and self.spare is not None and all(p.poll() is None for p, _, _ in self.spare):
            ranks, self.spare = self.spare, None
            order = (json.dumps({"replica": rid, "fail": self._fails(rid)}) + "\n").encode()
            for proc, _, _ in ranks:
                assert proc.stdin is not None
                proc.stdin.write(order)
                proc.stdin.close()
            self._start_spare()
        elif self.o.script:
            job = {"coordinator": f"{self.o.host}:{self.port}", "token_file": str(self.token_file),
                   "out": str(self.out), "replica": rid, "fail": self._fails(rid), "join": join,
                   "resume": self.resume}  # Job(resume=) defaults to this run's checkpoints
            ranks = self._spawn(list(self.o.script), f"replica_{rid}", rid, extra_env={WORKER_ENV: json.dumps(job)})
        else:
            cmd = [*self._worker_cmd(), "--replica", str(rid), *(a for f in self._fails(rid) for a in ("--fail", f))]
            if join:
                cmd.append("--join")
            ranks = self._spawn(cmd, f"replica_{rid}", rid)
        self.replicas[rid] = Replica(rid, [p for p, _, _ in ranks], [lg for _, lg, _ in ranks],
                                     [path for _, _, path in ranks], time.time(), join)
        if join:
            self.events.event("rejoin_started", replica=rid, pid=ranks[0][0].pid, log=ranks[0][2].name)

    def _kill_all(self) -> None:
        procs = [p for r in self.replicas.values() for p in r.procs] + ([self.coordinator] if self.coordinator else [])
        kill_processes(procs + ([p for p, _, _ in self.spare] if self.spare else []))

    # ---- monitoring ------------------------------------------------------------------------
    def _poll_replicas(self, now: float) -> None:
        for rep in self.replicas.values():
            if rep.exit_code is not None:
                continue
            code = rep.poll()
            if code is None:
                continue
            rep.close_logs()
            self._count_external_kill(rep, now)
            self.events.event("replica_exit", replica=rep.rid, code=code, pid=rep.pid,
                              **({"rank_codes": rep.codes} if self.P > 1 else {}))
            unfinished = self.written + 1 < self.cfg.training.steps
            if self.o.baseline == Baseline.RESTART and code in (-signal.SIGKILL, EXIT_JOB_FAILED) and unfinished:
                self._restart()
                return
            wanted = self.o.rejoin_replicas is None or rep.rid in self.o.rejoin_replicas
            if code == -signal.SIGKILL and self.o.rejoin_after_s is not None and unfinished and wanted:
                self.rejoin_at[rep.rid] = now + self.o.rejoin_after_s
        for rid, when in list(self.rejoin_at.items()):
            if not self._live():  # the job ended (or lost everyone): nobody to join
                del self.rejoin_at[rid]
            elif now >= when:
                del self.rejoin_at[rid]
                self._start_replica(rid, join=True)

    def _count_external_kill(self, rep: Replica, now: float) -> None:
        """A rank SIGKILLed by neither the fault injection nor the launcher was killed from outside (an
        operator, the OOM killer, a test): logged as a kill, timed from when the coordinator saw it go."""
        killed = [rep.procs[k].pid for k, c in rep.codes.items() if c == -signal.SIGKILL]
        if killed and not self.known_kills & {p.pid for p in rep.procs}:
            at = self.lost_at.get(rep.rid)
            self.events.event("kill", replica=rep.rid, step=max(self.records, default=-1) + 1, phase="external",
                              pid=killed[0], source="external",
                              at=at if at is not None and at >= rep.started else now)
            self.known_kills.update(killed)

    def _restart(self) -> None:
        """Checkpoint-and-restart: stop everything, relaunch the survivors from the last checkpoint."""
        from recover.train.integrity import list_checkpoints

        deadline = time.time() + 5.0  # survivors notice and exit on their own, as a failed torchrun job does
        while time.time() < deadline and any(p.poll() is None for r in self.replicas.values() for p in r.procs):
            time.sleep(POLL_S)
        survivors = sorted(r.rid for r in self.replicas.values() if r.poll() != LOST)
        self._kill_all()
        for rep in self.replicas.values():
            if rep.exit_code is None:
                rep.poll()
                rep.close_logs()
        self._collect()
        found = list_checkpoints(self.out / "checkpoints")
        resume_step = found[-1][0] if found else 0
        lost = [s for s in self.records if s >= resume_step]
        for s in lost:
            del self.records[s]
        self.written = min(self.written, resume_step - 1)
        self.restarts += 1
        self.events.event("job_restart", survivors=survivors, resume_step=resume_step, lost_steps=len(lost),
                          restart=self.restarts)
        if len(survivors) < self.cfg.fault_tolerance.min_replicas:
            return
        self.resume = resume_step > 0
        self._new_coordinator_identity()
        self._start_coordinator(len(survivors))
        for rid in survivors:
            self._start_replica(rid, join=False)

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.exit_code is None]

    def _random_kill(self, now: float) -> None:
        """Fails a random replica that is training right now (it committed a step in the last 2 s): a
        SIGKILL, a hang (SIGUSR1: the worker's training thread stops for good) or a SIGSTOP, drawn
        from ``random_faults``; the hung or frozen replica is fenced and reaped like any other.

        The clock starts with the first committed step; replicas still starting up or waiting to
        be admitted are not targets, and a kill never leaves fewer than ``min_replicas``.
        """
        if self.o.random_mtbf_s is None or not self.active:
            return
        if self.next_random_kill is None:
            self.next_random_kill = now + self.rng.expovariate(1.0 / self.o.random_mtbf_s)
        if now < self.next_random_kill:
            return
        self.next_random_kill = now + self.rng.expovariate(1.0 / self.o.random_mtbf_s)
        training = [r for r in self._live() if now - self.active.get(r.rid, 0.0) < 2.0
                    and not any(p.pid in self.faulted for p in r.procs)]  # a hung one has no second fault
        if len(training) - 1 < self.cfg.fault_tolerance.min_replicas:
            return
        victim = self.rng.choice(sorted(training, key=lambda r: r.rid))
        rank = self.rng.randrange(self.P)
        fault = self.rng.choice(self.o.random_faults)
        pid = victim.procs[rank].pid
        self.events.event("kill", replica=victim.rid, rank=rank, step=max(self.records, default=-1) + 1,
                          phase="random", pid=pid, source="launcher", fault=fault)
        sig = kind(fault).signal
        self.faulted.add(pid)
        os.killpg(pid, sig)
        self.kills += 1

    def _new_lines(self, path: Path) -> list[dict[str, Any]]:
        """The complete JSON lines appended to ``path`` since the last call."""
        start = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[path] = start + end
        return [json.loads(line) for line in data[:end].splitlines()]

    def _watch_fences(self, now: float) -> None:
        """A replica the coordinator declared dead (fenced, hung, silent) that still runs ``fence_exit_s``
        + 1 s later is SIGKILLed: a hung or frozen process cannot be trusted to exit by itself."""
        for rec in self._new_lines(self.out / "events.jsonl"):
            self.seen_events.append(rec)
            if rec.get("kind") == "kill" and rec.get("pid") is not None:
                self.known_kills.add(rec["pid"])
            elif rec.get("kind") == "failure_detected":
                self.lost_at[rec["replica"]] = rec["t"]
            rep = self.replicas.get(rec.get("replica", -1))
            if (rec.get("kind") == "failure_detected" and rec.get("cause") != "left" and rep is not None
                    and rep.exit_code is None and rep.started <= rec["t"]):
                self.fenced_at.setdefault(rep.rid, now)
        grace = self.cfg.fault_tolerance.fence_exit_s + 1.0
        for rid, since in list(self.fenced_at.items()):
            rep = self.replicas.get(rid)
            if rep is None or rep.exit_code is not None or all(p.poll() is not None for p in rep.procs):
                del self.fenced_at[rid]  # gone by itself: _poll_replicas logs its exit
            elif now - since >= grace:
                del self.fenced_at[rid]
                self.events.event("reaped", replica=rid, pids=[p.pid for p in rep.procs],
                                  after_s=round(now - since, 3))
                self.known_kills.update(p.pid for p in rep.procs)  # the launcher's own SIGKILL: no kill of its own
                rep.kill()

    def _collect(self) -> list[dict[str, Any]]:
        """New per-replica records; merges them per step (first writer wins, val_loss and eval_s from any)."""
        fresh = []
        for path in sorted((self.out / "replicas").glob("replica_*.jsonl")):
            for rec in self._new_lines(path):
                self.active[rec["replica"]] = time.time()
                prev = self.records.get(rec["step"])
                if prev is None:
                    self.records[rec["step"]] = rec
                    fresh.append(rec)
                elif "val_loss" in rec and "val_loss" not in prev:
                    prev["val_loss"] = rec["val_loss"]
                    if "eval_s" in rec:
                        prev["eval_s"] = rec["eval_s"]
        return fresh

    def _flush_metrics(self, final: bool) -> None:
        """Writes committed steps in order; a step waits for the next one (so its val_loss can merge)."""
        while (self.written + 1) in self.records and (final or (self.written + 2) in self.records):
            self.written += 1
            rec = dict(self.records[self.written])
            rec["elapsed_s"] = round(rec.pop("t") - self.t0, 3)
            self.metrics.write(rec)
            self.display.update(rec, self._goodput(final))

    def _goodput(self, final: bool) -> str | None:
        """The job's goodput so far, for the progress display: recomputed for every step while that costs
        little, and for at most 5% of the launcher's time (it reads every record so far)."""
        from recover.observe.goodput import describe, goodput

        now = time.time()
        if final or now >= self.goodput_at:
            rows = [self.records[s] for s in range(self.written + 1)]
            self.goodput_line = describe(goodput(rows, self.seen_events, now=now))
            self.goodput_at = now + 20 * (time.time() - now)
        return self.goodput_line

    # ---- the run ---------------------------------------------------------------------------
    def _prepare_out(self) -> None:
        """The run directory; with ``resume``, the step records before the newest checkpoint are kept."""
        from recover.observe.events import records_before
        from recover.train.integrity import list_checkpoints, remove_leftovers

        for sub in ("logs", "replicas"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.out / "checkpoints")  # what interrupted saves left (no process runs yet)
        old_logs = sorted((self.out / "replicas").glob("*.jsonl"))
        kept: dict[int, dict[str, Any]] = {}
        if self.o.resume:
            found = list_checkpoints(self.out / "checkpoints")
            kept = records_before(self.out / "metrics.jsonl", found[-1][0] if found else 0)
            self.resume = True
        for stale in ["metrics.jsonl", "summary.json", *(p.relative_to(self.out) for p in old_logs)]:
            (self.out / stale).unlink(missing_ok=True)
        if not self.o.resume:
            (self.out / "events.jsonl").unlink(missing_ok=True)
        (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        before = max((rec["elapsed_s"] for rec in kept.values()), default=0.0)
        self.t0 = time.time() - before  # elapsed time goes on from the interrupted run's
        for step, rec in sorted(kept.items()):
            self.records[step] = {**rec, "t": self.t0 + rec.pop("elapsed_s")}
        self.written = -1
        while self.written + 1 in self.records:
            self.written += 1

    def _request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT: a graceful stop (see the module docstring); the second one: at once."""
        if self.stop_signal is not None:
            raise KeyboardInterrupt(f"signal {signum}")
        self.stop_signal = signum

    def _begin_stop(self, now: float) -> None:
        """Passes the stop on: SIGTERM to the coordinator and every worker; no more rejoins or faults."""
        self.stop_started = now
        self.events.event("stop_requested", signal=signal.Signals(self.stop_signal).name, source="launcher",
                          grace_s=self.cfg.fault_tolerance.stop_grace_s)
        self.display.message(f"[bold]stopping[/]: at the next step boundary, after a checkpoint (within "
                             f"{self.cfg.fault_tolerance.stop_grace_s:g} s; signal again to stop at once)")
        self.rejoin_at.clear()
        if self.spare:
            kill_processes([p for p, _, _ in self.spare])
            self.spare = None
        signal_processes([p for r in self._live() for p in r.procs] + ([self.coordinator] if self.coordinator else []),
                         signal.SIGTERM)

    def _watch_coordinator(self) -> None:
        """A coordinator that exited while the job runs is started again on its ports and token."""
        if self.coordinator is None or self.coordinator.poll() is None or self.stop_started is not None:
            return
        code = self.coordinator.returncode
        if self.coordinator_restarts >= MAX_COORDINATOR_RESTARTS:
            raise RuntimeError(f"the coordinator exited ({code}) {self.coordinator_restarts + 1} times; see "
                               f"{self.out / 'logs' / 'coordinator.log'}")
        self.coordinator_restarts += 1
        self.events.event("coordinator_exit", code=code, restart=self.coordinator_restarts)
        self.display.message(f"coordinator exited ({code}): restarting it; replicas keep their state")
        self._start_coordinator(self.n)

    def run(self) -> int:
        self._prepare_out()
        self.events = EventLog(self.out / "events.jsonl")
        self.metrics = JsonlWriter(self.out / "metrics.jsonl")
        steps = self.cfg.training.steps
        self.display = ProgressDisplay(steps, self.written + 1, title=self.o.title, enabled=self.o.progress)
        for step in range(self.written + 1):
            rec = dict(self.records[step])
            rec["elapsed_s"] = round(rec.pop("t") - self.t0, 3)
            self.metrics.write(rec)
        self.next_random_kill: float | None = None
        self.faulted: set[int] = set()  # PIDs a random fault already hit
        t0 = time.time()
        self.events.event("launch", replicas=self.n, steps=steps, failures=[str(s) for s in self.o.failures],
                          random_mtbf_s=self.o.random_mtbf_s, rejoin_after_s=self.o.rejoin_after_s,
                          resume_step=self.written + 1 if self.resume else None)
        grace_end: float | None = None
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        try:
            self._new_coordinator_identity()
            self._start_coordinator(self.n)
            for rid in range(self.n):
                self._start_replica(rid, join=False)
            if self.o.rejoin_after_s is not None and not self.o.placement.gpus:  # a spare needs its device
                self._start_spare()                                                  # before it knows its replica
            while True:
                now = time.time()
                if self.stop_signal is not None and self.stop_started is None:
                    self._begin_stop(now)
                self._watch_coordinator()
                self._watch_fences(now)
                self._poll_replicas(now)
                self._collect()
                self._flush_metrics(final=False)
                if not self._live() and not self.rejoin_at:
                    break
                if self.stop_started is not None and now - self.stop_started > self.cfg.fault_tolerance.stop_grace_s:
                    self.events.event("stop_grace_over", running=[r.rid for r in self._live()])
                    break
                if all(s in self.records for s in range(steps)) and all(r.joined for r in self._live()):
                    # every step committed; only joiners are left: one that trained to the end exits on
                    # its own within the grace, a late one with nothing left to join is stopped after it
                    grace_end = grace_end or now + JOINER_GRACE_S
                    if now >= grace_end:
                        break
                if self.stop_started is None:
                    self._random_kill(now)
                time.sleep(POLL_S)
            self._collect()
            self._flush_metrics(final=True)
        finally:
            self.display.close()
            self._kill_all()
            self.metrics.close()
        # the final record of every committed step, in order (a restart redid some of them)
        with open(self.out / "metrics.jsonl", "w", encoding="utf-8") as f:
            for step in sorted(self.records):
                rec = dict(self.records[step])
                rec["elapsed_s"] = round(rec.pop("t") - self.t0, 3)
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        wall = time.time() - t0
        return self._exit_status(wall)

    def _exit_status(self, wall: float) -> int:
        codes = {r.rid: r.exit_code for r in self.replicas.values()}
        self.events.event("end", wall_s=round(wall, 3), exit_codes=codes)
        self.events.close()
        self.wall_s = wall
        if self.written + 1 >= self.cfg.training.steps:
            return 0
        for status in (EXIT_DIVERGED, EXIT_NONFINITE, EXIT_BAD_DATA, EXIT_QUORUM_LOST, EXIT_COORDINATOR_LOST,
                       EXIT_STOPPED):
            if any(c == status for c in codes.values()):
                return status
        return 1

    def failed_logs(self) -> list[str]:
        """Tails of logs of replicas that exited with an error (not a SIGKILL or quorum loss)."""
        out = []
        for rep in self.replicas.values():
            if rep.exit_code not in (0, LOST, EXIT_QUORUM_LOST, EXIT_JOB_FAILED, EXIT_STOPPED, EXIT_COORDINATOR_LOST,
                                     EXIT_DIVERGED, EXIT_NONFINITE, EXIT_BAD_DATA, None):
                for k, path in enumerate(rep.log_paths):
                    if rep.codes.get(k, 0) != 0:
                        text = path.read_text(errors="replace")
                        who = f"replica {rep.rid}" + (f" rank {k}" if len(rep.procs) > 1 else "")
                        out.append(f"{who} exited with {rep.codes[k]}:\n" + "\n".join(text.splitlines()[-15:]))
        return out


__all__ = ["LaunchOptions", "Launcher", "free_port"]
