"""A replica whose own collectives fail is the fault: the rule for failure reports that find nobody.

Rule (pure; :class:`~recover.coord.state.MembershipState` feeds it): a failure report that names no
suspect starts a failure round; when that round closes with every member alive (nobody dead, nobody
fenced), the report found nothing, and the generation formed holds the same members. A replica whose
reports do that :data:`LIMIT` times in a row, with no commit between, is itself the fault (its process
is out of file descriptors or memory, its network stack broken: its collectives fail while every peer
answers): its next such report fences it, with that cause, instead of forming the same generation once
more, and the others recover its microbatches in the step. A commit, or a round that loses a member,
clears the count.
"""

from __future__ import annotations

LIMIT = 3
"""Barren rounds in a row after which a replica's next report that names nobody fences it."""


class BarrenReports:
    """Per replica: how many failure rounds in a row its reports started that found nobody."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def closed(self, reporter: int | None, lost_anyone: bool) -> None:
        """A failure round started by ``reporter``'s report (None: by anything else) closed."""
        if lost_anyone:
            self.counts.clear()
        elif reporter is not None:
            self.counts[reporter] = self.counts.get(reporter, 0) + 1

    def committed(self) -> None:
        """A step committed: the job moves, so nobody's reports are barren in a row."""
        self.counts.clear()

    def is_the_fault(self, replica: int, suspects: list[int]) -> bool:
        """Whether this report (naming ``suspects``) by ``replica`` fences it (see the module docstring)."""
        return not suspects and self.counts.get(replica, 0) >= LIMIT

    def cause(self, replica: int) -> str:
        """The fence's reason, for its event and the fenced replica's line."""
        return (f"its collectives failed in {self.counts.get(replica, 0)} generations in a row while every other "
                "member answered and nobody was lost: the fault is its own (out of file descriptors or memory, "
                "its network stack); the others recompute its microbatches")
