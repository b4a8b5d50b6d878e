"""Replica workers forked from a warm interpreter: a worker starts in milliseconds, not seconds of imports.

A ``recover worker`` spends ~3 s of CPU importing torch and recover (and torch's compiler stack, which the
first optimizer step imports) before it does anything of its own: on a node whose replicas start together
that is one core's seconds per replica, and a replacement started without a warm spare joins that much later.
``recover launch`` therefore starts one fork server per job (``recover forkserver``, a child of the launcher
marked for the lifeline like the others): it imports what a worker imports, once, and forks the coordinator
and each worker (a "worker" below is any ``recover`` command forked).

Contract (Linux; :func:`start` returns None elsewhere, and callers then start workers as new interpreters):
- :meth:`ForkServer.popen` takes the place of :class:`subprocess.Popen` for a ``python -m recover ...``
  command and returns a :class:`Forked` with Popen's ``pid``, ``args``, ``stdin``, ``returncode``, ``poll``,
  ``wait``, ``send_signal``, ``terminate`` and ``kill``. It raises :class:`Unavailable` when the server cannot
  serve (it died, or did not become ready in time): the caller starts the process the usual way.
- The worker is the launcher's own child, not the server's: the server forks a short-lived intermediate that
  forks the worker and exits, and the launcher is a child subreaper while it asks (``PR_SET_CHILD_SUBREAPER``),
  so the worker is reparented to it. The launcher waits for it and signals it like any child; the server's
  death ends no worker, and the lifeline (:mod:`recover.lifeline`) ties the worker to the launcher itself.
- The worker runs in a session of its own with exactly the request's environment (``os.environ``, ``getenv``;
  ``/proc/PID/environ`` shows the server's, the block a process is born with), working directory and standard
  streams, and each descriptor of ``pass_fds`` at its own number; ``/proc/PID/cmdline`` (``ps``) shows its own
  command (written over the room the server's command line keeps for it: :data:`ROOM` bytes).
- A launcher whose environment names a fork server (``RECOVER_FORK_SERVER=FD:PID``: a server already serving
  on socket FD, the launcher's own child PID, forked by the warm interpreter that forked the launcher, as the
  test suite's does) adopts it instead of starting one; the variable is taken out of its environment.
- The server imports before it serves and forks only while it is single-threaded apart from threads whose
  libraries re-make them after a fork (OpenBLAS's, as every ``DataLoader`` worker relies on) and while no
  CUDA context exists in it (torch's import creates none); a worker initialises its devices itself.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from recover.forking import Forked, reseed, retitle, threads, unsafe
from recover.lifeline import child_env

ROOM = 8192
"""Bytes the server's command line keeps for a worker's: a longer command is cut there in ``ps``."""
READY_TIMEOUT_S = 120.0
"""How long a request waits for the server's imports (a busy node's first start) before the worker is started
as a new interpreter instead."""
_PR_SET_CHILD_SUBREAPER = 36
_MAX_FDS = 16
_PRELOAD = ("recover.train.processes.worker", "torch._dynamo", "torch.distributed.checkpoint")
"""What a worker imports before its first step: ``torch._dynamo`` comes with the first optimizer step and
``torch.distributed.checkpoint`` with the first save."""


HANDED_ENV = "RECOVER_FORK_SERVER"
"""``FD:PID`` of a fork server handed to the launcher (see the module docstring)."""


class Unavailable(RuntimeError):
    """The fork server cannot start this process: start it as a new interpreter."""


def supported() -> bool:
    """Whether workers can be forked here (Linux: a child subreaper and ``/proc``)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SOCK_SEQPACKET") and hasattr(os, "pidfd_open")


