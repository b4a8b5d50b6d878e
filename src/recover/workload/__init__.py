"""LAYER 3: the workload policy (pure Python, no process group; shared with the simulator)."""

from recover.workload.policy import (
    assign,
    audit_plan,
    check_assignment,
    even_split,
    makespan,
    plan_step,
    quotas,
    replan,
    split_within_replica,
    static_assignment,
)
from recover.workload.speeds import SpeedChange, SpeedTracker, slowdowns

__all__ = ["assign", "audit_plan", "check_assignment", "even_split", "makespan", "plan_step", "quotas", "replan",
           "split_within_replica", "static_assignment", "SpeedChange", "SpeedTracker", "slowdowns"]
