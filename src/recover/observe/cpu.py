"""CPU time of recover's own work in a replica process, apart from the step's compute.

Wall-clock overhead on a shared machine moves with the load; CPU seconds of the work itself barely do. So a
replica accounts its step in thread CPU time (``time.thread_time``, the training thread's clock): the whole
step, and within it the compute (forward and backward of its microbatches, their data included), the wait on
the reduction (the collective any data-parallel job runs) and the optimizer update. What is left is recover's
own work on the training thread: the plan, the copies into the reduction buffers, the commit vote and its
read of the totals and the fingerprint, the hooks. recover's background threads (the coordinator client's
heartbeats and reader, a replica's relay) register here with :func:`register`; :func:`background_s` is their
CPU time so far, read from each thread's own CPU clock (Linux: ``pthread_getcpuclockid``).

Contract: registering is free and never fails (a platform without per-thread clocks reports 0); the readings
are monotonic seconds; nothing here changes what a step computes."""

from __future__ import annotations

import threading
import time

_threads: list[threading.Thread] = []
_last: dict[int, float] = {}  # a thread's last reading: a thread that ended keeps what it spent
_lock = threading.Lock()


def register(thread: threading.Thread) -> None:
    """Counts ``thread`` (started) as recover's own background work."""
    with _lock:
        _threads.append(thread)


def background_s() -> float:
    """CPU seconds spent so far by the registered threads of this process."""
    with _lock:
        for t in _threads:
            if t.ident is not None and t.is_alive():
                try:
                    _last[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except (AttributeError, OSError):  # no per-thread clocks here, or the thread just ended
                    pass
        return sum(_last.values())
