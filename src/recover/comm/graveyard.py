"""Where broken (or retired) process groups go to die, off the hot path.

Contract: ``park(generation, *objs)`` returns at once. A daemon reaper thread later releases the
objects one at a time: it joins a parked thread (a group construction abandoned mid-rendezvous),
aborts objects parked with ``abort=True`` (NCCL communicators, where abort unblocks pending work),
then drops the references, so a process-group destructor that blocks on a stuck operation (gloo:
until that operation's timeout, ~30 s) blocks only the reaper, which holds no lock the caller needs.
Measured on torch 2.13 CPU: such a destructor releases the GIL, so the caller keeps running.

Invariant: nothing parked is ever used again; parking is the only way a group leaves service.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class Graveyard:
    """One per process (shared by the chain of generations that ``next_generation`` builds)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, tuple[Any, ...], bool]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.parked = 0
        self.released = 0

    def park(self, generation: int, *objs: Any, abort: bool = False) -> None:
        """Hands ``objs`` over for release; the caller must drop its own references."""
        self._queue.put((generation, objs, abort))
        with self._lock:
            self.parked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._reap, name="recover-graveyard", daemon=True)
                self._thread.start()

    def _reap(self) -> None:
        while True:
            _, objs, abort = self._queue.get()
            obj: Any = None
            for obj in objs:
                if isinstance(obj, threading.Thread):
                    obj.join()
                elif abort and hasattr(obj, "abort"):
                    try:
                        obj.abort()
                    except Exception:  # noqa: BLE001 - an already-broken communicator may refuse
                        pass
            obj = objs = None  # the destructors run here, on the reaper
            with self._lock:
                self.released += 1
