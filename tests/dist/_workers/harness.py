"""Harness for multi-process layer-1 tests: an in-process coordinator plus worker subprocesses.

Every process is started in its own session and killed by PID in ``Cluster.close()`` (SIGCONT first,
in case a test stopped it); every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("comm_worker.py")
TOKEN = "layer1-test-token"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + str(ROOT / "tests" / "dist") + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


class Proc:
    """One worker: send JSON commands, read JSON lines with a timeout."""

    def __init__(self, replica: int, port: int, join: bool = False, timeout_s: float = 30.0) -> None:
        cmd = [sys.executable, str(WORKER), "--port", str(port), "--token", TOKEN, "--replica", str(replica),
               "--timeout", str(timeout_s)]
        if join:
            cmd.append("--join")
        self.replica = replica
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env(), start_new_session=True)
        self.pid = self.popen.pid
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.stderr.append(line)

    def _pump_err(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.stderr.append(line)

    def send(self, **cmd: Any) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()

    def expect(self, key: str, value: Any = None, timeout: float = 60.0) -> dict[str, Any]:
        """The next line with ``key`` (equal to ``value`` when given); fails on a fatal event."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                rec = self.lines.get(timeout=max(0.01, left))
            except queue.Empty:
                raise AssertionError(f"replica {self.replica}: no {key}={value} within {timeout} s; "
                                     f"stderr tail: {''.join(self.stderr[-20:])}") from None
            if rec.get("event") == "fatal":
                raise AssertionError(f"replica {self.replica} died: {rec}; stderr: {''.join(self.stderr[-20:])}")
            if key in rec and (value is None or rec[key] == value):
                return rec

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Sends ``sig``; returns time.monotonic() just before."""
        t = time.monotonic()
        os.kill(self.pid, sig)
        return t

    def close(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


class Cluster:
    """A coordinator in this process and ``n`` worker processes (replicas 0..n-1)."""

    def __init__(self, n: int, events: Path, heartbeat_timeout_s: float = 1.0, max_replicas: int | None = None) -> None:
        from recover.coord.server import Coordinator

        self.coord = Coordinator(token=TOKEN, events_path=str(events), expected_replicas=n,
                                 heartbeat_timeout_s=heartbeat_timeout_s, max_replicas=max_replicas).start()
        self.events = events
        self.procs: dict[int, Proc] = {}
        try:
            for r in range(n):
                self.procs[r] = Proc(r, self.coord.port)
            for p in self.procs.values():
                p.expect("event", "ready", timeout=90)
        except BaseException:
            self.close()
            raise

    def add(self, replica: int, join: bool = True) -> Proc:
        self.procs[replica] = Proc(replica, self.coord.port, join=join)
        return self.procs[replica]

    def send_all(self, replicas: list[int], **cmd: Any) -> None:
        for r in replicas:
            self.procs[r].send(**cmd)

    def expect_all(self, replicas: list[int], key: str, value: Any = None, timeout: float = 60.0) -> dict[int, Any]:
        return {r: self.procs[r].expect(key, value, timeout) for r in replicas}

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        from recover.observe.events import read_jsonl

        return [e for e in read_jsonl(self.events) if e["kind"] == kind]

    def close(self) -> None:
        for p in self.procs.values():
            p.close()
        self.coord.stop()
