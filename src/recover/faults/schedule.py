"""Failure schedules and their injection, keyed by (replica, step, phase).

Contract: a :class:`FailureSchedule` is plain data, checked by :meth:`FailureSchedule.validate`
before anything starts (``recover launch`` refuses impossible requests up front). Each replica
process builds a :class:`FaultInjector` from the specs of its replica and calls
``maybe_fail(step, phase)`` at every phase point of every step; on a match the process SIGKILLs
itself, so the failure is as abrupt as a lost GPU (no cleanup, no goodbye to the peers).

Steps are 0-based, as in ``metrics.jsonl``: ``1@5:backward`` kills replica 1 during the backward
passes of the step that ``metrics.jsonl`` records as ``step: 5``. The phases, in step order, are
the members of :class:`recover.names.Phase` (``forward`` is the default when a spec omits it;
``recover`` is a second failure while the replica recovers from another's).

Which rank of a replica dies: a spec's ``rank``, or the replica's LAST rank when it is ``None``
(the ``--fail-rank`` default); the replica's other ranks go down with it (its torchrun job, or
the replica-level failure detection, tears them down).

A ``slow`` spec (``--slow R@STEP:FACTOR``, text ``R@STEP:forward=slow:FACTOR``) kills nothing: from the
first forward of STEP on, every rank of replica R takes FACTOR times as long per microbatch
(FACTOR 1 ends it). A ``cut`` spec (``--cut R@STEP:PEER``, text ``R@STEP:forward=cut:PEER``) breaks
the link between replicas R and PEER from STEP on: R withholds its part of every collective with
PEER and neither reaches the other's probe (an injected broken link: loopback cannot break one).
Neither counts as a failure in :meth:`FailureSchedule.validate`.

A ``corrupt`` spec (``--corrupt R@STEP``, text ``R@STEP:forward=corrupt``) flips one bit of one
parameter element of replica R (its spec's rank, default the last) before the forward passes of
STEP: silent data corruption that nothing but the parameter fingerprints notices. A ``nan`` spec
(``--nan R@STEP:ID``, text ``R@STEP:forward=nan:ID``) makes the gradient of microbatch ID of STEP NaN
on replica R, if R computes it (then R is fenced; a corruption always loses R, and counts as a failure).
A ``miscompute`` spec (``--miscompute R@STEP``) makes every gradient R computes from STEP on off by
2**-8 relative, its parameters staying right: corrupted arithmetic, found only by audits.
"""

from __future__ import annotations

import difflib
import math
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from recover.errors import ConfigError
from recover.names import FAULTS, PHASES, STEP_PHASES, Fault, Phase

DEFAULT_PHASE = Phase.FORWARD
FORM = "REPLICA@STEP[:PHASE], e.g. 1@5:backward"
_SPEC = re.compile(r"^\s*([^@:]*)@([^@:]*)(?::([^@:]*))?\s*$")
MAX_DRAWS = 1_000_000
_SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)
_SIGSTOP = getattr(signal, "SIGSTOP", signal.SIGTERM)
HANG_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGTERM)
"""Sent by the launcher's random faults: the worker's training (main) thread stops for good."""


def hang_on_signal() -> None:
    """Makes :data:`HANG_SIGNAL` stop this process's main thread for good, its other threads (heartbeats,
    watchdog) running on: a hang injected from outside. Call it from the main thread."""
    signal.signal(HANG_SIGNAL, lambda signum, frame: threading.Event().wait())


