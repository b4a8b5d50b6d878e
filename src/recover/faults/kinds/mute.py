"""``--mute R@STEP``: from STEP's forward passes on, replica R's heartbeats stop while its training thread
computes on (a stalled heartbeat thread, a control network that drops its packets). The coordinator finds
it by its missed heartbeats (``fault_tolerance.heartbeat_timeout_s``), fences it and goes on without it;
every committed step still holds all M microbatches (the orphans are recomputed by the others)."""

from __future__ import annotations

from recover.faults.registry import Effect, FailureSpec, FaultKind, Hook, register
from recover.faults.schedule import parse_at_step


class Muted(Effect):
    def heartbeats(self) -> bool:
        return False


@register
class Mute(FaultKind):
    name = "mute"
    help = "a stalled heartbeat thread or a control link that drops its packets"
    order = 8
    flag = "--mute"
    metavar = "R@STEP"
    usage = ("from STEP on, replica R's heartbeats stop for good while its training thread computes on ({help}); "
             "it is found by its silence (fault_tolerance.heartbeat_timeout_s); repeatable")
    report = "muted heartbeats"
    whole_replica = True

    def parse(self, text: str) -> FailureSpec:
        return parse_at_step(text, self.name)

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.effects[self.name] = Muted()
