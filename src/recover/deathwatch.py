"""A child's death seen by its parent at once, before the kernel has torn the child down.

A SIGKILLed process's sockets close only once the kernel has unmapped all its memory (``exit_mm`` runs
before ``exit_files``): for a training process with torch loaded that is 25-40 ms after the kill, during
which its peers see nothing. The kernel does release a dead thread's robust mutexes first (the robust
futex list is walked as the thread leaves its memory map, before the map is torn down), so a parent
blocked on a robust mutex its child holds wakes within microseconds of the child's death.

Contract (Linux with glibc's robust process-shared mutexes; elsewhere :func:`supported` is false and
nothing here does anything):
- The parent makes one :class:`Watch` per child before starting it: a mutex in anonymous shared memory
  (``memfd_create``), handed to the child as a file descriptor (``pass_fds``) named by :data:`ENV` in its
  environment (:meth:`Watch.env`); :func:`popen` starts a child with one.
- The child calls :func:`hold` first thing, from its main thread (a robust mutex belongs to the thread that
  locked it): it maps the memory and locks the mutex for its whole life. Before any exit it means (a
  clean end, a fence, a stop) it calls :func:`release` (the interpreter's normal exit does too): only a
  death it did not choose (a signal, ``os._exit``, a crash in native code) leaves the mutex held.
- :meth:`Watch.start` runs a daemon thread that waits for the child to hold the mutex, then blocks on it:
  when the child dies holding it, ``on_death`` is called once in that thread (it must be quick and
  thread-safe); when the child released it, or ended before it held it, nothing is called.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ENV = "RECOVER_DEATHWATCH_FD"
_SIZE = 128  # a pthread_mutex_t is 40 bytes on x86-64, 48 on aarch64
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_HOLD_POLL_S = 0.005
"""How often a watcher looks whether its child holds the mutex yet."""

_held: tuple[mmap.mmap, int] | None = None  # the child's mapping and its mutex's address


def _pthread() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return None
    for name in (None, ctypes.util.find_library("pthread")):
        try:
            lib = ctypes.CDLL(name, use_errno=True)  # calls release the GIL: a watcher blocks alone
            for fn in ("pthread_mutexattr_setrobust", "pthread_mutex_consistent", "pthread_mutex_trylock"):
                getattr(lib, fn)
            return lib
        except (OSError, AttributeError):
            continue
    return None


_LIB = _pthread()


def supported() -> bool:
    """Whether this system has what a watch needs (Linux, ``memfd_create``, robust mutexes)."""
    return _LIB is not None


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class Watch:
    """One child's death watch (see the module docstring). ``fd`` is what the child gets (``pass_fds``)."""

    def __init__(self) -> None:
        assert _LIB is not None, "deathwatch.supported() is false here"
        self.fd = os.memfd_create("recover-deathwatch", 0)
        os.ftruncate(self.fd, _SIZE)
        self._map = mmap.mmap(self.fd, _SIZE)
        self._mutex = _address(self._map)
        attr = ctypes.create_string_buffer(64)
        _LIB.pthread_mutexattr_init(attr)
        _LIB.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)
        _LIB.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)
        if _LIB.pthread_mutex_init(ctypes.c_void_p(self._mutex), attr) != 0:
            raise OSError("pthread_mutex_init failed for a death watch")

    def env(self) -> dict[str, str]:
        """What the child's environment carries (the descriptor's number, which ``pass_fds`` keeps)."""
        return {ENV: str(self.fd)}

    def start(self, alive: Callable[[], bool], on_death: Callable[[], None]) -> None:
        """Watches from a daemon thread; ``alive()`` says whether the child process still runs (it is asked
        only until the child holds the mutex). Close the parent's copy of :attr:`fd` once the child started."""
        threading.Thread(target=self._watch, args=(alive, on_death), name="recover-deathwatch", daemon=True).start()

    def close_fd(self) -> None:
        """The parent's descriptor (the child has its own once started; the mapping stays)."""
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _watch(self, alive: Callable[[], bool], on_death: Callable[[], None]) -> None:
        assert _LIB is not None
        mutex = ctypes.c_void_p(self._mutex)
        while True:
            rc = _LIB.pthread_mutex_trylock(mutex)
            if rc == errno.EBUSY:  # the child holds it: wait for its release or its death
                rc = _LIB.pthread_mutex_lock(mutex)
                if rc == errno.EOWNERDEAD:
                    on_death()
                return
            if rc == errno.EOWNERDEAD:  # it died holding it between two looks
                on_death()
                return
            if rc == 0:
                _LIB.pthread_mutex_unlock(mutex)
            if not alive():
                return  # it ended before it ever held the mutex: its exit is seen the usual way
            time.sleep(_HOLD_POLL_S)


def popen(cmd: list[str], on_death: Callable[[int], None], env: dict[str, str] | None = None,
          start: Callable[..., Any] = subprocess.Popen, **kwargs: Any) -> Any:
    """``start(cmd, env=env, **kwargs)`` (:class:`subprocess.Popen`, or anything that takes its ``env`` and
    ``pass_fds`` and returns an object with its ``pid`` and ``poll``) with a watch where supported:
    ``on_death(pid)`` is called from the watch's thread when the child dies holding it (the child calls
    :func:`hold`)."""
    watch = Watch() if supported() else None
    if watch is None:
        return start(cmd, env=env, **kwargs)
    proc = start(cmd, env={**(os.environ if env is None else env), **watch.env()}, pass_fds=(watch.fd,), **kwargs)
    watch.close_fd()
    watch.start(lambda: proc.poll() is None, lambda: on_death(proc.pid))
    return proc


def hold() -> None:
    """In a child started with a watch (:data:`ENV` set): hold its mutex until :func:`release` or death.
    Without one, or where unsupported, nothing."""
    global _held
    text = os.environ.pop(ENV, None)  # not inherited by this process's own children
    if text is None or _LIB is None or _held is not None:
        return
    try:
        fd = int(text)
        buffer = mmap.mmap(fd, _SIZE)
        os.close(fd)
    except (ValueError, OSError):
        return
    address = _address(buffer)
    if _LIB.pthread_mutex_lock(ctypes.c_void_p(address)) in (0, errno.EOWNERDEAD):
        _held = (buffer, address)
        atexit.register(release)  # the interpreter's own exit is a chosen one too


def release() -> None:
    """The child's exit is its own: its parent is not to take it for a death."""
    global _held
    if _held is not None and _LIB is not None:
        _LIB.pthread_mutex_unlock(ctypes.c_void_p(_held[1]))
        _held = None