@dataclass(frozen=True)
class FailureSpec:
    """Replica ``replica`` fails at ``phase`` of step ``step`` (0-based); ``rank`` None = its last rank.

    ``fault`` says how (:class:`~recover.names.Fault`): it is killed (the default), its training
    thread hangs for good, or its process freezes (SIGSTOP) for good.
    """

    replica: int
    step: int
    phase: Phase = DEFAULT_PHASE
    rank: int | None = None
    fault: Fault = Fault.KILL
    factor: float = 1.0
    """How many times as long a microbatch takes (``slow``), the peer replica (``cut``), or the
    microbatch id (``nan``)."""

    def __post_init__(self) -> None:
        for name in ("replica", "step") + (("rank",) if self.rank is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"failure {name} = {value!r} must be an integer >= 0")
        if self.phase not in PHASES:
            raise ConfigError(f"failure phase {self.phase!r} {_phase_hint(self.phase)}")
        if self.fault not in FAULTS:
            raise ConfigError(f"failure kind {self.fault!r} is not one of {', '.join(FAULTS)}")
        object.__setattr__(self, "phase", Phase(self.phase))  # a plain name becomes its member
        object.__setattr__(self, "fault", Fault(self.fault))
        if self.fault is Fault.SLOW and not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)
                                              and self.factor >= 1):
            raise ConfigError(f"slow-down factor {self.factor!r} must be a number >= 1 (1 ends a slow-down)")
        if self.fault is Fault.CUT and not (float(self.factor).is_integer() and self.factor >= 0
                                             and int(self.factor) != self.replica):
            raise ConfigError(f"cut peer {self.factor!r} must be another replica's id (an integer >= 0)")
        if self.fault is Fault.NAN and not (float(self.factor).is_integer() and self.factor >= 0):
            raise ConfigError(f"NaN microbatch id {self.factor!r} must be an integer >= 0")

    @property
    def kills(self) -> bool:
        """Whether the replica is lost by it (a kill, hang, freeze or corruption; not a slow-down, a cut
        link, or a NaN, which loses it only if it computes that microbatch)."""
        return self.fault not in (Fault.SLOW, Fault.CUT, Fault.NAN)

    def __str__(self) -> str:
        """``R@STEP:PHASE``, with ``=hang`` or ``=freeze`` for those faults (the rank travels separately,
        as ``--fail-rank``)."""
        suffix = "" if self.fault is Fault.KILL else f"={self.fault}"
        if self.fault in _WITH_ARG:
            suffix += f":{self.factor:g}"
        return f"{self.replica}@{self.step}:{self.phase}{suffix}"

    def key(self) -> tuple[int, int, int]:
        """Sort key: step, then phase order, then replica."""
        return (self.step, PHASES.index(self.phase), self.replica)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "phase": self.phase.value, "fault": self.fault.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailureSpec:
        return cls(int(d["replica"]), int(d["step"]), str(d.get("phase", DEFAULT_PHASE)),
                   None if d.get("rank") is None else int(d["rank"]), str(d.get("fault", Fault.KILL)),
                   float(d.get("factor", 1.0)))


def parse_failure(text: str, rank: int | None = None, fault: Fault | str | None = None) -> FailureSpec:
    """Parses ``REPLICA@STEP[:PHASE][=FAULT]`` (phase case-insensitive, default ``forward``; the fault
    is ``fault`` when given, else the ``=hang``/``=freeze`` suffix, else a kill).

    Raises:
        ConfigError (a ``ValueError``): a malformed text, a negative or non-integer number, or an
            unknown phase; the one-line message names the text and the fix.
    """
    text, _, suffix = text.partition("=")
    suffix, _, factor = suffix.partition(":")
    if suffix and suffix.strip().lower() not in FAULTS:
        raise ConfigError(f"bad failure {text}={suffix}: {suffix!r} is not one of {', '.join(FAULTS)}")
    fault = Fault(fault or suffix.strip().lower() or Fault.KILL)
    if fault in _WITH_ARG:
        try:
            slow_by = float(factor)
        except ValueError:
            what = {Fault.SLOW: "R@STEP:FACTOR with FACTOR a number >= 1, e.g. 2@10:4",
                    Fault.CUT: "R@STEP:PEER with PEER another replica, e.g. 1@5:2",
                    Fault.NAN: "R@STEP:ID with ID a microbatch id, e.g. 1@5:3"}[fault]
            raise ConfigError(f"bad {fault} {text}={suffix}:{factor}: write {what}") from None
    m = _SPEC.match(text)
    if m is None:
        raise ConfigError(f"bad failure {text!r}: write {FORM}")
    rep, step, phase = m.group(1).strip(), m.group(2).strip(), m.group(3)
    for name, value in (("REPLICA", rep), ("STEP", step)):
        if not re.fullmatch(r"\d+", value):
            what = "negative" if re.fullmatch(r"-\d+", value) else "not an integer"
            raise ConfigError(f"bad failure {text!r}: {name} {value!r} is {what}; "
                              f"use an integer >= 0 and write {FORM}")
    phase = DEFAULT_PHASE if phase is None else phase.strip().lower()
    if phase not in PHASES:
        raise ConfigError(f"bad failure {text!r}: phase {phase!r} {_phase_hint(phase)}")
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"bad failure rank {rank!r} for {text!r}: use an integer >= 0")
    arg = slow_by if fault in _WITH_ARG else 1.0
    return FailureSpec(int(rep), int(step), Phase(phase), rank, fault, arg)


