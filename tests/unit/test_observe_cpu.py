"""recover's own background threads' CPU (recover.observe.cpu): read from each thread's own CPU clock, kept
after the thread ends, and blind to threads that did not register."""

from __future__ import annotations

import threading
import time

from recover.observe import cpu


def _spin(seconds: float, stop: threading.Event | None = None) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if stop is not None:
        stop.wait(10)


def test_a_registered_threads_cpu_is_counted_and_kept_after_it_ends() -> None:
    before = cpu.background_s()
    stop = threading.Event()
    mine = threading.Thread(target=_spin, args=(0.05, stop), daemon=True)
    mine.start()
    cpu.register(mine)
    other = threading.Thread(target=_spin, args=(0.2,), daemon=True)  # not recover's: never counted
    other.start()
    other.join()
    deadline = time.monotonic() + 10
    while cpu.background_s() - before < 0.045 and time.monotonic() < deadline:
        time.sleep(0.01)
    running = cpu.background_s() - before
    assert 0.045 <= running < 0.15, running
    stop.set()
    mine.join()
    assert cpu.background_s() - before >= running  # the ended thread keeps what it spent
