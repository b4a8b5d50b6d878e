"""``--freeze R@STEP:PHASE``: SIGSTOP, the whole process stops for good (a frozen host): no heartbeats,
no progress, its connections open."""

from __future__ import annotations

import signal

from recover.faults.kinds.kill import Stop
from recover.faults.registry import register


@register
class Freeze(Stop):
    name = "freeze"
    help = "SIGSTOP: the whole process stops for good (a frozen host)"
    order = 2
    flag = "--freeze"
    usage = "SIGSTOP replica R for good at STEP and PHASE ({help}); repeatable"
    report = "freeze"
    signal = getattr(signal, "SIGSTOP", signal.SIGTERM)
