"""Asynchronous checkpoints written by a process of their own, off the training path.

A save in a thread of the training process (DCP's ``async_save``) costs training more than its staging
copy: DCP's planning, serialisation and the manifest's bookkeeping are Python that holds the GIL while
the training thread wants it (a step in which a save began took 1.24x the others on CPU). Here the
training thread only copies the state into a shared-memory buffer; a writer process maps the same
buffer, writes it with DCP and commits it with the on-disk protocol of
:mod:`~recover.train.checkpoints.integrity`.

Contract:
- :func:`prefork`, called by a replica's process at its start while no other thread runs in it (a replica
  that will save periodically: :func:`~recover.train.checkpoints.checkpoint.prefork_writer`), forks the
  process from it: ready at once, no interpreter started, no import paid again on the training's cores. It
  looks like one started anew: its own command line, default signal dispositions, no descriptor of its
  parent's but the standard streams, and the kernel kills it with its parent (``PR_SET_PDEATHSIG``).
  Where forking is not safe (:func:`recover.forking.unsafe`) it does nothing. :func:`close_spare` ends one
  no :class:`Writer` took.
- :meth:`Writer.start` takes the forked process if there is one, else starts one (``python -m`` this module)
  and returns at once; that one is ready once it has imported what it writes with (seconds). The replica
  that saves starts it ahead of its first periodic save
  (:meth:`~recover.train.checkpoints.checkpoint.Checkpointer.prepare`), so a job that never saves
  periodically starts none. A process that dies before it is ready is not started again (one warning line).
- :meth:`Writer.takes` says whether the writer can take a state now: its process ready, every tensor a
  plain tensor, on a system with ``memfd_create``; when it cannot, the caller saves that state itself, in
  a thread (a due save never waits for a process to start), and a process that is not running is started.
- :meth:`Writer.submit` copies the state into a shared-memory buffer (``memfd_create``; a larger one when
  the state outgrew it, its descriptor sent with the request), the one cost on the training path, and
  returns a future resolved with the checkpoint's path once committed, or with the write's error (an
  ``OSError`` keeps its errno). The caller keeps at most one save in flight: the buffer is reused by the
  next one.
- The process imports at the caller's priority and writes below it (Linux's idle scheduling class, else
  ``nice`` + :data:`NICE`), one request at a time. It ends on :meth:`Writer.close`, when its socket closes,
  or within :data:`ORPHAN_POLL_S` of its parent's death (whatever it was writing then stays a ``.partial``
  directory: only a living replica commits). A process that dies fails the save in flight with a
  :class:`~recover.errors.CheckpointError`; the next save starts another.
- The bytes written equal those of a save from the training process: the same DCP call on the same
  values, so a checkpoint loads the same whichever wrote it.
"""

from __future__ import annotations

import importlib
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recover import forking
from recover.errors import CheckpointError
from recover.lifeline import die_with

NICE = 19
"""How much lower the writer's CPU priority is than training's where the idle class is not available."""
ORPHAN_POLL_S = 0.2
"""How often the writer checks that the process it writes for is alive."""
_ALIGN = 64
_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of a staged state lies in the buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def stageable(state: Any) -> bool:
    """Whether every tensor of ``state`` (nested dicts and lists) is a plain tensor and this system can share
    memory with a child by a file descriptor."""
    return hasattr(os, "memfd_create") and all(type(t) in (torch.Tensor, torch.nn.Parameter)
                                               for t in _tensors(state))


