"""``--slow R@STEP:FACTOR``: from the first forward of STEP on, every rank of replica R takes FACTOR times
as long per pass (a throttled or degraded device); FACTOR 1 ends it. Nothing is lost: the coordinator
names it a straggler and, with ``workload.policy = weighted``, plans fewer microbatches for it."""

from __future__ import annotations

import math
from typing import Any

from recover.errors import ConfigError
from recover.faults.registry import Effect, FailureSpec, FaultKind, Hook, register
from recover.faults.schedule import parse_with_arg
from recover.names import Event, slowing


class SlowDown(Effect):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def time_factor(self) -> float:
        return self.factor


@register
class Slow(FaultKind):
    name = "slow"
    help = "its microbatches take FACTOR times as long from then on (a throttled or degraded device)"
    order = 3
    flag = "--slow"
    metavar = "R@STEP:FACTOR"
    usage = ("from STEP on, replica R's microbatches take FACTOR times as long ({help}); with "
             "workload.policy = weighted it gets fewer of them; repeatable")
    report = "straggler"
    arg = "FACTOR"
    form = "R@STEP:FACTOR with FACTOR a number >= 1, e.g. 2@10:4"
    kills = False
    whole_replica = True
    event = Event.SLOWED
    detection = Event.STRAGGLER

    def parse(self, text: str) -> FailureSpec:
        return parse_with_arg(text, self.name, "R@STEP:FACTOR, e.g. 2@10:4", "slow-down")

    def check(self, spec: FailureSpec) -> None:
        if not (isinstance(spec.arg, (int, float)) and math.isfinite(spec.arg) and spec.arg >= 1):
            raise ConfigError(f"slow-down factor {spec.arg!r} must be a number >= 1 (1 ends a slow-down)")

    def record(self, spec: FailureSpec, perturbation: Hook) -> tuple[Event, dict[str, Any]]:
        return self.event, {"step": spec.step, "factor": spec.arg}

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.effects.pop(self.name, None)
        if spec.arg > 1:
            perturbation.effects[self.name] = SlowDown(spec.arg)

    def struck(self, event: dict[str, Any]) -> bool:
        return slowing(event)
