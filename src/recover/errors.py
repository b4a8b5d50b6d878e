"""Typed errors shared by every layer.

User-facing errors derive from :class:`RecoverError`; the CLI prints them as one line
(``recover: error: ...``) and exits with status 2, never with a traceback. Errors that are part
of the step protocol (:class:`PeerFailure`) are caught in exactly one place, the recovery loop.
:func:`require` is the one-line ConfigError of a field that is not allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class RecoverError(Exception):
    """A problem the user can fix; the message names what is wrong and how to fix it."""


class ConfigError(RecoverError, ValueError):
    """An invalid configuration field, preset or command-line override."""


class DataError(RecoverError):
    """A bad token shard, tokenizer or corpus."""


class CheckpointError(RecoverError):
    """A missing, incomplete or incompatible checkpoint."""


class ContractError(RecoverError, ValueError):
    """A user's script breaks a contract of :mod:`recover.api` (its optimizer, its initial weights, an impure
    ``samples``): training on would give a wrong result without a word; the message names the fix."""


class IncompatibleCheckpoint(CheckpointError):
    """A complete checkpoint of another model: an older one would not fit either, so none is tried."""


class QuorumLost(RecoverError):
    """Fewer live replicas than ``fault_tolerance.min_replicas``: the job stops with a checkpoint."""


class StateLost(RecoverError):
    """Every replica that held the training state was lost and there is no intact checkpoint to fall back to."""


class PeerFailure(Exception):
    """One or more replicas of ``generation`` died; raised by a fault-tolerant collective.

    Attributes:
        generation: the membership generation whose process group is now broken.
        dead: the replica ids known to be dead (sorted, may be empty if only the backend noticed).
    """

    def __init__(self, generation: int, dead: tuple[int, ...] | list[int], reason: str = "") -> None:
        self.generation = int(generation)
        self.dead = tuple(sorted(int(r) for r in dead))
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"peer failure in generation {self.generation}, dead replicas {list(self.dead)}{detail}")


def require(ok: bool, name: str, value: Any, allowed: str) -> None:
    """Raises the one-line ConfigError ``{name} = {value!r} is not allowed: {allowed}`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name} = {value!r} is not allowed: {allowed}")


MAX_INT = 2**63 - 1
"""The largest integer a field may hold: torch and numpy keep them as 64-bit integers."""
MAX_SECONDS = 30 * 24 * 3600.0
"""The longest duration a ``*_s`` field may hold (30 days): a timeout beyond it is a typo, not a wish."""


def check_numbers(section: Any, prefix: str) -> None:
    """The range every numeric field of a config section dataclass must be in, whatever the field:
    a float is finite (``inf`` and ``nan`` are refused: they pass ``> 0`` checks and end a job at its
    first step), an integer fits 64 bits, and a duration in seconds (a ``*_s`` field) is at most
    :data:`MAX_SECONDS`. Each section's own checks (signs, relations) come after this one.

    Raises:
        ConfigError: one line naming ``prefix.field``, the value and what is allowed.
    """
    for f in dataclasses.fields(section):
        value, name = getattr(section, f.name), f"{prefix}.{f.name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float):
            require(math.isfinite(value), name, value, "a finite number")
        else:
            require(abs(value) <= MAX_INT, name, value, f"an integer of at most {MAX_INT} (64 bits)")
        if f.name.endswith("_s"):
            require(value <= MAX_SECONDS, name, value, f"at most {MAX_SECONDS:.0f} seconds (30 days)")


class CoordinatorLost(RecoverError):
    """The coordinator connection closed, or the coordinator fenced this replica off."""


class CoordinatorRefused(RecoverError):
    """The coordinator refused a request (``code`` says why, e.g. ``unauthorized``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"coordinator refused the request: {code}: {message}")
        self.code = code


class Diverged(RecoverError):
    """The coordinator ended the job: the replicas' parameters disagree with no majority to trust
    (``code`` ``diverged``; ``sides`` maps each fingerprint to the replicas holding it), or a
    microbatch was not finite on two replicas (``nonfinite``: a true divergence of the training)."""

    def __init__(self, code: str, message: str, sides: dict[str, list[int]] | None = None) -> None:
        super().__init__(message)
        self.code, self.sides = code, sides or {}


class Expelled(RecoverError):
    """This replica is not a member of the newest generation (it was declared dead)."""