def _leaves(tree: Any, kind: type) -> list[Any]:
    """The leaves of ``tree`` (nested dicts, lists and tuples) that are ``kind``, depth first in order."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v, kind)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v, kind)]
    return []


def _tensors(state: Any) -> list[torch.Tensor]:
    return _leaves(state, torch.Tensor)


def _layout(state: Any, at: list[int]) -> Any:
    """``state`` with each tensor replaced by its :class:`_Slot` (``at[0]``: the next free offset)."""
    if isinstance(state, torch.Tensor):
        slot = _Slot(at[0], state.dtype, tuple(state.shape))
        at[0] += -(-state.numel() * state.element_size() // _ALIGN) * _ALIGN
        return slot
    if isinstance(state, dict):
        return {k: _layout(v, at) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return _same_kind(state, [_layout(v, at) for v in state])
    return state


def _same_kind(seq: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """``items`` as a sequence of ``seq``'s type (a named tuple's fields positionally)."""
    if isinstance(seq, tuple) and hasattr(seq, "_fields"):
        return type(seq)(*items)
    return type(seq)(items)


def _view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    nbytes = int(torch.Size(slot.shape).numel()) * torch.empty((), dtype=slot.dtype).element_size()
    return buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).view(slot.shape)


def _slots(skeleton: Any) -> list[_Slot]:
    """The slots of ``skeleton`` in the order :func:`_tensors` lists a state's tensors."""
    return _leaves(skeleton, _Slot)


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copies each source into its view, in one call where torch can (same device), else one by one."""
    if all(t.device.type == "cpu" for t in srcs) and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)


def _filled(skeleton: Any, buffer: torch.Tensor) -> Any:
    """The state again: each :class:`_Slot` of ``skeleton`` as a view of ``buffer``."""
    if isinstance(skeleton, _Slot):
        return _view(buffer, skeleton)
    if isinstance(skeleton, dict):
        return {k: _filled(v, buffer) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return _same_kind(skeleton, [_filled(v, buffer) for v in skeleton])
    return skeleton


class _Buffer:
    """Anonymous shared memory (``memfd_create``) mapped here, handed to the writer by its descriptor."""

    def __init__(self, size: int) -> None:
        self.size = max(size, _ALIGN)
        self.fd = os.memfd_create("recover-checkpoint", 0)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        os.close(self.fd)


def _send(sock: socket.socket, obj: Any, fd: int | None = None) -> None:
    """One message: its length, then its pickle; ``fd`` (a descriptor) rides on its first byte."""
    data = _HEADER.pack(len(payload := pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))) + payload
    sent = socket.send_fds(sock, [data], [fd]) if fd is not None else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(sock: socket.socket) -> tuple[Any, int | None]:
    """One message of :func:`_send` and the descriptor that came with it. Raises EOFError."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1)
    head += _exactly(sock, _HEADER.size - len(head)) if head else b""
    if len(head) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(head)
    return pickle.loads(_exactly(sock, size)), (fds[0] if fds else None)  # noqa: S301 - our own pair's


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Child:
    """One writer process, the socket pair between us and the save it is writing."""

    def __init__(self, proc: subprocess.Popen[bytes] | forking.Forked, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.ready = threading.Event()
        """Set once the process has imported what it writes with (a start takes seconds)."""
        self.mapped: _Buffer | None = None
        """The buffer the process has mapped (its descriptor went with a request)."""
        self.waiting: Future[Path] | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._read_replies, name="recover-ckpt-replies", daemon=True).start()

    @classmethod
    def started(cls) -> _Child:
        """A writer process started as a new interpreter (ready once it has imported torch and DCP)."""
        mine, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                                    pass_fds=(theirs.fileno(),))
        return cls(proc, mine)

    @classmethod
    def forked(cls) -> _Child | None:
        """A writer process forked from this one (ready at once), or None where forking is not safe now."""
        importlib.import_module("torch.distributed.checkpoint")  # what the child writes with, imported once
        from recover.train.checkpoints import integrity  # noqa: F401
        if forking.unsafe() is not None:
            return None
        mine, theirs = socket.socketpair()
        parent = os.getpid()
        args = [sys.executable, "-m", __name__, str(theirs.fileno()), str(parent)]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the writer: never returns into the code that forked it
            code = 1
            try:
                mine.close()
                code = _forked_main(theirs, parent, args)
            finally:
                os._exit(code)
        theirs.close()
        return cls(forking.Forked(args, pid), mine)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, request: dict[str, Any], buffer: _Buffer) -> Future[Path]:
        done: Future[Path] = Future()
        with self.lock:
            self.waiting = done
        try:
            _send(self.sock, {**request, "size": buffer.size}, buffer.fd if buffer is not self.mapped else None)
            self.mapped = buffer
        except OSError as exc:
            self._fail(f"could not be handed the save ({exc})")
        return done

    def close(self) -> None:
        """Ends the process after the request it is writing, if any (killed if it is still writing after 60 s)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)  # its end of requests
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()

    def _read_replies(self) -> None:
        """(thread) Resolves each save with its reply; fails the one in flight once the process is gone."""
        while True:
            try:
                reply, _ = _receive(self.sock)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            if reply.get("ready"):
                self.ready.set()
                continue
            with self.lock:
                done, self.waiting = self.waiting, None
            if done is not None and reply["ok"]:
                done.set_result(Path(reply["path"]))
            elif done is not None:
                done.set_exception(_error(reply))
        self._fail(f"ended ({_status(self.proc.wait())}) before the save was written")

    def _fail(self, what: str) -> None:
        with self.lock:
            done, self.waiting = self.waiting, None
        if done is not None and not done.done():
            done.set_exception(CheckpointError(f"the checkpoint writer process {what}"))


_spare: _Child | None = None
"""The writer forked ahead of the first save (:func:`prefork`), until a :class:`Writer` takes it."""


def prefork() -> bool:
    """Forks this process's writer now, while no other thread runs in it (at the start of a replica that will
    save asynchronously), so that the :class:`Writer` that starts one later takes it ready instead of starting a
    new interpreter (seconds of imports, on the training's cores). Returns whether it forked: not where forking
    is not safe (:func:`recover.forking.unsafe`), not without ``memfd_create``, not twice."""
    global _spare
    if _spare is None and hasattr(os, "memfd_create") and hasattr(os, "fork"):
        _spare = _Child.forked()
    return _spare is not None


def _take_spare() -> _Child | None:
    global _spare
    child, _spare = _spare, None
    if child is not None and not child.alive():
        child.close()
        return None
    return child


def close_spare() -> None:
    """Ends the forked writer no :class:`Writer` took (a replica that never saved asynchronously)."""
    child = _take_spare()
    if child is not None:
        child.close()


class Writer:
    """One replica's checkpoint writer (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: _Buffer | None = None
        self._views: tuple[list[_Slot], list[torch.Tensor]] | None = None
        """The layout of the last state staged and its tensors' views of the buffer."""
        self._child: _Child | None = None
        self._failed = False

    def start(self) -> None:
        """Starts the process unless it runs (or one died before it was ready: then this writer stays unused,
        with one warning line); returns at once, the process gets ready by itself."""
        child = self._child
        if self._failed or (child is not None and child.alive()):
            return
        if child is not None and not child.ready.is_set():
            print(f"recover: warning: the checkpoint writer process ended before it was ready "
                  f"({_status(child.proc.returncode)}; its lines are above); asynchronous checkpoints are "
                  "written by a thread of the training process instead", file=sys.stderr, flush=True)
            self._failed = True
            self.close()
            return
        self.close()
        self._child = _take_spare() or _Child.started()

    def takes(self, state: Any) -> bool:
        """Whether :meth:`submit` can take ``state`` now: the process is ready and every tensor a plain one.
        When the process does not run, it is started (:meth:`start`) and the caller saves this state itself."""
        if not stageable(state):
            return False
        self.start()
        return self._child is not None and self._child.alive() and self._child.ready.is_set()

    def submit(self, state: Any, partial: Path, final: Path, step: int, meta: dict[str, Any], keep: int,
               files: dict[str, bytes] | None) -> Future[Path]:
        """Copies ``state`` into the buffer (a larger one first when it does not fit) and asks the process to
        save it as ``step``'s checkpoint (``partial`` exists, empty); returns the future of its commit. Only
        after :meth:`takes` said yes."""
        assert self._child is not None
        at = [0]
        skeleton = _layout(state, at)
        slots = _slots(skeleton)
        if self._buffer is None or self._buffer.size < at[0]:
            self._views = None
            if self._buffer is not None:
                self._buffer.close()  # the process keeps its own mapping until the new one comes
            self._buffer = _Buffer(at[0])
        if self._views is None or self._views[0] != slots:  # the views of the last state's layout, if the same
            self._views = (slots, [_view(self._buffer.tensor, slot) for slot in slots])
        _copy(self._views[1], [t.detach() for t in _tensors(state)])
        return self._child.request({"skeleton": skeleton, "partial": str(partial), "final": str(final),
                                    "step": step, "meta": meta, "keep": keep, "files": files}, self._buffer)

    def close(self) -> None:
        """Ends the process (after the save it is writing, if any) and frees the buffer."""
        child, self._child = self._child, None
        if child is not None:
            child.close()
        self._views = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


def _status(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"status {code}"


def _error(reply: dict[str, Any]) -> BaseException:
    """The writer's error again, here: an ``OSError`` with its errno and file name, else a RuntimeError
    naming its type."""
    if reply.get("errno"):
        return OSError(reply["errno"], reply["message"], *([reply["filename"]] if reply.get("filename") else []))
    return RuntimeError(f"{reply['type']}: {reply['message']}")


# ---- the writer process ----------------------------------------------------------------------

def _lower_priority() -> None:
    """Linux's idle scheduling class (the writer runs on CPU time training leaves), else ``nice`` + NICE."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        os.nice(NICE)


def _watch_parent(parent: int) -> None:
    """(thread) Ends this process once the process it writes for is gone (its commit would race a restart)."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)


def _write(request: dict[str, Any], buffer: torch.Tensor) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    from recover.train.checkpoints.integrity import commit_save

    try:
        state = _filled(request["skeleton"], buffer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's "saving from one process" is intended
            dcp.save(state, checkpoint_id=request["partial"], no_dist=True)
        commit_save(Path(request["partial"]), Path(request["final"]), request["step"], request["meta"],
                    request["keep"], request["files"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # handed back to the replica, which reports it (DCP's wrapper is a BaseException)
        failures = getattr(exc, "failures", None)  # DCP's wrapper: rank -> (exception, traceback)
        if failures:
            first = next(iter(failures.values()))
            exc = first[0] if isinstance(first, tuple) else first
        return {"ok": False, "type": type(exc).__name__, "message": str(exc).strip().split("\n")[0][:300],
                "errno": getattr(exc, "errno", None), "filename": getattr(exc, "filename", None)}
    return {"ok": True, "path": request["final"]}


def _forked_main(sock: socket.socket, parent: int, args: list[str]) -> int:
    """The writer forked from its replica's process: made to look like one started as a new interpreter (its
    own command line, default signal dispositions, only its socket and standard streams open), then
    :func:`main`."""
    import gc

    gc.freeze()  # the parent's objects, garbage included, are never collected here (one could close an fd)
    die_with(parent)  # else the watching thread of :func:`main` still ends it
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = sock.detach()
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    forking.retitle(args)
    return main([str(fd), str(parent)])


def main(argv: list[str]) -> int:
    fd, parent = (int(a) for a in argv)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    importlib.import_module("torch.distributed.checkpoint")  # what every request needs, before saying ready
    from recover.train.checkpoints import integrity  # noqa: F401
    _lower_priority()  # imports at the caller's priority (ready sooner), writes below it
    buffer: torch.Tensor | None = None
    with socket.socket(fileno=fd) as sock:
        _send(sock, {"ready": True})
        while True:
            try:
                request, new_fd = _receive(sock)
            except EOFError:
                return 0
            if new_fd is not None:  # a new buffer: map it (the old mapping goes with the old tensor)
                buffer = torch.frombuffer(mmap.mmap(new_fd, request["size"]), dtype=torch.uint8)
                os.close(new_fd)
            assert buffer is not None, "a request without a buffer"
            _send(sock, _write(request, buffer))


if __name__ == "__main__":  # run as the module itself, not as __main__: the requests unpickle its _Slot
    from recover.train.checkpoints import writer

    sys.exit(writer.main(sys.argv[1:]))
