"""``--hang R@STEP:PHASE``: the training thread stops for good; the process and its heartbeats go on, so
only its lack of progress gives it away (the coordinator's hang rule). From outside (``--random-failures``)
it is :data:`HANG_SIGNAL`, which a worker turns into the same hang with :func:`hang_on_signal`."""

from __future__ import annotations

import signal
import threading

from recover.faults.kinds.kill import Stop
from recover.faults.registry import Hook, register

HANG_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGTERM)
"""Sent by the launcher's random faults: the worker's training (main) thread stops for good."""


def hang_on_signal() -> None:
    """Makes :data:`HANG_SIGNAL` stop this process's main thread for good, its other threads (heartbeats,
    watchdog) running on: a hang injected from outside. Call it from the main thread."""
    signal.signal(HANG_SIGNAL, lambda signum, frame: threading.Event().wait())


@register
class Hang(Stop):
    name = "hang"
    help = "the training thread stops for good; the process and its heartbeats stay alive"
    order = 1
    flag = "--hang"
    usage = ("stop replica R's training thread for good at STEP and PHASE ({help}); it is found by its lack "
             "of progress (fault_tolerance.hang_timeout_s); repeatable")
    report = "hang"
    signal = HANG_SIGNAL

    def stop(self, perturbation: Hook) -> None:
        perturbation.hang()
