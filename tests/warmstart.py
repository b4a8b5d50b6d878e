"""The suite's ``recover`` commands forked from a warm interpreter instead of started as new ones.

A ``python -m recover launch`` pays ~4 CPU-s before its job does anything: its own imports (~0.6 s) and its fork
server's (torch, the compiler stack a first optimizer step imports, recover's worker: ~3 s). The suite starts
hundreds of them on 2 cores. This module does for the suite what :mod:`recover.launch.forkserver` does for a
job's workers: one warm interpreter per test process (the *zygote*: this file run as a script) imports all of
that once, and each ``recover`` command of a test is a fork of it, set up as a new one would be.

Contract:
- :func:`popen` (and :func:`run`, as :func:`subprocess.run`) takes :class:`subprocess.Popen`'s arguments. For
  ``[sys.executable, "-m", "recover", ...]`` it returns a :class:`Warm` (a ``Popen`` whose child the zygote
  forked: ``pid``, pipes in text or bytes, ``communicate``, ``wait``, ``poll``, signals and timeouts as Popen's);
  for anything else, for an environment that changes what an interpreter reads as it starts (:data:`AT_START`),
  with ``fresh=True``, or where ``RECOVER_TEST_FRESH=1`` is set, a plain ``Popen``.
- The forked command runs with exactly the request's argument list, environment (``os.environ``; ``/proc/PID/
  environ`` shows the zygote's), working directory, standard streams and session (``start_new_session``), the
  Python generators reseeded, default signal dispositions, no descriptor of the zygote's, and its own command
  line in ``ps`` (``python -m recover ARGS``). It ends as ``python -m recover`` ends (``sys.exit``, the
  interpreter's teardown); the zygote reaps it and hands its exit status (``-N`` for signal N) to the test.
- A ``recover launch`` (not a script job, not ``--no-fork-server``) also gets its fork server forked from the
  zygote's warm state, a child of the launcher that dies with it, handed over in ``RECOVER_FORK_SERVER``
  (:func:`recover.launch.forkserver.start` adopts it, instead of starting a ``recover forkserver`` that imports
  for 3 s). From there on it serves the job's coordinator and workers exactly as it does in a user's job.
- What this does not exercise is a new interpreter's start: the tests about it (the fork server started and its
  fallbacks, ``tests/dist/test_forkserver.py``; a SIGKILLed launcher's processes; the plots of the reference run)
  start theirs with ``fresh=True`` or a plain ``Popen``, and ``RECOVER_TEST_FRESH=1 make test`` runs the whole
  suite that way.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
FRESH_ENV = "RECOVER_TEST_FRESH"
ROOM = 8192
"""Bytes of the zygote's command line kept for a forked command's (what ``ps`` shows of it)."""
_PRELOAD = ("recover.cli", "recover.launch.launcher", "recover.launch.forkserver", "recover.train.processes.worker",
            "torch._dynamo", "torch.distributed.checkpoint", "recover.coord.server", "recover.observe.plots")


# ---- the test's side ----------------------------------------------------------------------------------------


class _Zygote:
    """This test process's zygote: started at the first request, ended with the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] | None = None

    def env(self) -> dict[str, str]:
        """The environment the zygote starts (or started) with: the suite's (``subprocess_env``) as it was at the
        first request, whatever a test changed in its own since."""
        if self._env is None:
            from conftest import subprocess_env

            self._env = subprocess_env()
        return self._env

    def request(self, msg: dict[str, Any], fds: list[int]) -> socket.socket:
        """Sends one request (with the child's standard streams ``fds``); returns the socket on which the
        zygote answers its PID, then its exit status."""
        with self._lock:
            if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
                self.close()  # a zygote that died is replaced
                self._start()
            assert self._sock is not None
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                socket.send_fds(self._sock, [json.dumps(msg).encode()], [theirs.fileno(), *fds])
            finally:
                theirs.close()
            return mine

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen([sys.executable, str(HERE), str(theirs.fileno()), "--room", " " * ROOM],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, env=self.env(), start_new_session=True)
        theirs.close()
        mine.settimeout(120)
        ready = mine.recv(4096)
        mine.settimeout(None)
        if ready != b"ready":
            raise RuntimeError(f"the test zygote did not start (exit {self._proc.poll()}); see the test's stderr")
        self._sock = mine

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # it exits when it reads the end
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


ZYGOTE = _Zygote()


