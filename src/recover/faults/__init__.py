"""Failure schedules and injection by (replica, step, phase); random MTBF schedules.

The phases are :class:`recover.names.Phase`; ``PHASES`` is re-exported from there.
"""

from recover.faults.schedule import (
    PHASES,
    FailureSchedule,
    FailureSpec,
    FaultInjector,
    parse_failure,
    parse_slow,
    random_schedule,
)

__all__ = ["PHASES", "FailureSchedule", "FailureSpec", "FaultInjector", "parse_failure", "parse_slow",
           "random_schedule"]
