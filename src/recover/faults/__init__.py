"""Failure schedules and injection by (replica, step, phase); random MTBF schedules.

The phases are :class:`recover.names.Phase`; ``PHASES`` is re-exported from there.
"""

from recover.faults.schedule import (
    HANG_SIGNAL,
    PHASES,
    FailureSchedule,
    FailureSpec,
    FaultInjector,
    hang_on_signal,
    parse_corrupt,
    parse_cut,
    parse_failure,
    parse_nan,
    parse_slow,
    random_schedule,
)

__all__ = ["HANG_SIGNAL", "PHASES", "hang_on_signal",
           "FailureSchedule", "FailureSpec", "FaultInjector", "parse_corrupt", "parse_cut", "parse_failure",
           "parse_nan", "parse_slow", "random_schedule"]