def _prctl(option: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


# ---- the launcher's side -----------------------------------------------------------------------------------


class ForkServer:
    """The launcher's handle on its fork server (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes] | Forked, sock: socket.socket) -> None:
        self.proc, self._sock = proc, sock
        self._lock = threading.Lock()  # one request at a time: the subreaper window is per request
        self.ready: dict[str, Any] | None = None
        self.broken: str | None = None
        """Why it cannot serve (None while it can)."""
        self.forked = 0
        """Workers it forked."""
        self.started = time.monotonic()

    def _await_ready(self) -> None:
        if self.ready is not None or self.broken is not None:
            return
        left = READY_TIMEOUT_S - (time.monotonic() - self.started)
        self._sock.settimeout(max(left, 0.001))
        try:
            self.ready = json.loads(self._sock.recv(4096) or b"null")
        except (OSError, ValueError) as exc:
            self.broken = f"not ready within {READY_TIMEOUT_S:.0f} s ({exc})" if isinstance(exc, TimeoutError) \
                else f"gone ({exc})"
        if self.ready is None and self.broken is None:
            self.broken = f"exited with {self.proc.poll()} while importing (see its log)"
        if self.broken is None and not self.ready.get("forks", False):  # type: ignore[union-attr]
            self.broken = self.ready.get("why", "refused")  # type: ignore[union-attr]
        self._sock.settimeout(None)

    def popen(self, cmd: list[str], env: dict[str, str], stdin: Any = None, stdout: Any = None, stderr: Any = None,
              pass_fds: tuple[int, ...] = (), start_new_session: bool = True, cwd: str | None = None) -> Forked:
        """``subprocess.Popen(cmd, env=env, stdin=..., stdout=..., stderr=..., pass_fds=..., start_new_session=True)``
        for ``cmd`` = ``[python, "-m", "recover", ...]``; ``stdin`` None (the server's: nothing) or
        ``subprocess.PIPE``, ``stdout`` a file, ``stderr`` a file or ``subprocess.STDOUT``."""
        assert start_new_session and cmd[1:3] == ["-m", "recover"], cmd
        with self._lock:
            self._await_ready()
            if self.broken is not None:
                raise Unavailable(self.broken)
            pipe = os.pipe() if stdin == subprocess.PIPE else None
            out = stdout.fileno()
            err = out if stderr in (None, subprocess.STDOUT) else stderr.fileno()
            fds = [pipe[0] if pipe else -1, out, err, *pass_fds]
            request = {"argv": cmd[3:], "env": env, "cwd": cwd or os.getcwd(), "targets": [0, 1, 2, *pass_fds],
                       "parent": os.getpid()}
            reaper = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
            try:
                if not reaper:
                    self.broken = "refused by this system (PR_SET_CHILD_SUBREAPER)"
                    raise Unavailable(self.broken)
                sent = [fd for fd in fds if fd >= 0]
                socket.send_fds(self._sock, [json.dumps({**request, "sent": [fd >= 0 for fd in fds]}).encode()],
                                sent)
                reply = json.loads(self._sock.recv(4096) or b"null")
                if not reply or "pid" not in reply:
                    raise Unavailable((reply or {}).get("error", "the server closed its socket"))
            except (OSError, ValueError, Unavailable) as exc:
                if pipe:
                    os.close(pipe[1])  # no child has the other end
                if isinstance(exc, Unavailable):
                    raise
                self.broken = f"gone ({exc})"
                raise Unavailable(self.broken) from exc
            finally:
                if reaper:
                    _prctl(_PR_SET_CHILD_SUBREAPER, 0)
                if pipe:
                    os.close(pipe[0])
            self.forked += 1
            return Forked(cmd, int(reply["pid"]), os.fdopen(pipe[1], "wb") if pipe else None)

    def close(self) -> None:
        """Ends the server (its workers run on: they are the launcher's)."""
        self._sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(log_path: Path) -> ForkServer | None:
    """Starts the job's fork server (None where :func:`supported` is false); it imports in the background and
    the first :meth:`ForkServer.popen` waits for it. Its output goes to ``log_path``."""
    if not supported():
        return None
    handed = os.environ.pop(HANDED_ENV, "")
    if handed:
        fd, pid = (int(x) for x in handed.split(":"))
        return ForkServer(Forked([sys.executable, "-m", "recover", "forkserver", "--fd", str(fd)], pid),
                          socket.socket(fileno=fd))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "recover", "forkserver", "--fd", str(theirs.fileno()),
                                 "--room", " " * ROOM], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env())
    theirs.close()
    return ForkServer(proc, mine)


# ---- the server's side -------------------------------------------------------------------------------------


def serve(fd: int) -> list[str] | None:
    """``recover forkserver``: imports, says whether it can fork, then serves requests on socket ``fd`` until it
    closes (returns None). In a forked worker it returns that worker's ``recover`` arguments instead, with the
    process set up as asked (the caller runs them)."""
    from recover.lifeline import die_with_launcher

    die_with_launcher()
    sock = socket.socket(fileno=fd)
    why = None
    try:
        import importlib

        for name in _PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure: the workers start as new interpreters
        why = f"importing failed ({type(exc).__name__}: {exc})"
    why = why or unsafe()
    gc.freeze()  # the imports' objects live as long as the workers: none of their collections walks (copies) them
    sock.send(json.dumps({"forks": why is None, "why": why, "threads": threads(),
                          "cpu_s": round(time.process_time(), 3)}).encode())
    if why is not None:
        return None
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
        except OSError:
            return None
        if not msg:
            return None
        request = json.loads(msg)
        argv = _fork(sock, request, fds)
        if argv is not None:
            return argv


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> list[str] | None:
    """Forks the worker of ``request`` (its argv in the worker, None here) and replies with its PID."""
    why = unsafe()
    if why is not None:
        _close(fds)
        sock.send(json.dumps({"error": why}).encode())
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: forks the worker and exits, so that the launcher adopts it
        os.close(r)
        try:
            worker = os.fork()
        except OSError:
            os._exit(1)
        if worker == 0:
            os.close(w)
            return _become(sock, request, fds)
        os.write(w, str(worker).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(middle, 0)  # once reaped, the worker has been reparented
    with os.fdopen(r, "rb") as pipe:
        pid = pipe.read().decode()
    _close(fds)
    sock.send(json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}).encode())
    return None


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _become(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> list[str]:
    """In the forked worker: its session, descriptors, environment, directory and command line."""
    sock.close()
    os.setsid()
    targets = [t for t, sent in zip(request["targets"], request["sent"], strict=True) if sent]
    floor = max([*targets, *fds, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]  # no dup2 below overwrites a source
    _close(fds)
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target)  # inheritable, as Popen's pass_fds
    _close([fd for fd in high if fd not in targets])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    deadline = time.monotonic() + 10
    while os.getppid() != request["parent"] and time.monotonic() < deadline:  # adopted by the launcher
        time.sleep(0.001)
    reseed()
    argv = list(request["argv"])
    retitle([sys.executable, "-m", "recover", *argv])
    sys.argv = [sys.argv[0], *argv]
    return argv


def run(args: Any) -> list[str] | None:
    """``recover forkserver --fd N``: serves until the launcher closes its socket (None); in each forked worker
    it returns the command line that ``recover`` then runs in its place."""
    argv = serve(args.fd)
    if argv is None:  # served: no interpreter teardown (a second of CPU with torch loaded) on the job's cores
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return argv


def register(sub: Any) -> None:
    p = sub.add_parser("forkserver", help="(internal) the process `recover launch` forks its workers from")
    p.add_argument("--fd", type=int, required=True, help="the launcher's socket")
    p.add_argument("--room", default="", help="room for a forked worker's command line")
    p.set_defaults(func=run)
