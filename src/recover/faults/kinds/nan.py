"""``--nan R@STEP:ID``: the gradient of microbatch ID of STEP is NaN on replica R, if R computes it (a
faulty kernel or device). R's vote reports it non-finite: R is fenced and the microbatch is recomputed
elsewhere in the same step."""

from __future__ import annotations

from typing import Any

from recover.errors import ConfigError
from recover.faults.registry import Effect, FailureSpec, FaultKind, GradientFn, Hook, register
from recover.faults.schedule import parse_with_arg
from recover.names import Event


class Poison(Effect):
    """The first gradient tensor of every pass of microbatch ``mb`` of ``step`` becomes NaN (a recompute to
    find the non-finite one finds it again)."""

    def __init__(self, step: int, mb: int) -> None:
        self.step, self.mb = step, mb

    def gradient(self, perturbation: Hook, step: int, mb: int | None) -> GradientFn | None:
        if (step, mb) != (self.step, self.mb):
            return None
        left = [True]

        def poison(grad: Any) -> None:
            if left[0]:
                grad.mul_(float("nan"))
                left[0] = False
        return poison


@register
class NaN(FaultKind):
    name = "nan"
    help = "the gradient of microbatch ID becomes NaN on it (a faulty kernel or device)"
    order = 6
    flag = "--nan"
    metavar = "R@STEP:ID"
    usage = ("at STEP, the gradient of microbatch ID becomes NaN on replica R (a faulty kernel or device); the "
             "microbatch is recomputed elsewhere; repeatable")
    report = "NaN gradient"
    arg = "ID"
    form = "R@STEP:ID with ID a microbatch id, e.g. 1@5:3"
    kills = False
    whole_replica = True

    def parse(self, text: str) -> FailureSpec:
        return parse_with_arg(text, self.name, "R@STEP:ID, e.g. 1@5:3", "NaN")

    def check(self, spec: FailureSpec) -> None:
        if not (float(spec.arg).is_integer() and spec.arg >= 0):
            raise ConfigError(f"NaN microbatch id {spec.arg!r} must be an integer >= 0")

    def record(self, spec: FailureSpec, perturbation: Hook) -> tuple[Event, dict[str, Any]]:
        return self.event, {"fault": self.name, "step": spec.step, "microbatch": int(spec.arg)}

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.effects[(self.name, spec.step, int(spec.arg))] = Poison(spec.step, int(spec.arg))
