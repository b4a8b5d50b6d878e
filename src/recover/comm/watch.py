"""Waiting without blocking on a dead peer: helpers shared by the fault-tolerant group.

Contract:
  * :class:`Waiter`: a per-group daemon thread that blocks in ``work.wait()`` (GIL released) and
    sets an event when a batch of works is done, so the caller sleeps on one event that both the
    works and the coordinator's notices set (no polling; gloo only: NCCL's ``wait()`` does not
    block the host).
  * :func:`run_watched`: runs a blocking call (a rendezvous, an NCCL shrink) on a helper thread
    while watching ``client.failure_notice(g)``; a thread abandoned that way is parked.
  * :func:`peer_failure`: reports (if asked), waits for the coordinator's next generation and
    builds ``PeerFailure(g, dead)`` naming exactly the members of g missing from it.
Invariant: none of these ever waits for a backend timeout on the caller's thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from recover.comm.graveyard import Graveyard
from recover.coord.client import CoordinatorClient, CoordinatorLost
from recover.errors import PeerFailure

POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3


class Waiter:
    """One daemon thread per group that blocks in ``work.wait()`` (GIL released) for each batch of
    works, in order, then sets the batch's event. If a work never completes (a dead peer), the
    thread stays blocked until the backend times it out; the group is retired long before."""

    def __init__(self, generation: int) -> None:
        self._queue: queue.SimpleQueue[tuple[list[Any], threading.Event] | None] = queue.SimpleQueue()
        self._generation = generation
        self._thread: threading.Thread | None = None

    def watch(self, works: list[Any], done: threading.Event) -> None:
        self._queue.put((list(works), done))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"recover-waiter-gen{self._generation}",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """The thread exits once it is done with what it was given (at once if idle)."""
        if self._thread is not None:
            self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            works, done = item
            for w in works:
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - the caller's thread re-raises it
                    break
            done.set()
            del works, done, item


def peer_failure(client: CoordinatorClient, generation: int, reason: str, report: bool,
                 timeout_s: float, timed_out: bool = False, suspects: list[int] | None = None) -> PeerFailure:
    """The PeerFailure for ``generation``, once the coordinator has formed the next generation."""
    if report and not client.failure_notice(generation):
        client.report_failure(generation, suspects or (), timed_out=timed_out)
    client.wait_for_generation(generation, timeout_s)
    return PeerFailure(generation, client.dead_since(generation), reason)


def run_watched(client: CoordinatorClient, g: int, yard: Graveyard, timeout_s: float, fn: Any,
                what: str) -> Any | None:
    """Runs ``fn`` on a helper thread, watching for notices. Returns its result, None if it raised;
    raises PeerFailure / CoordinatorLost (parking the thread) if generation ``g`` fails meanwhile."""
    box: dict[str, Any] = {}

    def run(out: dict[str, Any]) -> None:  # an argument, not a closure cell: ``del box`` below keeps it
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=run, args=(box,), name=f"recover-{what}-gen{g}", daemon=True)
    t.start()
    pause = POLL_MIN_S
    while t.is_alive():
        if client.failure_notice(g) or client.lost is not None:
            yard.park(g, t, box)
            del t, box  # no reference may outlive this frame in a traceback
            if client.lost is not None:
                raise CoordinatorLost(f"coordinator lost during {what} of generation {g}: {client.lost}")
            raise peer_failure(client, g, f"generation {g} failed during {what}", False, timeout_s)
        t.join(pause)
        pause = min(pause * 1.5, POLL_MAX_S)
    return box.get("value")
