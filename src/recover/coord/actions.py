"""The vocabulary of the coordinator's pure logic: the actions it returns and the refusal it raises.

The membership state (:mod:`recover.coord.state`), its integrity checks (:mod:`recover.coord.integrity`)
and the rank logic (:mod:`recover.coord.ranks`, :mod:`recover.coord.member`) return :data:`Action`
lists that their caller carries out in order, and raise :class:`Refused` for a request they will not act
on (their state unchanged); the ``code`` and ``message`` go back in the ``error`` reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recover.names import Event


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to every connection of ``replica`` (a reply: to the one that asked)."""

    replica: int
    msg: dict[str, Any]


@dataclass(frozen=True)
class Fence:
    """Close this replica's connection: it is declared dead and must not act on its own."""

    replica: int
    reason: str


@dataclass(frozen=True)
class Log:
    """An ``events.jsonl`` record; its kind is an :class:`~recover.names.Event` member (a plain string is refused)."""

    kind: Event
    fields: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Event):
            raise TypeError(f"Log kind {self.kind!r} is not a recover.names.Event member")


Action = Send | Fence | Log


class Refused(Exception):
    """A request the coordinator will not act on; ``code`` goes back in the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
