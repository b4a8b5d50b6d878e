"""Processes forked from a warm interpreter instead of started as new ones (seconds of imports saved).

Two places fork: the job's fork server (:mod:`recover.launch.forkserver`: the coordinator and every worker)
and a replica's checkpoint writer (:mod:`recover.train.checkpoints.writer`, forked by its worker before the
worker starts a thread). They ask the same things of this module (the fork server all four).

Contract (Linux; stdlib only, below every package):
- :func:`unsafe` says why forking this process now would not be safe (a Python thread runs besides the
  calling one: its locks could be held at the fork and never released in the child; a CUDA context exists or
  the CUDA driver is loaded: a forked child cannot use CUDA), or None. Native threads of libraries that re-make
  them after a fork (OpenBLAS's, as every ``DataLoader`` worker relies on) are allowed.
- :class:`Forked` is a forked child seen as :class:`subprocess.Popen` sees one (``pid``, ``args``, ``stdin``,
  ``returncode``, ``poll``, ``wait`` on a pidfd, ``send_signal``, ``terminate``, ``kill``); only the process's
  parent may hold one (it reaps it).
- :func:`retitle` writes a command line over the process's own (``/proc/PID/cmdline``, what ``ps`` shows),
  cut to the room the original one had.
- :func:`reseed` gives a forked child fresh seeds for the global generators a new interpreter seeds from the
  system's entropy (Python's ``random``, numpy's); torch's default generator starts from the same fixed seed in
  any process and is left alone.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def unsafe() -> str | None:
    """Why forking here would not be safe, or None (see the module docstring)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a CUDA context exists in this process"
    try:  # the driver loaded (a device count asked, say) is enough to break CUDA in a forked child
        if "/libcuda.so" in Path("/proc/self/maps").read_text():
            return "the CUDA driver is loaded in this process"
    except OSError:
        pass
    if threading.active_count() > 1:
        return f"Python threads run in this process: {[t.name for t in threading.enumerate()]}"
    return None


def threads() -> list[str]:
    """The names of this process's native threads but the main one."""
    me = os.getpid()
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                continue
    return names


def retitle(args: list[str]) -> None:
    """Writes ``args`` over this process's original command line (``/proc/self/cmdline``), cut to its room."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    except (OSError, ValueError, IndexError):
        return
    size = end - start
    if size <= 1:
        return
    text = b"\0".join(a.encode(errors="replace") for a in args)[:size - 1]
    ctypes.memmove(start, text.ljust(size, b"\0"), size)


def reseed() -> None:
    """Fresh seeds for Python's and numpy's global generators (see the module docstring)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


class Forked:
    """A forked child of this process, seen as :class:`subprocess.Popen` sees one."""

    def __init__(self, args: list[str], pid: int, stdin: IO[bytes] | None = None) -> None:
        self.args, self.pid, self.stdin = args, pid, stdin
        self.stdout = self.stderr = None
        self.returncode: int | None = None
        self._lock = threading.Lock()  # a watching thread may poll too
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # readable once it ended (Linux >= 5.3)
        except (OSError, AttributeError):
            self._pidfd = None

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: its status is lost, not its end
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                    if self._pidfd is not None:
                        os.close(self._pidfd)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            pause = 1.0 if left is None else min(left, 1.0)
            try:
                if self._pidfd is None:
                    raise ValueError
                select.select([self._pidfd], [], [], pause)
            except (OSError, ValueError):  # no pidfd, or closed by a poll in another thread meanwhile
                time.sleep(min(pause, 0.005))
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
