"""LAYER 3: the workload policy (pure Python, no process group; shared with the simulator)."""

from recover.workload.policy import even_split, static_assignment

__all__ = ["even_split", "static_assignment"]
