"""The fault kinds: each is one registered :class:`FaultKind`, declared in its own module of
:mod:`recover.faults.kinds`; and what a kind is given: the :class:`FailureSpec` it parses and checks, the
:class:`Hook` it strikes through and the :class:`Effect` it may leave in force.

Contract: a kind declares everything the rest of the system asks about it, so adding one touches
its own module (and its test) only:

- its name (the ``fault`` of its specs, ``R@STEP:PHASE=NAME[:ARG]``, and of its events), one line of
  help, and its place among the kinds (``order``);
- its ``recover launch`` flag (``flag``, ``metavar``, ``usage``) and :meth:`FaultKind.parse`, which turns
  the flag's value into a :class:`FailureSpec` or raises a one-line
  :class:`~recover.errors.ConfigError` with the form to write; :meth:`FaultKind.check` validates a
  spec's argument and :meth:`FaultKind.check_run` what depends on the run (the replica count);
- whether it loses the replica (``kills``: counted by ``FailureSchedule.validate``), whether it strikes
  every rank of the replica (``whole_replica``) or one, and the signal ``--random-failures`` sends for
  it from outside (``signal``; None: not a random fault);
- its injection, :meth:`FaultKind.strike`: what the process does when the spec fires at its
  (step, phase), through the one hook production code calls (:class:`~recover.faults.perturb.Perturbation`);
- the event it writes when it strikes (:meth:`FaultKind.record`), the event that names the replica
  once found (``detection``), and its row in ``recover report``'s fault table (``report``).

:func:`registered` imports every module of :mod:`recover.faults.kinds` on first use (each registers its kind
with :func:`register`), so no list of kinds is kept anywhere else. This module imports nothing above
``faults/``: the injection reaches production code only through the hook. It is the lowest module of
``faults/``: a spec names its kind and a kind parses specs, so the two live here together, and the hook that
fires the kinds (:mod:`recover.faults.perturb`) implements :class:`Hook` rather than being imported here.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from recover.errors import ConfigError
from recover.names import PHASES, Event, Phase

DEFAULT_PHASE = Phase.FORWARD
KILL = "kill"
"""The kind of a spec that names none: SIGKILL."""
GradientFn = Callable[[Any], None]
"""Applied in place to each gradient tensor of one pass, in order."""

_KINDS: dict[str, FaultKind] = {}
_FOUND: list[bool] = []  # not empty once every module of recover.faults.kinds was imported


class FaultKind:
    """One kind of injected fault (see the module docstring); subclasses set the class attributes."""

    name: ClassVar[str]
    help: ClassVar[str]
    """What it does to the replica, one line (the flag's help and ``recover demo`` quote it)."""
    order: ClassVar[int]
    flag: ClassVar[str]
    metavar: ClassVar[str]
    usage: ClassVar[str]
    """The flag's help text; ``{help}`` is replaced by :attr:`help`."""
    report: ClassVar[str]
    """Its name in the fault table of ``recover report``."""
    arg: ClassVar[str | None] = None
    """What its spec's argument (``FailureSpec.arg``) is, e.g. ``FACTOR``; None: it takes none."""
    form: ClassVar[str] = ""
    """How to write a spec with its argument, for errors, e.g. ``R@STEP:FACTOR with FACTOR ...``."""
    kills: ClassVar[bool] = True
    whole_replica: ClassVar[bool] = False
    signal: ClassVar[int | None] = None
    event: ClassVar[Event] = Event.INJECTED
    detection: ClassVar[Event] = Event.FAILURE_DETECTED

    def parse(self, text: str) -> FailureSpec:
        """The flag's value as a spec. Raises ConfigError (one line, with the form to write)."""
        raise NotImplementedError

    def check(self, spec: FailureSpec) -> None:
        """Refuses a bad argument of ``spec`` (ConfigError); the default takes any."""

    def check_run(self, spec: FailureSpec, replicas: int) -> None:
        """Refuses ``spec`` in a run of ``replicas`` replicas (ConfigError); the default accepts it."""

    def strike(self, spec: FailureSpec, perturbation: Hook) -> None:
        """What the process does when ``spec`` fires (after :meth:`record` is written)."""
        raise NotImplementedError

    def record(self, spec: FailureSpec, perturbation: Hook) -> tuple[Event, dict[str, Any]]:
        """The event written when ``spec`` strikes and its fields (the replica is added by the writer)."""
        return self.event, {"fault": self.name, "step": spec.step}

    def struck(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` (one of :attr:`event`'s) is this kind striking (not, say, its end)."""
        return True

    def __repr__(self) -> str:
        return f"<fault kind {self.name}>"


class Effect:
    """What a struck fault leaves in force; the defaults change nothing (a kind overrides what it needs)."""

    def gradient(self, perturbation: Hook, step: int, mb: int | None) -> GradientFn | None:
        return None

    def time_factor(self) -> float:
        return 1.0

    def unreachable(self, peer: int) -> bool:
        return False

    def heartbeats(self) -> bool:
        return True


class Hook(Protocol):
    """What a kind's :meth:`FaultKind.strike` acts on: the process's one hook
    (:class:`~recover.faults.perturb.Perturbation` is it), declared here so that the kinds' interface does not
    import the hook that fires them."""

    @property
    def replica(self) -> int: ...

    @property
    def rank(self) -> int:
        """This process's rank in its replica."""

    @property
    def target(self) -> Any:
        """The replica whose state a kind may act on (``corrupt()``); None where there is none."""

    @property
    def effects(self) -> dict[Hashable, Effect]:
        """What struck faults left in force, by key (a kind adds its :class:`Effect`)."""

    @property
    def kill(self) -> Callable[[int, int], Any]:
        """``kill(pid, signal)``."""

    @property
    def hang(self) -> Callable[[], Any]:
        """Hangs the calling (training) thread."""


@dataclass(frozen=True)
class FailureSpec:
    """Replica ``replica`` fails at ``phase`` of step ``step`` (0-based); ``rank`` None = its last rank.

    ``fault`` names its kind (:func:`~recover.faults.registry.registered`): killed (the default), its training
    thread hung for good, its process frozen (SIGSTOP) for good, ...
    """

    replica: int
    step: int
    phase: Phase = DEFAULT_PHASE
    rank: int | None = None
    fault: str = KILL
    arg: float = 1.0
    """The kind's argument, if it takes one (its kind's ``arg`` names it): how many times as long a
    microbatch takes (``slow``), the peer replica (``cut``), the microbatch id (``nan``)."""

    def __post_init__(self) -> None:
        for name in ("replica", "step") + (("rank",) if self.rank is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"failure {name} = {value!r} must be an integer >= 0")
        if self.phase not in PHASES:
            raise ConfigError(f"failure phase {self.phase!r} {phase_hint(self.phase)}")
        object.__setattr__(self, "phase", Phase(self.phase))  # a plain name becomes its member
        object.__setattr__(self, "fault", kind(self.fault).name)
        self.kind.check(self)

    @property
    def kind(self) -> FaultKind:
        """What it does (its registered kind)."""
        return kind(self.fault)

    @property
    def kills(self) -> bool:
        """Whether the replica is lost by it (a kill, hang, freeze or corruption; not a slow-down, a cut
        link, or a NaN, which loses it only if it computes that microbatch): its kind's ``kills``."""
        return self.kind.kills

    def __str__(self) -> str:
        """``R@STEP:PHASE``, with ``=KIND[:ARG]`` for other kinds than a kill (the rank travels separately,
        as ``--fail-rank``)."""
        suffix = "" if self.fault == KILL else f"={self.fault}"
        if self.kind.arg is not None:
            suffix += f":{self.arg:g}"
        return f"{self.replica}@{self.step}:{self.phase}{suffix}"

    @property
    def label(self) -> str:
        """``str(self)`` with ``#RANK`` when the rank is given: how a worker is told the spec, and how the
        event of its strike names it (``spec``)."""
        return str(self) if self.rank is None else f"{self}#{self.rank}"

    def key(self) -> tuple[int, int, int]:
        """Sort key: step, then phase order, then replica."""
        return (self.step, PHASES.index(self.phase), self.replica)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "phase": self.phase.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailureSpec:
        return cls(int(d["replica"]), int(d["step"]), str(d.get("phase", DEFAULT_PHASE)),
                   None if d.get("rank") is None else int(d["rank"]), str(d.get("fault", KILL)),
                   float(d.get("arg", d.get("factor", 1.0))))  # "factor": a config.json of an older release


def phase_hint(phase: str) -> str:
    close = difflib.get_close_matches(phase, PHASES, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"is not a phase{hint}; use one of {', '.join(PHASES)}"


def register(kind: type[FaultKind]) -> type[FaultKind]:
    """Class decorator: registers one instance of ``kind`` under its name."""
    if kind.name in _KINDS:
        raise ValueError(f"fault kind {kind.name!r} is registered twice")
    _KINDS[kind.name] = kind()
    return kind


def registered() -> dict[str, FaultKind]:
    """Every fault kind by name, in their declared order (importing :mod:`recover.faults.kinds` once)."""
    if not _FOUND:
        package = importlib.import_module("recover.faults.kinds")

        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
        _FOUND.append(True)
    return dict(sorted(_KINDS.items(), key=lambda item: item[1].order))


def kind(name: str) -> FaultKind:
    """The kind called ``name``. Raises ConfigError naming the kinds there are."""
    found = registered().get(str(name).strip().lower())
    if found is None:
        raise ConfigError(f"failure kind {name!r} is not one of {', '.join(registered())}")
    return found


def random_kinds() -> tuple[str, ...]:
    """What ``--random-failures`` can do to a replica from outside: the kinds with a signal."""
    return tuple(name for name, k in registered().items() if k.signal is not None)


def struck_by(event: dict[str, Any]) -> FaultKind | None:
    """The kind whose strike ``event`` records, if any: the kind its ``fault`` names, else the one kind writing
    that event (older run directories wrote ``slowed`` and ``link_cut`` without a ``fault``, and kills with
    none or one no longer known: a kill)."""
    found = registered().get(event.get("fault") or "")
    if event.get("kind") == Event.KILL and (found is None or found.event != Event.KILL):
        found = registered()["kill"]
    elif found is None and event.get("kind") != Event.INJECTED:
        found = next((k for k in registered().values() if k.event == event.get("kind")), None)
    return found if found is not None and found.event == event.get("kind") and found.struck(event) else None
