"""Failure schedules and injection by (replica, step, phase); random MTBF schedules."""

from recover.faults.schedule import (
    PHASES,
    FailureSchedule,
    FailureSpec,
    FaultInjector,
    parse_failure,
    random_schedule,
)

__all__ = ["PHASES", "FailureSchedule", "FailureSpec", "FaultInjector", "parse_failure", "random_schedule"]