def _parse_with_arg(text: str, fault: Fault, form: str, what: str) -> FailureSpec:
    """``R@STEP:ARG`` of a fault that takes an argument (its phase: the forward passes)."""
    head, sep, arg = text.rpartition(":")
    if not sep or "@" not in head:
        raise ConfigError(f"bad {what} {text!r}: write {form}")
    return parse_failure(f"{head}:{DEFAULT_PHASE}={fault}:{arg}")


def parse_slow(text: str) -> FailureSpec:
    """Parses ``--slow R@STEP:FACTOR`` (replica R's microbatches take FACTOR times as long from STEP on).

    Raises:
        ConfigError: a malformed text or a factor below 1, in one line with the form to write.
    """
    return _parse_with_arg(text, Fault.SLOW, "R@STEP:FACTOR, e.g. 2@10:4", "slow-down")


def parse_nan(text: str) -> FailureSpec:
    """Parses ``--nan R@STEP:ID`` (the gradient of microbatch ID of STEP is NaN on replica R).

    Raises:
        ConfigError: a malformed text, in one line with the form to write.
    """
    return _parse_with_arg(text, Fault.NAN, "R@STEP:ID, e.g. 1@5:3", "NaN")


def parse_corrupt(text: str, fault: Fault = Fault.CORRUPT) -> FailureSpec:
    """Parses ``--corrupt R@STEP`` (one parameter bit of replica R flips before STEP's forward passes),
    or ``--miscompute R@STEP`` with ``fault=Fault.MISCOMPUTE`` (its gradients are off from then on).

    Raises:
        ConfigError: a malformed text, in one line with the form to write.
    """
    if ":" in text:
        raise ConfigError(f"bad {fault} {text!r}: write R@STEP, e.g. 2@12")
    return parse_failure(f"{text}:{DEFAULT_PHASE}={fault}")


def parse_cut(text: str) -> FailureSpec:
    """Parses ``--cut R@STEP:PEER`` (the link between replicas R and PEER breaks at STEP, for good).

    Raises:
        ConfigError: a malformed text, in one line with the form to write.
    """
    return _parse_with_arg(text, Fault.CUT, "R@STEP:PEER, e.g. 1@5:2", "cut")


