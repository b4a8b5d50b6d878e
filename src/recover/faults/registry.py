"""The fault kinds: each is one registered :class:`FaultKind`, declared in its own module of
:mod:`recover.faults.kinds`.

Contract: a kind declares everything the rest of the system asks about it, so adding one touches
its own module (and its test) only:

- its name (the ``fault`` of its specs, ``R@STEP:PHASE=NAME[:ARG]``, and of its events), one line of
  help, and its place among the kinds (``order``);
- its ``recover launch`` flag (``flag``, ``metavar``, ``usage``) and :meth:`FaultKind.parse`, which turns
  the flag's value into a :class:`~recover.faults.schedule.FailureSpec` or raises a one-line
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
``faults/``: the injection reaches production code only through the hook.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

from recover.errors import ConfigError
from recover.names import Event

if TYPE_CHECKING:
    from recover.faults.perturb import Perturbation
    from recover.faults.schedule import FailureSpec

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

    def strike(self, spec: FailureSpec, perturbation: Perturbation) -> None:
        """What the process does when ``spec`` fires (after :meth:`record` is written)."""
        raise NotImplementedError

    def record(self, spec: FailureSpec, perturbation: Perturbation) -> tuple[Event, dict[str, Any]]:
        """The event written when ``spec`` strikes and its fields (the replica is added by the writer)."""
        return self.event, {"fault": self.name, "step": spec.step}

    def struck(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` (one of :attr:`event`'s) is this kind striking (not, say, its end)."""
        return True

    def __repr__(self) -> str:
        return f"<fault kind {self.name}>"


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
