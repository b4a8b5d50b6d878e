"""Where broken (or retired) process groups go to die, off the hot path.

Contract: ``park(generation, *objs, abort=False)`` returns at once with an event that is set once the
aborts of ``objs`` have returned (at once when there is nothing to abort). Two daemon threads do the
rest, so that neither kind of work waits behind the other:
  * the aborter calls ``abort()`` on each object parked with ``abort=True`` (NCCL communicators: the
    abort unblocks pending work and frees the SMs and memory its kernels hold) as soon as it is
    parked, in parking order; it waits for nothing else, so an abort never queues behind a
    destructor or behind an abandoned thread;
  * the releaser drops the references. A parked batch is dropped once the releaser holds the last
    reference to every object in it (CPython reference counts), so a process-group destructor that
    blocks on a stuck operation (gloo: until that operation's timeout, ~30 s) blocks only the
    releaser, never the caller. Measured on torch 2.13 CPU: such a destructor releases the GIL, so
    the caller keeps running. Batches wait for their owners side by side: one whose owner lets go
    late holds up no other; after ``SOLE_OWNER_WAIT_S`` a batch is dropped regardless.
A parked thread (a group construction abandoned mid-rendezvous) is a daemon: it is never joined or
waited for, only its reference is dropped (a running thread keeps itself alive; what it holds is
released on it, off the caller's path, when it ends).

``settle(bound_s)`` (a process's exit, before the interpreter tears down) waits, at most ``bound_s``,
until each batch parked so far is released or skipped: skipped once it has waited ``MOMENT_S`` for its
sole ownership. The caller's own reference is gone by then (see below); whatever still holds the batch
holds it for long (a parked thread and the box it fills; seen after a hang: a gloo group and its two
works, co-owned until the backend's timeout, which cost each script replica 10 s at exit), or for good.
A skipped batch stays referenced by the releaser, a daemon thread, so the interpreter's teardown does not
free it.

Invariant: nothing parked is ever used again; parking is the only way a group leaves service.
Why the releaser waits to be the sole owner: a caller that parks a group still has it in a local
variable for a moment, and if the releaser dropped its reference first, the caller's own release
would run the blocking destructor on the hot path (seen: a survivor stalled for the full 60 s
backend timeout).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

SOLE_OWNER_WAIT_S = 120.0
OWNER_POLL_S = 0.005
MOMENT_S = 1.0
"""How long a caller may still hold what it parked; a batch co-owned longer is skipped by ``settle``."""


class _Batch:
    """Objects parked together, held by the releaser until it is their sole owner."""

    def __init__(self, objs: list[Any]) -> None:
        self.objs = objs
        self.parked_at = time.monotonic()
        self.deadline = self.parked_at + SOLE_OWNER_WAIT_S

    def releasable(self) -> bool:
        # references we hold: the list slot and getrefcount's own argument (no loop variable)
        objs = self.objs
        return time.monotonic() >= self.deadline or all(sys.getrefcount(objs[i]) <= 2 for i in range(len(objs)))


class Graveyard:
    """One per process (shared by the chain of generations that ``next_generation`` builds)."""

    def __init__(self) -> None:
        self._to_abort: queue.SimpleQueue[tuple[tuple[Any, ...], bool, threading.Event]] = queue.SimpleQueue()
        self._to_release: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        self._pending: list[_Batch] = []  # with the releaser, not yet released (under the lock)
        self._lock = threading.Lock()
        self._started = False
        self.parked = 0
        self.aborted = 0
        self.released = 0

    def park(self, generation: int, *objs: Any, abort: bool = False) -> threading.Event:
        """Hands ``objs`` over for release (after ``abort()`` on each, with ``abort``); the caller must
        drop its own references. The returned event is set once those aborts have returned."""
        done = threading.Event()
        self._to_abort.put((objs, abort, done))
        with self._lock:
            self.parked += 1
            if not self._started:
                self._started = True
                for target, name in ((self._abort_loop, "recover-graveyard-abort"),
                                     (self._release_loop, "recover-graveyard")):
                    threading.Thread(target=target, name=name, daemon=True).start()
        return done

    def settle(self, bound_s: float) -> bool:
        """Waits, at most ``bound_s``, until every batch parked so far is released or skipped (co-owned for
        ``MOMENT_S``; see the module docstring). Returns whether it settled within the bound."""
        deadline = time.monotonic() + bound_s
        while True:
            with self._lock:
                now = time.monotonic()
                skipped = sum(now - batch.parked_at >= MOMENT_S for batch in self._pending)
                if self.released + skipped >= self.parked:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(OWNER_POLL_S)

    def _abort_loop(self) -> None:
        while True:
            parked, abort, done = self._to_abort.get()
            objs = [o for o in parked if not isinstance(o, threading.Thread)]  # threads: dropped here
            del parked
            if abort:
                _abort_each(objs)
            done.set()
            self._to_release.put(_Batch(objs))
            del objs, done
            if abort:
                with self._lock:
                    self.aborted += 1

    def _release_loop(self) -> None:
        while True:
            with self._lock:
                waiting = bool(self._pending)
            try:
                batch = self._to_release.get(timeout=OWNER_POLL_S if waiting else None)
                with self._lock:
                    self._pending.append(batch)
                del batch
            except queue.Empty:
                pass
            with self._lock:
                pending = list(self._pending)
            for batch in pending:
                if batch.releasable():
                    batch.objs.clear()  # the destructors run here, on the releaser, outside the lock
                    with self._lock:
                        self._pending.remove(batch)
                        self.released += 1
            del pending


def _abort_each(objs: list[Any]) -> None:
    for i in range(len(objs)):  # no loop variable: it would be one more reference to the object
        if hasattr(objs[i], "abort"):
            try:
                objs[i].abort()
            except Exception:  # noqa: BLE001 - an already-broken communicator may refuse
                pass
