"""Failure schedules, the registered fault kinds and the one hook that injects them.

The phases are :class:`recover.names.Phase`; ``PHASES`` is re-exported from there. A fault kind is one
module of :mod:`recover.faults.kinds` (see :mod:`recover.faults.registry`); production code sees faults
only through :class:`~recover.faults.perturb.Perturbation`.
"""

from recover.faults.kinds.hang import HANG_SIGNAL, hang_on_signal
from recover.faults.perturb import NONE, Perturbation
from recover.faults.registry import Effect, FailureSpec, FaultKind, kind, random_kinds, registered, struck_by
from recover.faults.schedule import PHASES, FailureSchedule, parse_failure, random_schedule

__all__ = ["HANG_SIGNAL", "NONE", "PHASES", "Effect", "FailureSchedule", "FailureSpec", "FaultKind", "Perturbation",
           "hang_on_signal", "kind", "parse_failure", "random_kinds", "random_schedule", "registered", "struck_by"]