class Warm(subprocess.Popen):  # type: ignore[type-arg]
    """A :class:`subprocess.Popen` whose child is forked by the zygote (see the module docstring)."""

    _status: socket.socket

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int, *rest: Any) -> None:
        if subprocess.Popen._execute_child is not _EXECUTE_CHILD:  # the unit tier's guard (it raises): no process
            return subprocess.Popen._execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                            startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                                            errread, errwrite, *rest)
        assert not shell and preexec_fn is None and not pass_fds, "a warm start takes none of these"
        session = rest[-2] if sys.version_info >= (3, 11) else rest[-1]  # start_new_session (then process_group)
        streams = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
        request = {"argv": [str(a) for a in list(args)[3:]], "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd()), "session": bool(session)}
        try:
            self._status = ZYGOTE.request(request, streams)
            self._status.settimeout(60)
            reply = json.loads(self._status.recv(4096) or b"{}")
            self._status.settimeout(None)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if "pid" not in reply:
            raise OSError(f"the test zygote could not fork `recover {' '.join(request['argv'])}`: {reply}")
        self.pid = int(reply["pid"])
        self._child_created = True

    def _status_now(self, timeout: float | None) -> int | None:
        """The exit status if the zygote has sent it within ``timeout`` seconds (0: now)."""
        if not select.select([self._status], [], [], timeout)[0]:
            return None
        msg = self._status.recv(4096)
        self._status.close()
        if not msg:
            raise RuntimeError(f"the test zygote ended before `{' '.join(map(str, self.args))}` did")
        return int(json.loads(msg)["rc"])

    def _internal_poll(self, _deadstate: Any = None, **_kwargs: Any) -> int | None:
        if self.returncode is None and self._status.fileno() != -1:
            self.returncode = self._status_now(0)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            code = self._status_now(timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = code
        return self.returncode


_EXECUTE_CHILD = subprocess.Popen._execute_child


AT_START = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "MALLOC_", "TORCH", "CUDA", "NCCL", "GLOO")
"""Prefixes of the variables an interpreter, torch or a native library reads as it starts or imports (a
``sitecustomize`` on ``PYTHONPATH``, thread pools, allocators): a fork of the zygote would not see a change to
one of them, so a command whose environment changes one starts afresh."""


def _started_with(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AT_START)}


def warm(cmd: list[Any], env: dict[str, str] | None = None, fresh: bool = False) -> bool:
    """Whether :func:`popen` forks ``cmd`` (with environment ``env``, None: this process's) from the zygote."""
    return (not fresh and os.environ.get(FRESH_ENV, "") in ("", "0") and sys.platform.startswith("linux")
            and [str(c) for c in cmd[:3]] == [sys.executable, "-m", "recover"]
            and _started_with(dict(os.environ if env is None else env)) == _started_with(ZYGOTE.env()))


def popen(cmd: list[Any], fresh: bool = False, **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **kwargs)``, forked from the zygote where :func:`warm` says so."""
    return Warm(cmd, **kwargs) if warm(cmd, kwargs.get("env"), fresh) else subprocess.Popen(cmd, **kwargs)


def run(cmd: list[Any], fresh: bool = False, timeout: float | None = None, check: bool = False,
        capture_output: bool = False, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(cmd, ...)`` through :func:`popen` (on a timeout the process is killed, then waited for)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with popen(cmd, fresh, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ---- the zygote's side --------------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Forks a child per request and reports each child's end; returns the request in a child (None here once
    the test process is gone)."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)  # and each child's pidfd, with (pid, its status socket)
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child ended
                pid, status = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, code = os.waitpid(pid, 0)
                try:
                    status.send(json.dumps({"rc": os.waitstatus_to_exitcode(code)}).encode())
                except OSError:
                    pass
                status.close()
                continue
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
            if not msg:
                return None
            request = json.loads(msg)
            status = socket.socket(fileno=fds[0])
            pid = os.fork()
            if pid == 0:
                for other in sel.get_map().values():
                    if other.data is not None:
                        os.close(other.fd)
                        other.data[1].close()
                sel.close()
                sock.close()
                status.close()
                _become(request, fds[1:])
                return request
            for fd in fds[1:]:
                os.close(fd)
            status.send(json.dumps({"pid": pid}).encode())
            sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, status))


def _become(request: dict[str, Any], streams: list[int]) -> None:
    """In the forked child: the request's session, streams, environment, directory, seeds and command line."""
    from recover.forking import reseed, retitle

    if request["session"]:
        os.setsid()
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in streams:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    reseed()
    import recover

    sys.argv = [str(Path(recover.__file__).parent / "__main__.py"), *request["argv"]]  # as `python -m recover`
    sys.path[0] = os.getcwd()  # as `python -m` puts it (the zygote's is this file's folder)
    retitle([sys.executable, "-m", "recover", *request["argv"]])


def _fork_server() -> None:
    """In a forked ``recover launch``: forks its fork server from this warm state and hands it over
    (``RECOVER_FORK_SERVER``). In the server's own forks (the job's workers) it raises ``SystemExit`` with the
    worker's exit status, as ``python -m recover`` ends."""
    from recover.cli import main
    from recover.forking import retitle
    from recover.launch.forkserver import HANDED_ENV
    from recover.lifeline import die_with

    launcher = os.getpid()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        mine.close()
        die_with(launcher)
        os.setsid()
        argv = ["forkserver", "--fd", str(theirs.fileno())]
        retitle([sys.executable, "-m", "recover", *argv])
        sys.exit(main(argv))  # the server ends in os._exit once served; a worker it forks ends here
    theirs.close()
    os.environ[HANDED_ENV] = f"{mine.detach()}:{pid}"


def _zygote(fd: int) -> None:
    import gc
    import importlib

    from recover.lifeline import die_with

    die_with(os.getppid())  # the test process's death ends it (its children run on, as Popen's would)
    for name in _PRELOAD:
        importlib.import_module(name)
    from recover.forking import unsafe

    gc.freeze()  # the imports' objects live as long as any fork: no child's collections walk (and copy) them
    why = unsafe()
    sock = socket.socket(fileno=fd)
    if why is not None:
        print(f"the test zygote cannot fork: {why}", file=sys.stderr)
        return
    sock.send(b"ready")
    request = _serve(sock)
    if request is None:
        os._exit(0)
    argv = request["argv"]
    if argv[:1] == ["launch"] and "--" not in argv and "--no-fork-server" not in argv:
        _fork_server()
    from recover.cli import main

    sys.exit(main(argv))


if __name__ == "__main__":
    _zygote(int(sys.argv[1]))