def _phase_hint(phase: str) -> str:
    close = difflib.get_close_matches(phase, PHASES, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"is not a phase{hint}; use one of {', '.join(PHASES)}"


class FailureSchedule:
    """The planned failures of a run, sorted by (step, phase, replica)."""

    def __init__(self, specs: Iterable[FailureSpec | str] = ()) -> None:
        parsed = [parse_failure(s) if isinstance(s, str) else s for s in specs]
        self.specs: tuple[FailureSpec, ...] = tuple(sorted(parsed, key=FailureSpec.key))

    def __iter__(self) -> Iterator[FailureSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FailureSchedule) and self.specs == other.specs

    def __repr__(self) -> str:
        return f"FailureSchedule([{', '.join(repr(str(s)) for s in self.specs)}])"

    def validate(self, replicas: int, steps: int, min_replicas: int = 1, rejoin: bool = False,
                 ranks: int | None = None) -> FailureSchedule:
        """Refuses a schedule the run cannot carry out; returns ``self``.

        Without ``rejoin`` a replica may die once, and at most ``replicas - min_replicas``
        distinct replicas may die. With ``rejoin`` a replica may die again at a later step (its
        rejoin time is in seconds, so only the certain part is checked: at most
        ``replicas - min_replicas`` replicas may die at the same step). ``ranks`` (the ranks per
        replica), when given, bounds each spec's ``rank``.

        Raises:
            ConfigError: the first problem found, in schedule order, with the fix.
        """
        _positive("replicas", replicas)
        _positive("steps", steps)
        _positive("min_replicas", min_replicas)
        if min_replicas > replicas:
            raise ConfigError(f"min_replicas = {min_replicas} exceeds replicas = {replicas}")
        may_lose = replicas - min_replicas
        seen: dict[int, FailureSpec] = {}
        per_step: dict[int, set[int]] = {}
        for s in self.specs:
            if s.replica >= replicas:
                raise ConfigError(f"failure {s}: replica {s.replica} does not exist; "
                                  f"replicas are 0..{replicas - 1}")
            if s.step >= steps:
                raise ConfigError(f"failure {s}: step {s.step} is beyond the run; steps are 0..{steps - 1}")
            if ranks is not None and s.rank is not None and s.rank >= ranks:
                raise ConfigError(f"failure {s}: rank {s.rank} does not exist; a replica has ranks "
                                  f"0..{ranks - 1}")
            if s.fault is Fault.CUT and int(s.factor) >= replicas:
                raise ConfigError(f"cut {s}: peer replica {int(s.factor)} does not exist; replicas are "
                                  f"0..{replicas - 1}")
            if not s.kills:
                continue
            first = seen.get(s.replica)
            if first is not None and (not rejoin or first.step == s.step):
                fix = "kill it at another step" if rejoin else "let it rejoin (--rejoin-after) or drop one"
                raise ConfigError(f"failure {s}: replica {s.replica} is already killed by {first}; {fix}")
            seen[s.replica] = s
            per_step.setdefault(s.step, set()).add(s.replica)
            if rejoin and len(per_step[s.step]) > may_lose:
                raise ConfigError(f"failures at step {s.step} kill replicas {sorted(per_step[s.step])}, "
                                  f"leaving fewer than min_replicas = {min_replicas} of {replicas}; "
                                  "kill fewer at once or lower min_replicas")
        if not rejoin and len(seen) > may_lose:
            raise ConfigError(f"failures kill replicas {sorted(seen)}, leaving {replicas - len(seen)} of "
                              f"{replicas} (min_replicas = {min_replicas}); kill at most {may_lose}, "
                              "lower min_replicas or let replicas rejoin")
        return self

    def at(self, replica: int, step: int, phase: Phase | str) -> bool:
        """Whether ``replica`` is scheduled to die at ``phase`` of ``step``."""
        return any(s.replica == replica and s.step == step and s.phase == phase and s.kills for s in self.specs)

    def for_replica(self, replica: int) -> list[FailureSpec]:
        """The specs of ``replica``, in schedule order: what its processes need to know."""
        return [s for s in self.specs if s.replica == replica]

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.specs]

    @classmethod
    def from_json(cls, items: Iterable[dict[str, Any]]) -> FailureSchedule:
        return cls(FailureSpec.from_dict(d) for d in items)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r} must be an integer >= 1")


