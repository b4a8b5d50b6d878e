"""The one hook through which injected faults reach production code.

Contract: each process of a replica holds one :class:`Perturbation` built from its replica's specs
(:mod:`recover.faults.schedule`); the session installs it on the replica, the coordinator client and
(through the client) the fault-tolerant group, which hold nothing else about faults. Production code
calls it at its injection points and never asks which kinds exist:

- :meth:`Perturbation.at_phase` at every phase point of every step: a spec of this rank whose
  (step, phase) it is fires once, in schedule order: its event is written (``record``), then its kind
  strikes (:meth:`~recover.faults.registry.FaultKind.strike`): it kills, hangs or stops the process, acts
  on the ``target`` (the replica: ``target.corrupt()``), or installs an :class:`~recover.faults.registry.Effect`;
- :meth:`Perturbation.gradient` before a pass's gradients are folded: None (nothing to do, the common
  case), or a function applied to each gradient tensor of the pass in turn, in place;
- :meth:`Perturbation.time_factor` where a pass's time is emulated or stretched;
- :meth:`Perturbation.unreachable` where a link to a peer replica is used (collectives, probes);
- :meth:`Perturbation.heartbeats` before each heartbeat goes out.

Effects live until a later spec replaces them (by key) or, for a one-shot effect, until used.
:data:`NONE` is the neutral perturbation (no specs): the default of every holder.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from recover.faults.registry import Effect, FailureSpec, GradientFn, kind, phase_hint
from recover.names import PHASES, Event, Phase

Record = Callable[[FailureSpec, Event, dict[str, Any]], Any]
"""Writes the event of a spec that strikes: ``record(spec, kind_of_event, fields)``."""



class Perturbation:
    """The faults of rank ``rank`` (of ``ranks``) of replica ``replica``, and the hook production calls.

    Args:
        specs: failure specs (those of other replicas, and other ranks', are ignored).
        target: the replica whose state a kind may act on (``corrupt()``); None where there is none.
        record: writes a striking spec's event (nothing by default).
        kill: called as ``kill(os.getpid(), signal)``; ``os.kill`` by default, a recorder in tests.
        hang: hangs the calling (training) thread; blocks for good by default (a recorder in tests).
    """

    def __init__(self, specs: Iterable[FailureSpec] = (), replica: int = 0, rank: int = 0, ranks: int = 1, *,
                 target: Any = None, record: Record | None = None, kill: Callable[[int, int], Any] = os.kill,
                 hang: Callable[[], Any] = lambda: threading.Event().wait()) -> None:
        if not 0 <= rank < ranks:
            raise ValueError(f"rank = {rank} must be in 0..{ranks - 1} (ranks = {ranks})")
        self.replica, self.rank, self.ranks = replica, rank, ranks
        self.target, self.record, self.kill, self.hang = target, record, kill, hang
        self.pending: list[FailureSpec] = [s for s in specs if s.replica == replica and self._mine(s)]
        self.effects: dict[Hashable, Effect] = {}

    def _mine(self, spec: FailureSpec) -> bool:
        if spec.kind.whole_replica and spec.rank is None:
            return True
        return (self.ranks - 1 if spec.rank is None else spec.rank) == self.rank

    # ---- the injection points --------------------------------------------------------------------
    def at_phase(self, step: int, phase: Phase | str) -> bool:
        """Fires the pending spec matching ``(step, phase)``, if any; returns whether one fired (a real
        kill or hang never returns)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} {phase_hint(phase)}")
        for spec in self.pending:
            if spec.step == step and spec.phase == phase:
                self.pending.remove(spec)
                how = kind(spec.fault)
                if self.record is not None:
                    self.record(spec, *how.record(spec, self))
                how.strike(spec, self)
                return True
        return False

    def gradient(self, step: int, mb: int | None) -> GradientFn | None:
        """What happens to each gradient of ``mb``'s pass in ``step`` (``mb`` None: a padding or audit
        pass); None: nothing."""
        fns = [fn for effect in list(self.effects.values()) if (fn := effect.gradient(self, step, mb)) is not None]
        if not fns:
            return None
        if len(fns) == 1:
            return fns[0]

        def every(grad: Any) -> None:
            for fn in fns:
                fn(grad)
        return every

    def time_factor(self) -> float:
        """How many times as long a pass takes (1: as long as it does)."""
        factor = 1.0
        for effect in self.effects.values():
            factor *= effect.time_factor()
        return factor

    def unreachable(self, peer: int) -> bool:
        """Whether the link to replica ``peer`` is broken."""
        return any(effect.unreachable(peer) for effect in self.effects.values())

    def heartbeats(self) -> bool:
        """Whether this process's heartbeats go out."""
        return all(effect.heartbeats() for effect in self.effects.values())


NONE = Perturbation()
"""No fault: every holder's default."""
