"""``--fail R@STEP:PHASE``: SIGKILL, as abrupt as a lost GPU or host (no cleanup, no goodbye to the peers).

Also the base of the kinds that stop a process at a phase point (hang, freeze): they share the flag form
``R@STEP[:PHASE]``, the ``kill`` event and the detection (the coordinator names the replica).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from recover.faults.registry import FailureSpec, FaultKind, Hook, register
from recover.faults.schedule import parse_failure
from recover.names import Event, Phase


class Stop(FaultKind):
    """A fault that ends the replica's work at a phase point: its event is ``kill``."""

    metavar = "R@STEP:PHASE"
    event = Event.KILL

    def parse(self, text: str) -> FailureSpec:
        return parse_failure(text, fault=self.name)

    def record(self, spec: FailureSpec, perturbation: Hook) -> tuple[Event, dict[str, Any]]:
        return self.event, {"rank": perturbation.rank, "step": spec.step, "phase": spec.phase,
                            "fault": self.name, "pid": os.getpid()}

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.stop(perturbation)

    def stop(self, perturbation: Hook) -> None:
        """Stops the process (or its training thread) for good."""
        assert self.signal is not None
        perturbation.kill(os.getpid(), self.signal)


@register
class Kill(Stop):
    name = "kill"
    help = "SIGKILL: the process dies at once, as with a lost GPU or host"
    order = 0
    flag = "--fail"
    usage = f"kill replica R at STEP (0-based) and PHASE; repeatable. Phases: {Phase.describe()}"
    report = "crash"
    signal = getattr(signal, "SIGKILL", signal.SIGTERM)