def random_schedule(replicas: int, steps: int, mtbf_s: float, step_time_s: float, seed: int,
                    min_replicas: int = 1, phases: Iterable[Phase | str] = STEP_PHASES,
                    rejoin_after_steps: int | None = None) -> FailureSchedule:
    """Random failures: exponential inter-arrival times of mean ``mtbf_s`` (for the whole job).

    Failure times are drawn over the run's expected wall time ``steps * step_time_s``; a failure
    at time ``t`` lands in step ``floor(t / step_time_s)``, at a uniformly random phase of
    ``phases`` and a uniformly random live replica. A failure that would leave fewer than
    ``min_replicas`` live is dropped (the draws go on, so a rejoin can make room again). Without
    ``rejoin_after_steps`` a killed replica stays dead; with it, it counts as live again (and
    may die again) that many steps after its kill, an assumption the launcher derives from its
    rejoin delay. Deterministic from ``seed``.
    """
    _positive("replicas", replicas)
    _positive("steps", steps)
    _positive("min_replicas", min_replicas)
    if not (math.isfinite(mtbf_s) and mtbf_s > 0 and math.isfinite(step_time_s) and step_time_s > 0):
        raise ConfigError(f"mtbf_s = {mtbf_s!r} and step_time_s = {step_time_s!r} must be finite and > 0")
    phases = tuple(phases)
    if not phases:
        raise ConfigError("phases is empty; use some of " + ", ".join(PHASES))
    for p in phases:
        if p not in PHASES:
            raise ConfigError(f"phase {p!r} {_phase_hint(p)}")
    if rejoin_after_steps is not None:
        _positive("rejoin_after_steps", rejoin_after_steps)
    if steps * step_time_s / mtbf_s > MAX_DRAWS:
        raise ConfigError(f"mtbf_s = {mtbf_s} is too small for {steps} steps of {step_time_s} s "
                          f"(over {MAX_DRAWS:,} expected failures); use a larger mtbf_s")
    rng = random.Random(seed)
    back_at: dict[int, float] = {}  # replica -> step from which it is live again (inf: never)
    specs: list[FailureSpec] = []
    horizon, t = steps * step_time_s, 0.0
    while True:
        t += -mtbf_s * math.log(1.0 - rng.random())
        step = int(t // step_time_s)
        if t >= horizon or step >= steps:
            break
        phase = phases[rng.randrange(len(phases))]
        live = [r for r in range(replicas) if back_at.get(r, -1) <= step]
        if len(live) <= min_replicas:
            if rejoin_after_steps is None:
                break  # nobody comes back: no later failure can happen either
            continue
        victim = live[rng.randrange(len(live))]
        back_at[victim] = math.inf if rejoin_after_steps is None else step + rejoin_after_steps
        specs.append(FailureSpec(victim, step, phase))
    return FailureSchedule(specs)


KillFn = Callable[[int, int], None]
_WITH_ARG = (Fault.SLOW, Fault.CUT, Fault.NAN)


class FaultInjector:
    """Fails this process at its replica's scheduled (step, phase), on the chosen rank: SIGKILL, a
    hang of the calling (training) thread for good, or SIGSTOP (:class:`~recover.names.Fault`).

    Args:
        specs: failure specs (those of other replicas are ignored).
        replica: this process's replica.
        rank: this process's rank inside its replica.
        ranks: the replica's rank count; a spec with ``rank=None`` fires on rank ``ranks - 1``.
        kill: called as ``kill(os.getpid(), SIGKILL or SIGSTOP)``; ``os.kill`` by default, a recorder in tests.
        hang: called to hang the training thread; blocks for good by default (a recorder in tests).
        before_kill: called with the spec just before the kill (e.g. to write and flush an event).
        slow: called with a ``slow`` spec's factor when it fires (on every rank of the replica).
        cut: called with a ``cut`` spec's peer replica when it fires (on every rank of the replica).
        corrupt: called with False when a ``corrupt`` spec fires, True for ``miscompute`` (on its rank).
        nan: called with ``(step, id)`` when a ``nan`` spec fires (on every rank of the replica).
    """

    def __init__(self, specs: Iterable[FailureSpec], replica: int, rank: int = 0, ranks: int = 1,
                 kill: KillFn = os.kill, before_kill: Callable[[FailureSpec], None] | None = None,
                 hang: Callable[[], Any] = lambda: threading.Event().wait(),
                 slow: Callable[[float], Any] = lambda factor: None,
                 cut: Callable[[int], Any] = lambda peer: None,
                 corrupt: Callable[[bool], Any] = lambda arithmetic: None,
                 nan: Callable[[int, int], Any] = lambda step, mb: None) -> None:
        if not 0 <= rank < ranks:
            raise ValueError(f"rank = {rank} must be in 0..{ranks - 1} (ranks = {ranks})")
        self.replica, self.rank, self.ranks = replica, rank, ranks
        self.kill, self.before_kill, self.hang, self.slow, self.cut = kill, before_kill, hang, slow, cut
        self.corrupt, self.nan = corrupt, nan
        self.pending: list[FailureSpec] = [s for s in specs if s.replica == replica and self._mine(s)]

    def _mine(self, spec: FailureSpec) -> bool:
        if spec.fault in _WITH_ARG and spec.rank is None:
            return True  # the whole replica slows down, loses its link, or computes the NaN
        return (self.ranks - 1 if spec.rank is None else spec.rank) == self.rank

    def maybe_fail(self, step: int, phase: Phase | str) -> bool:
        """Fails the process if a pending spec matches ``(step, phase)``; returns whether it fired.

        A spec fires once. With the real ``os.kill`` (and hang) this never returns when it fires.
        """
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} {_phase_hint(phase)}")
        for spec in self.pending:
            if spec.step == step and spec.phase == phase:
                self.pending.remove(spec)
                if self.before_kill is not None:
                    self.before_kill(spec)
                if spec.fault is Fault.SLOW:
                    self.slow(spec.factor)
                    return True
                if spec.fault is Fault.CUT:
                    self.cut(int(spec.factor))
                    return True
                if spec.fault in (Fault.CORRUPT, Fault.MISCOMPUTE):
                    self.corrupt(spec.fault is Fault.MISCOMPUTE)
                    return True
                if spec.fault is Fault.NAN:
                    self.nan(spec.step, int(spec.factor))
                    return True
                sys.stdout.flush()
                sys.stderr.flush()
                if spec.fault is Fault.HANG:
                    self.hang()
                else:
                    self.kill(os.getpid(), _SIGSTOP if spec.fault is Fault.FREEZE else _SIGKILL)
                return True
        return False
