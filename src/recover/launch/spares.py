"""The warm pool of ``recover launch``: spare workers that started up and wait to be told which replica to be.

A replacement replica spends seconds starting (Python, torch, the model, the data index) and
milliseconds joining; a spare pays the seconds before any replica dies. Contract:
- A spare is the P processes of one replica (``recover worker --spare``: rank k of a replica of
  several ranks forms its own intra-replica group while it starts up) on a set of devices of its own
  (:data:`Devices`), blocked on its stdin until the supervisor writes it one order (its replica id
  and failures); it then registers as a joiner and takes the survivors' state like a replica started
  afresh, so a run's trajectory does not depend on where its replacements came from.
- The pool holds ``size`` device sets. Each spare holds one; a spare given a replica keeps it, and
  the devices of the replica it replaces (gone by then) come back to the pool for the spare started
  behind it. On the CPU every set is the CPU; on GPUs the sets are GPUs no rank was placed on.
- :meth:`SparePool.take` gives the oldest spare still running (the one most likely to have started
  up; one still starting up beats a process not started), or None when there is none.
- A spare that exits by itself (it never does, unless killed or broken) is dropped by
  :meth:`SparePool.reap` and started again, :data:`MAX_EXITS` times in all; then the pool stops
  (replacements start afresh).
- :meth:`SparePool.close` SIGKILLs and reaps every spare and starts none any more: after it, no spare
  runs. The pool starts processes only through its ``start`` callable, and never signals any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from recover.launch.processes import Spawned, kill_processes

Devices = tuple[str | None, ...]
"""The device of each rank of a replica or spare: a GPU id (``CUDA_VISIBLE_DEVICES``), or None for the CPU."""

MAX_EXITS = 3
"""Spares that may exit by themselves before the pool stops starting new ones."""


@dataclass
class Spare:
    """One spare: its ranks' processes (rank 0 first), their devices and when they were started."""

    ranks: list[Spawned]
    devices: Devices
    started: float = field(default_factory=time.time)

    def running(self) -> bool:
        """Whether every rank still runs."""
        return all(r.proc.poll() is None for r in self.ranks)

    def order(self, line: bytes) -> None:
        """Tells every rank who to be (one line on its stdin, then EOF)."""
        for rank in self.ranks:
            assert rank.proc.stdin is not None
            rank.proc.stdin.write(line)
            rank.proc.stdin.close()

    def end(self) -> None:
        """SIGKILLs and reaps its processes; closes their logs and pipes."""
        kill_processes([r.proc for r in self.ranks])
        for rank in self.ranks:
            if rank.proc.stdin is not None and not rank.proc.stdin.closed:
                rank.proc.stdin.close()
            rank.log.close()


class SparePool:
    """``len(devices)`` spares kept started (see the module docstring).

    Args:
        devices: one device set per spare the pool keeps (empty: no pool).
        start: starts a spare's processes on a device set (each with a stdin pipe).
    """

    def __init__(self, devices: list[Devices], start: Callable[[Devices], list[Spawned]]) -> None:
        self.free = list(devices)
        """Device sets no spare holds."""
        self.spares: list[Spare] = []
        self.start = start
        self.exits = 0
        """Spares that exited by themselves."""
        self.closed = False

    @property
    def gave_up(self) -> bool:
        """Whether :data:`MAX_EXITS` spares exited by themselves (no spare starts any more)."""
        return self.exits >= MAX_EXITS

    def fill(self) -> None:
        """Starts a spare on every free device set (unless the pool is closed or gave up)."""
        while self.free and not self.closed and not self.gave_up:
            devices = self.free.pop(0)
            self.spares.append(Spare(self.start(devices), devices))

    def take(self, replacing: Devices) -> Spare | None:
        """The oldest running spare, to become the replica that ran on ``replacing`` (whose devices come back
        to the pool, and a spare starts on them); None when no spare runs."""
        for spare in self.spares:
            if spare.running():
                self.spares.remove(spare)
                self.free.append(replacing)
                self.fill()
                return spare
        return None

    def reap(self) -> list[Spare]:
        """The spares that exited by themselves since the last call: ended, their devices freed, replaced
        (see :data:`MAX_EXITS`)."""
        gone = [s for s in self.spares if not s.running()]
        for spare in gone:
            self.spares.remove(spare)
            spare.end()
            self.free.append(spare.devices)
            self.exits += 1
        if gone:
            self.fill()
        return gone

    def close(self) -> None:
        """Ends every spare; none starts after this."""
        self.closed = True
        for spare in self.spares:
            spare.end()
        self.spares = []


__all__ = ["MAX_EXITS", "Devices", "Spare", "SparePool"]
