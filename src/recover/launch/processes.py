"""The processes of one replica, as the launcher starts, watches and ends them.

Contract:
- Every process is started in its own session (:func:`spawn`), its environment marked for the
  lifeline (:func:`recover.lifeline.child_env`), and is signalled by its PID, never by name.
- :class:`ReplicaProcesses` acts as torchrun's agent for the P ranks of a replica: once one rank
  ends abnormally, the others are SIGKILLed at once; the replica's exit code is :data:`LOST` when a
  rank died by SIGKILL or was fenced, else the first abnormal code, else 0.
- A worker's death it did not choose is seen at once (:func:`spawn`'s ``on_death``, :mod:`recover.deathwatch`),
  25-40 ms before its connections close.
- :func:`kill_processes` SIGKILLs and reaps: a process it was given is gone when it returns (or
  did not die within 10 s of SIGKILL, which only a process stuck in the kernel does).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from recover import deathwatch
from recover.forking import Forked
from recover.launch.forkserver import ForkServer, Unavailable
from recover.lifeline import child_env
from recover.train.processes.exits import EXIT_FENCED

LOST = -signal.SIGKILL
"""A replica's exit code when it was lost to a failure (a rank SIGKILLed, or the replica fenced)."""

Process = subprocess.Popen[bytes] | Forked


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it before it is used: a launcher
    holds its ports with :class:`Ports`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user + system) process ``pid`` has spent so far (Linux ``/proc``; None elsewhere, or
    once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Ports:
    """TCP ports on ``host`` held for the processes a launcher starts, so that nothing else on the machine
    takes one between its choice and the child's bind (a busy node's outgoing connections draw their local
    ports from the same range: the coordinator then failed to start, 'cannot bind'), nor while a
    coordinator restarts on the same ports. Each is held by a socket bound here with ``SO_REUSEADDR`` and
    never listening: a child binds and listens on it with ``SO_REUSEADDR`` too (Python's
    ``socket.create_server`` and c10d's ``TCPStore`` both set it), which Linux allows beside a bound
    socket that does not listen, while any other bind and any outgoing connection are kept off it."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._held: dict[str, socket.socket] = {}

    def take(self, key: str) -> int:
        """A port held under ``key`` (one held before under the same key is let go: its user was replaced)."""
        self.release(key)
        s = socket.socket(socket.getaddrinfo(self.host, 0, 0, socket.SOCK_STREAM)[0][0], socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, 0))
        self._held[key] = s
        return int(s.getsockname()[1])

    def release(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            held.close()


def signal_processes(procs: list[Process], sig: int) -> None:
    """Sends ``sig`` to each process still running (by PID: each leads its own session)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def kill_processes(procs: list[Process]) -> None:
    """SIGKILLs each process still running, then reaps them all."""
    signal_processes(procs, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Spawned:
    """One started process with its log."""

    proc: Process
    log: IO[bytes]
    path: Path


def spawn(cmd: list[str], log_path: Path, env: dict[str, str], stdin: Any = None,
          on_death: Callable[[int], None] | None = None, forks: ForkServer | None = None) -> Spawned:
    """Starts ``cmd`` in a session of its own, output appended to ``log_path``, with ``env`` on top of
    this process's environment (marked for the lifeline). ``on_death(pid)``: called from a thread of its own
    the moment the process dies without having chosen to (:mod:`recover.deathwatch`; where supported).
    ``forks``: a ``recover`` command is forked by this server (:mod:`recover.launch.forkserver`), or started
    as a new interpreter when the server cannot."""
    log = open(log_path, "ab")  # noqa: SIM115 - lives with the process
    options: dict[str, Any] = {"stdin": stdin, "stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
    env = {**child_env(), **env}
    start = _starter(forks)
    proc = deathwatch.popen(cmd, on_death, env, start=start, **options) if on_death is not None else start(
        cmd, env=env, **options)
    return Spawned(proc, log, log_path)


def _starter(forks: ForkServer | None) -> Callable[..., Process]:
    if forks is None:
        return subprocess.Popen

    def start(cmd: list[str], env: dict[str, str], **options: Any) -> Process:
        try:
            return forks.popen(cmd, env, **options)
        except Unavailable:
            return subprocess.Popen(cmd, env=env, **options)

    return start


@dataclass
class ReplicaProcesses:
    """The P processes (ranks) of one replica; rank 0 first."""

    rid: int
    ranks: list[Spawned]
    started: float
    joined: bool
    exit_code: int | None = None
    codes: dict[int, int] = field(default_factory=dict)
    """rank -> exit code, for ranks that ended on their own (not reaped by the launcher)."""

    @property
    def procs(self) -> list[Process]:
        return [r.proc for r in self.ranks]

    @property
    def pid(self) -> int:
        return self.ranks[0].proc.pid

    def running(self) -> bool:
        """Whether any rank still runs (whatever :meth:`poll` concluded)."""
        return any(p.poll() is None for p in self.procs)

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
        elif len(self.codes) < len(self.ranks):
            return None  # some ranks finished, the others are finishing
        self.exit_code = LOST if any(c in (-signal.SIGKILL, EXIT_FENCED) for c in bad) else (bad[0] if bad else 0)
        return self.exit_code

    def kill(self) -> None:
        """SIGKILLs every rank still running and reaps it."""
        kill_processes(self.procs)

    def close_logs(self) -> None:
        for rank in self.ranks:
            rank.log.close()
