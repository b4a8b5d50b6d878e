"""``--corrupt R@STEP``: before STEP's forward passes one bit of one parameter element of replica R (its
spec's rank, default the last) flips in memory: silent data corruption that only the parameter
fingerprints notice, at that step's vote. The replica is lost (fenced)."""

from __future__ import annotations

from recover.faults.registry import FailureSpec, FaultKind, Hook, register
from recover.faults.schedule import parse_at_step


@register
class Corrupt(FaultKind):
    name = "corrupt"
    help = "one bit of one parameter element flips in its memory (silent data corruption)"
    order = 5
    flag = "--corrupt"
    metavar = "R@STEP"
    usage = ("before STEP's forward passes, {help} on replica R; the parameter fingerprints find it at that "
             "step's vote; repeatable")
    report = "corruption"

    def parse(self, text: str) -> FailureSpec:
        return parse_at_step(text, self.name)

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.target.corrupt()
