"""``--miscompute R@STEP``: from STEP on every gradient replica R computes (on its spec's rank, default the
last) is off by 2**-8 relative while its parameters stay right: corrupted arithmetic (a bad ALU), which
only an audit (``fault_tolerance.audit_every``) finds."""

from __future__ import annotations

from typing import Any

from recover.faults.registry import Effect, FailureSpec, FaultKind, GradientFn, Hook, register
from recover.faults.schedule import parse_at_step

MISCOMPUTE = 1.0 + 2.0**-8
"""Every gradient of the replica is multiplied by this from then on."""


def _off(grad: Any) -> None:
    grad.mul_(MISCOMPUTE)


class BadArithmetic(Effect):
    def gradient(self, perturbation: Hook, step: int, mb: int | None) -> GradientFn | None:
        return _off


@register
class Miscompute(FaultKind):
    name = "miscompute"
    help = ("every gradient it computes from then on is off by 2**-8 relative while its parameters stay right "
            "(corrupted arithmetic: only an audit finds it)")
    order = 7
    flag = "--miscompute"
    metavar = "R@STEP"
    usage = ("from STEP on, every gradient replica R computes from then on is off by 2**-8 relative while its "
             "parameters stay right (corrupted arithmetic: only an audit finds it); found by "
             "--fault_tolerance.audit_every K; repeatable")
    report = "miscompute"

    def parse(self, text: str) -> FailureSpec:
        return parse_at_step(text, self.name)

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.effects[self.name] = BadArithmetic()
