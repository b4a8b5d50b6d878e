"""Typed errors shared by every layer.

User-facing errors derive from :class:`RecoverError`; the CLI prints them as one line
(``recover: error: ...``) and exits with status 2, never with a traceback. Errors that are part
of the step protocol (:class:`PeerFailure`) are caught in exactly one place, the recovery loop.
:func:`require` is the one-line ConfigError of a field that is not allowed.
"""

from __future__ import annotations

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
