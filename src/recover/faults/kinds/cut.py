"""``--cut R@STEP:PEER``: the link between replicas R and PEER breaks for good at STEP (a failed cable or
switch port; loopback cannot break one, so it is injected): R withholds its part of every collective with
PEER and neither reaches the other's probe. The members' reports implicate one side, which is fenced."""

from __future__ import annotations

from typing import Any

from recover.errors import ConfigError
from recover.faults.registry import Effect, FailureSpec, FaultKind, Hook, register
from recover.faults.schedule import parse_with_arg
from recover.names import Event


class BrokenLink(Effect):
    def __init__(self, peer: int) -> None:
        self.peer = peer

    def unreachable(self, peer: int) -> bool:
        return peer == self.peer


@register
class Cut(FaultKind):
    name = "cut"
    help = ("the link between it and replica PEER breaks for good: their collectives stall and neither "
            "reaches the other (a failed cable or switch port)")
    order = 4
    flag = "--cut"
    metavar = "R@STEP:PEER"
    usage = ("from STEP on, the link between replicas R and PEER is broken ({help}); the replica the members' "
             "reports implicate is fenced; repeatable")
    report = "broken link"
    arg = "PEER"
    form = "R@STEP:PEER with PEER another replica, e.g. 1@5:2"
    kills = False
    whole_replica = True
    event = Event.LINK_CUT

    def parse(self, text: str) -> FailureSpec:
        return parse_with_arg(text, self.name, "R@STEP:PEER, e.g. 1@5:2", self.name)

    def check(self, spec: FailureSpec) -> None:
        if not (float(spec.arg).is_integer() and spec.arg >= 0 and int(spec.arg) != spec.replica):
            raise ConfigError(f"cut peer {spec.arg!r} must be another replica's id (an integer >= 0)")

    def check_run(self, spec: FailureSpec, replicas: int) -> None:
        if int(spec.arg) >= replicas:
            raise ConfigError(f"cut {spec}: peer replica {int(spec.arg)} does not exist; replicas are "
                              f"0..{replicas - 1}")

    def record(self, spec: FailureSpec, perturbation: Hook) -> tuple[Event, dict[str, Any]]:
        return self.event, {"step": spec.step, "peer": int(spec.arg)}

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        perturbation.effects[(self.name, int(spec.arg))] = BrokenLink(int(spec.arg))
