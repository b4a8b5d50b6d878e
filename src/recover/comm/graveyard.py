"""Where broken (or retired) process groups go to die, off the hot path.

Contract: ``park(generation, *objs)`` returns at once. A daemon reaper thread later releases the
objects one at a time: it joins a parked thread (a group construction abandoned mid-rendezvous),
aborts objects parked with ``abort=True`` (NCCL communicators, where abort unblocks pending work),
then drops the references, so a process-group destructor that blocks on a stuck operation (gloo:
until that operation's timeout, ~30 s) blocks only the reaper, which holds no lock the caller needs.
Measured on torch 2.13 CPU: such a destructor releases the GIL, so the caller keeps running.

The reaper releases an object only once it holds the last reference (CPython reference counts),
so the destructor cannot end up running on the caller's thread when the caller's locals go away.

Invariant: nothing parked is ever used again; parking is the only way a group leaves service.
The reaper drops an object only once it holds the last reference: a caller that parks a group
still has it in a local variable for a moment, and if the reaper dropped its reference first,
the caller's own release would run the blocking destructor on the hot path (seen: a survivor
stalled for the full 60 s backend timeout).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

SOLE_OWNER_WAIT_S = 120.0


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
            _, parked, abort = self._queue.get()
            objs = list(parked)
            del parked
            self._wait_sole_owner(objs)
            for obj in objs:
                if isinstance(obj, threading.Thread):
                    obj.join()
                elif abort and hasattr(obj, "abort"):
                    try:
                        obj.abort()
                    except Exception:  # noqa: BLE001 - an already-broken communicator may refuse
                        pass
            obj = None
            objs.clear()  # the destructors run here, on the reaper
            with self._lock:
                self.released += 1

    @staticmethod
    def _wait_sole_owner(objs: list[Any]) -> None:
        """Waits until the parker has dropped its references (it does so right after ``park``), so
        that the last reference, and with it a possibly blocking destructor, is the reaper's."""
        deadline = time.monotonic() + SOLE_OWNER_WAIT_S
        while time.monotonic() < deadline:
            # references we hold: the list slot and getrefcount's own argument (no loop variable)
            if all(sys.getrefcount(objs[i]) <= 2 for i in range(len(objs))):
                return
            time.sleep(0.005)


def _wait_until_sole_owner(objs: tuple[Any, ...]) -> None:
    """Waits (bounded) until the tuple ``objs`` holds the only reference to each object in it."""
    deadline = time.monotonic() + SOLE_OWNER_WAIT_S
    # references: the tuple, the loop variable and getrefcount's own argument
    while any(sys.getrefcount(o) > 3 for o in objs) and time.monotonic() < deadline:
        time.sleep(0.005)
