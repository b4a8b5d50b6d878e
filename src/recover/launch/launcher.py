"""``recover launch``: one coordinator and N replica processes on this machine, with real failures.

Contract:
- Everything is validated before any process starts (config, failure schedule, flags).
- The coordinator starts first, as its own process (a worker's death never takes it down).
- Replica processes are started in their own sessions and tracked by PID; on exit, error or
  Ctrl-C every process the launcher started is killed by PID, never by name.
- Failures are real: ``--fail`` specs make a replica SIGKILL itself at (step, phase);
  ``--random-failures MTBF`` makes the launcher SIGKILL a random live replica at exponentially
  distributed times (never below ``min_replicas``). ``--rejoin-after S`` restarts a killed
  replica S seconds later; it joins back at the next step boundary.
- The launcher is the single writer of ``metrics.jsonl``: one record per committed step, merged
  from the replicas' own logs (``replicas/replica_R.jsonl``), plus ``summary.json`` and the plots.
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
from recover.faults import FailureSchedule
from recover.observe.events import EventLog, JsonlWriter, read_jsonl
from recover.observe.progress import ProgressDisplay
from recover.train.worker import EXIT_JOB_FAILED, EXIT_QUORUM_LOST, replica_log_path

POLL_S = 0.05


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
    rejoin_after_s: float | None = None
    baseline: str | None = None
    """None (recover), ``shrink`` (shrink-and-drop) or ``restart`` (checkpoint-and-restart)."""
    rejoin_replicas: frozenset[int] | None = None
    """Which killed replicas rejoin (None: all)."""
    seed: int = 0
    host: str = "127.0.0.1"
    progress: bool = True
    title: str = "launch"


@dataclass
class Replica:
    rid: int
    proc: subprocess.Popen[bytes]
    log: Any
    log_path: Path
    started: float
    joined: bool
    exit_code: int | None = None


class Launcher:
    def __init__(self, opts: LaunchOptions) -> None:
        self.o = opts
        self.cfg = opts.config
        self.n = self.cfg.parallel.replicas
        self.out = opts.out
        self.rng = random.Random(opts.seed)
        self.replicas: dict[int, Replica] = {}
        self.rejoin_at: dict[int, float] = {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.spare: tuple[subprocess.Popen[bytes], Any, Path] | None = None
        self.spares_started = 0
        self.resume = False
        self.restarts = 0
        self.records: dict[int, dict[str, Any]] = {}
        self.offsets: dict[Path, int] = {}
        self.written = -1
        self.kills = 0
        self.active: dict[int, float] = {}
        """replica -> when a step record of it was last seen (it is a training member)."""

    # ---- processes -------------------------------------------------------------------------
    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "recover", *args]

    def _start_coordinator(self, expected: int) -> None:
        self.port = free_port(self.o.host)
        token_file = self.out / "token"
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
        self.token_file = token_file
        ft = self.cfg.fault_tolerance
        cmd = self._python("coordinator", "--host", self.o.host, "--port", str(self.port), "--token-file",
                           str(token_file), "--events", str(self.out / "events.jsonl"), "--replicas", str(expected),
                           "--min-replicas", str(ft.min_replicas), "--heartbeat-interval", str(ft.heartbeat_interval_s),
                           "--heartbeat-timeout", str(ft.heartbeat_timeout_s))
        log = open(self.out / "logs" / "coordinator.log", "wb")  # noqa: SIM115 - lives with the process
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
                           str(self.n), *self.o.overrides)
        if self.o.baseline:
            cmd += ["--baseline", self.o.baseline]
        if self.resume:
            cmd.append("--resume")
        return cmd

    def _fails(self, rid: int) -> list[str]:
        return [str(spec) for spec in self.o.failures.for_replica(rid)]

    def _start_spare(self) -> None:
        """A hot spare: a worker that has started up (torch, model, data) and waits to be told who to be."""
        path = self.out / "logs" / f"spare_{self.spares_started}.log"
        self.spares_started += 1
        log = open(path, "ab")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen([*self._worker_cmd(), "--spare"], stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.spare = (proc, log, path)

    def _start_replica(self, rid: int, join: bool) -> None:
        if join and self.spare is not None and self.spare[0].poll() is None:
            proc, log, path = self.spare
            self.spare = None
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({"replica": rid, "fail": self._fails(rid)}) + "\n").encode())
            proc.stdin.close()
            self._start_spare()
        else:
            path = self.out / "logs" / f"replica_{rid}.log"
            log = open(path, "ab")  # noqa: SIM115 - lives with the process
            cmd = [*self._worker_cmd(), "--replica", str(rid), *(a for f in self._fails(rid) for a in ("--fail", f))]
            if join:
                cmd.append("--join")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.replicas[rid] = Replica(rid, proc, log, path, time.time(), join)
        if join:
            self.events.event("rejoin_started", replica=rid, pid=proc.pid, log=path.name)

    def _kill_all(self) -> None:
        procs = [r.proc for r in self.replicas.values()] + ([self.coordinator] if self.coordinator else [])
        procs += [self.spare[0]] if self.spare else []
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ---- monitoring ------------------------------------------------------------------------
    def _poll_replicas(self, now: float) -> None:
        for rep in self.replicas.values():
            if rep.exit_code is not None:
                continue
            code = rep.proc.poll()
            if code is None:
                continue
            rep.exit_code = code
            rep.log.close()
            self.events.event("replica_exit", replica=rep.rid, code=code, pid=rep.proc.pid)
            unfinished = self.written + 1 < self.cfg.training.steps
            if self.o.baseline == "restart" and code in (-signal.SIGKILL, EXIT_JOB_FAILED) and unfinished:
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

    def _restart(self) -> None:
        """Checkpoint-and-restart: stop everything, relaunch the survivors from the last checkpoint."""
        from recover.train.checkpoint import list_checkpoints

        deadline = time.time() + 5.0  # survivors notice and exit on their own, as a failed torchrun job does
        while time.time() < deadline and any(r.proc.poll() is None for r in self.replicas.values()):
            time.sleep(POLL_S)
        survivors = sorted(r.rid for r in self.replicas.values()
                           if r.exit_code != -signal.SIGKILL and r.proc.poll() != -signal.SIGKILL)
        self._kill_all()
        for rep in self.replicas.values():
            if rep.exit_code is None:
                rep.exit_code = rep.proc.poll()
                rep.log.close()
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
        self._start_coordinator(len(survivors))
        for rid in survivors:
            self._start_replica(rid, join=False)

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.exit_code is None]

    def _random_kill(self, now: float) -> None:
        """SIGKILLs a random replica that is training right now (it committed a step in the last 2 s).

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
        training = [r for r in self._live() if now - self.active.get(r.rid, 0.0) < 2.0]
        if len(training) - 1 < self.cfg.fault_tolerance.min_replicas:
            return
        victim = self.rng.choice(sorted(training, key=lambda r: r.rid))
        self.events.event("kill", replica=victim.rid, step=max(self.records, default=-1) + 1, phase="random",
                          pid=victim.proc.pid, source="launcher")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        self.kills += 1

    def _collect(self) -> list[dict[str, Any]]:
        """New per-replica records; merges them per step (first writer wins, val_loss from any)."""
        fresh = []
        for path in sorted((self.out / "replicas").glob("replica_*.jsonl")):
            start = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = start + end
            for line in data[:end].splitlines():
                rec = json.loads(line)
                self.active[rec["replica"]] = time.time()
                prev = self.records.get(rec["step"])
                if prev is None:
                    self.records[rec["step"]] = rec
                    fresh.append(rec)
                elif "val_loss" in rec and "val_loss" not in prev:
                    prev["val_loss"] = rec["val_loss"]
        return fresh

    def _flush_metrics(self, final: bool) -> None:
        """Writes committed steps in order; a step waits for the next one (so its val_loss can merge)."""
        while (self.written + 1) in self.records and (final or (self.written + 2) in self.records):
            self.written += 1
            rec = dict(self.records[self.written])
            rec["elapsed_s"] = round(rec.pop("t") - self.t0, 3)
            self.metrics.write(rec)
            self.display.update(rec)

    # ---- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        for sub in ("logs", "replicas"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        for stale in ["metrics.jsonl", "events.jsonl", "summary.json", *(p.relative_to(self.out) for p in
                                                                     (self.out / "replicas").glob("*.jsonl"))]:
            (self.out / stale).unlink(missing_ok=True)
        (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        self.events = EventLog(self.out / "events.jsonl")
        self.metrics = JsonlWriter(self.out / "metrics.jsonl")
        steps = self.cfg.training.steps
        self.display = ProgressDisplay(steps, title=self.o.title, enabled=self.o.progress)
        self.next_random_kill: float | None = None
        t0 = self.t0 = time.time()
        self.events.event("launch", replicas=self.n, steps=steps, failures=[str(s) for s in self.o.failures],
                          random_mtbf_s=self.o.random_mtbf_s, rejoin_after_s=self.o.rejoin_after_s)
        try:
            self._start_coordinator(self.n)
            for rid in range(self.n):
                self._start_replica(rid, join=False)
            if self.o.rejoin_after_s is not None:
                self._start_spare()
            while True:
                now = time.time()
                self._poll_replicas(now)
                self._collect()
                self._flush_metrics(final=False)
                if not self._live() and not self.rejoin_at:
                    break
                if all(s in self.records for s in range(steps)) and all(r.joined for r in self._live()):
                    break  # every step committed; only late joiners are left, with nothing to join
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
        if any(c == EXIT_QUORUM_LOST for c in codes.values()):
            return EXIT_QUORUM_LOST
        return 1

    def failed_logs(self) -> list[str]:
        """Tails of logs of replicas that exited with an error (not a SIGKILL or quorum loss)."""
        out = []
        for rep in self.replicas.values():
            if rep.exit_code not in (0, -signal.SIGKILL, EXIT_QUORUM_LOST, EXIT_JOB_FAILED, None):
                text = rep.log_path.read_text(errors="replace")
                out.append(f"replica {rep.rid} exited with {rep.exit_code}:\n" + "\n".join(text.splitlines()[-15:]))
        return out


def replica_records(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted((out / "replicas").glob("replica_*.jsonl")):
        records.extend(read_jsonl(path))
    return records


__all__ = ["LaunchOptions", "Launcher", "free_port", "replica_log_path", "replica_records"]
