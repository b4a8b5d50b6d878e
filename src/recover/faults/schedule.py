"""Failure schedules, keyed by (replica, step, phase), and the text form of a spec (its
:class:`~recover.faults.registry.FailureSpec`).

Contract: a :class:`FailureSchedule` is plain data, checked by :meth:`FailureSchedule.validate`
before anything starts (``recover launch`` refuses impossible requests up front). Each replica
process builds a :class:`~recover.faults.perturb.Perturbation` from the specs of its replica, which
fires them at their (step, phase); a kill SIGKILLs the process, so the failure is as abrupt as a lost
GPU (no cleanup, no goodbye to the peers).

Steps are 0-based, as in ``metrics.jsonl``: ``1@5:backward`` kills replica 1 during the backward
passes of the step that ``metrics.jsonl`` records as ``step: 5``. The phases, in step order, are
the members of :class:`recover.names.Phase` (``forward`` is the default when a spec omits it;
``recover`` is a second failure while the replica recovers from another's).

Which rank of a replica dies: a spec's ``rank``, or the replica's LAST rank when it is ``None``
(the ``--fail-rank`` default); the replica's other ranks go down with it (its torchrun job, or
the replica-level failure detection, tears them down). A kind that strikes the whole replica
(``whole_replica``: a slow-down, a cut link, a NaN) fires on every rank when ``rank`` is None.

What each kind of fault does, its flag, argument and checks are its own module's
(:mod:`recover.faults.registry`, :mod:`recover.faults.kinds`); the text form of any spec is
``R@STEP:PHASE[=KIND[:ARG]]`` (a kill: ``R@STEP:PHASE``). Kinds that do not lose the replica (a
slow-down, a cut link, a NaN) do not count as failures in :meth:`FailureSchedule.validate`.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Iterator
from typing import Any

from recover.errors import ConfigError
from recover.faults.registry import DEFAULT_PHASE, KILL, FailureSpec, kind, phase_hint, registered
from recover.names import PHASES, STEP_PHASES, Phase

FORM = "REPLICA@STEP[:PHASE], e.g. 1@5:backward"
_SPEC = re.compile(r"^\s*([^@:]*)@([^@:]*)(?::([^@:]*))?\s*$")
MAX_DRAWS = 1_000_000


def parse_failure(text: str, rank: int | None = None, fault: str | None = None) -> FailureSpec:
    """Parses ``REPLICA@STEP[:PHASE][=FAULT]`` (phase case-insensitive, default ``forward``; the fault
    is ``fault`` when given, else the ``=hang``/``=freeze`` suffix, else a kill).

    Raises:
        ConfigError (a ``ValueError``): a malformed text, a negative or non-integer number, or an
            unknown phase; the one-line message names the text and the fix.
    """
    text, _, suffix = text.partition("=")
    suffix, _, factor = suffix.partition(":")
    if suffix and suffix.strip().lower() not in registered():
        raise ConfigError(f"bad failure {text}={suffix}: {suffix!r} is not one of {', '.join(registered())}")
    how = kind(fault or suffix or KILL)
    if how.arg is not None:
        try:
            arg = float(factor)
        except ValueError:
            raise ConfigError(f"bad {how.name} {text}={suffix}:{factor}: write {how.form}") from None
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
        raise ConfigError(f"bad failure {text!r}: phase {phase!r} {phase_hint(phase)}")
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"bad failure rank {rank!r} for {text!r}: use an integer >= 0")
    return FailureSpec(int(rep), int(step), Phase(phase), rank, how.name, arg if how.arg is not None else 1.0)


def parse_with_arg(text: str, fault: str, form: str, what: str) -> FailureSpec:
    """``R@STEP:ARG`` of a kind that takes an argument (its phase: the forward passes); ``form`` and ``what``
    name the form to write and the fault in the error."""
    head, sep, arg = text.rpartition(":")
    if not sep or "@" not in head:
        raise ConfigError(f"bad {what} {text!r}: write {form}")
    return parse_failure(f"{head}:{DEFAULT_PHASE}={fault}:{arg}")


def parse_at_step(text: str, fault: str) -> FailureSpec:
    """``R@STEP`` of a kind that takes no argument nor phase (it strikes before STEP's forward passes).

    Raises:
        ConfigError: a malformed text, in one line with the form to write.
    """
    if ":" in text:
        raise ConfigError(f"bad {fault} {text!r}: write R@STEP, e.g. 2@12")
    return parse_failure(f"{text}:{DEFAULT_PHASE}={fault}")


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
        ``replicas - min_replicas`` replicas may die at the same step, or all of them: the replicas that
        rejoin then restore the newest checkpoint). ``ranks`` (the ranks per
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
            s.kind.check_run(s, replicas)
            if not s.kills:
                continue
            first = seen.get(s.replica)
            if first is not None and (not rejoin or first.step == s.step):
                fix = "kill it at another step" if rejoin else "let it rejoin (--rejoin-after) or drop one"
                raise ConfigError(f"failure {s}: replica {s.replica} is already killed by {first}; {fix}")
            seen[s.replica] = s
            per_step.setdefault(s.step, set()).add(s.replica)
        for step, killed in per_step.items():
            if rejoin and may_lose < len(killed) < replicas:
                raise ConfigError(f"failures at step {step} kill replicas {sorted(killed)}, leaving fewer than "
                                  f"min_replicas = {min_replicas} of {replicas}; kill fewer at once (or all: the "
                                  "replicas that rejoin restore the newest checkpoint) or lower min_replicas")
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
            raise ConfigError(f"phase {p!r} {phase_hint(p)}")
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
