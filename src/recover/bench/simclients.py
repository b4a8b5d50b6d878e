"""Simulated coordinator clients for ``recover bench coordinator``: thousands per process, one selector loop.

Contract: :func:`serve` runs in a worker process (started by :mod:`recover.bench.coordinator`) and
owns a share of the job's connections, whole replicas only (so one worker kills a replica). Each
connection speaks the real wire protocol (:mod:`recover.coord.protocol`) to a real coordinator:

* ``rank`` mode: one connection per rank (``register`` with ``rank=k, ranks=P``), each with its
  own ``hb`` (progress, activity, generation), its own ``ack`` of every ``failing`` notice and,
  with a step rate, its own commit ``vote``: what every rank's ``CoordinatorClient`` does today.
* ``replica`` mode: one connection per replica, registered with ``relay=true`` for its P ranks:
  one batched ``hbs`` per interval (every rank's progress, activity and generation), one ``ack``
  for all ranks, and one ``vote`` for all ranks, as a replica's relay sends them once its ranks
  agree (:mod:`recover.coord.relay`); the relay's own fan-out to its local ranks is not simulated.

Heartbeats follow the interval the coordinator's ``ok`` reply names (``heartbeat_s``; the given
interval when it names none), spread evenly over the interval across the connections. Progress
advances by one at every heartbeat (the worst case for the coordinator: nothing repeats).

Control (a ``multiprocessing`` connection, polled in the same loop): ``("status",)`` answers
``(connections, in_first_generation, newest_generation, fenced)``; ``("kill", replica)`` closes
that replica's connection(s) at once and answers the ``time.monotonic()`` of the kill;
``("round", g)`` answers, per live connection, the ``time.monotonic()`` it received the first
membership newer than ``g`` (None: not yet); ``("stop",)`` ends the process. ``time.monotonic``
is the system-wide CLOCK_MONOTONIC on Linux, so times compare across the processes.
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from recover.coord.conn import FramedConn
from recover.coord.protocol import SERVER_TYPES, ProtocolError, batch_message, encode

CONNECT_CHUNK = 64
"""Connections opened between two turns of serving those already open."""


@dataclass(eq=False)
class SimConn:
    """One simulated connection: a rank of a replica, or a whole replica (``relay``)."""

    replica: int
    rank: int
    ranks: int
    relay: bool
    wire: FramedConn | None = None
    ids: Any = field(default_factory=lambda: itertools.count(1))
    got: dict[int, float] = field(default_factory=dict)  # generation -> when its membership arrived
    newest: int = 0
    committed: int = -1
    progress: int = 0
    fenced: bool = False
    dead: bool = False
    hb_s: float | None = None


class Sim:
    """The connections of one worker process and their loop (see the module docstring)."""

    def __init__(self, host: str, port: int, token: str, conns: list[SimConn], hb_s: float,
                 step_s: float = 0.0, microbatches: int = 8) -> None:
        self.host, self.port, self.token = host, port, token
        self.conns = conns
        self.hb_s, self.step_s, self.microbatches = hb_s, step_s, microbatches
        self.sel = selectors.DefaultSelector()
        self._due: list[tuple[float, int, SimConn]] = []  # heartbeat heap: (when, tie, conn)
        self._tie = itertools.count()
        self._next_step = 0.0

    # ------------------------------------------------------------ setup

    def connect_all(self) -> None:
        """Connects and registers every connection (blocking connects, then non-blocking I/O), serving
        the ones already connected between chunks: a replica registered early must not miss its
        heartbeats while thousands of others still connect."""
        now = time.monotonic()
        for i, c in enumerate(self.conns):
            if i % CONNECT_CHUNK == 0 and i:
                self.pump(0.0)
            sock = socket.create_connection((self.host, self.port), timeout=60)
            c.wire = FramedConn(sock, SERVER_TYPES).register(self.sel, c)
            reg: dict[str, Any] = {"type": "register", "token": self.token, "replica": c.replica, "join": False,
                                   "ranks": c.ranks, "id": next(c.ids)}
            if c.relay:
                reg["relay"] = True
            else:
                reg["rank"] = c.rank
            self._send(c, reg)
            heapq.heappush(self._due, (now + self.hb_s * (1 + i / len(self.conns)), next(self._tie), c))

    # ------------------------------------------------------------ I/O

    def _send(self, c: SimConn, msg: dict[str, Any]) -> None:
        if c.dead or c.wire is None:
            return
        if not c.wire.send(encode(msg)):
            self._lose(c)

    def _lose(self, c: SimConn) -> None:
        if c.dead:
            return
        c.dead = True
        if c.wire is not None:
            c.wire.close()

    def _read(self, c: SimConn, now: float) -> None:
        assert c.wire is not None
        try:
            items = c.wire.receive() or []
        except (EOFError, ProtocolError):
            self._lose(c)
            return
        for msg in items:
            if isinstance(msg, ProtocolError):
                self._lose(c)
                return
            self._on_message(c, msg, now)

    def _on_message(self, c: SimConn, msg: dict[str, Any], now: float) -> None:
        kind = msg["type"]
        if kind == "membership" and msg["membership"] is not None:
            g = msg["membership"]["generation"]
            c.got.setdefault(g, now)
            c.newest = max(c.newest, g)
            c.committed = max(c.committed, msg["membership"]["step"] - 1)
        elif kind == "failing":
            self._send(c, {"type": "ack", "generation": msg["generation"]})
        elif kind == "ok" and "heartbeat_s" in msg:
            c.hb_s = float(msg["heartbeat_s"])
        elif kind == "committed":
            c.committed = max(c.committed, msg["step"])
        elif kind == "error" and msg.get("code") == "fenced":
            c.fenced = True

    # ------------------------------------------------------------ periodic work

    def _heartbeats(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            _, _, c = heapq.heappop(self._due)
            if c.dead:
                continue
            c.progress += 1
            if c.relay:  # every rank heard since the last batch, as the relay writes it (recover.coord.relay)
                self._send(c, batch_message(list(range(c.ranks)), [c.progress] * c.ranks, "c" * c.ranks,
                                            [c.newest] * c.ranks, c.ranks))
            else:
                self._send(c, {"type": "hb", "progress": c.progress, "activity": "compute", "generation": c.newest})
            heapq.heappush(self._due, (now + (c.hb_s or self.hb_s), next(self._tie), c))

    def _votes(self, now: float) -> None:
        if self.step_s <= 0 or now < self._next_step:
            return
        self._next_step = now + self.step_s
        ids = list(range(self.microbatches))
        for c in self.conns:
            if c.dead or not c.newest:
                continue
            self._send(c, {"type": "vote", "generation": c.newest, "step": c.committed + 1, "ids": ids,
                           "id": next(c.ids)})

    # ------------------------------------------------------------ control

    def command(self, cmd: tuple[Any, ...]) -> Any:
        if cmd[0] == "status":
            live = [c for c in self.conns if not c.dead]
            return (len(live), sum(1 for c in live if c.newest >= 1), max((c.newest for c in live), default=0),
                    sum(1 for c in self.conns if c.fenced))
        if cmd[0] == "kill":
            t = time.monotonic()
            for c in self.conns:
                if c.replica == cmd[1]:
                    self._lose(c)
            return t
        if cmd[0] == "round":
            g = cmd[1]
            return [min((t for gen, t in c.got.items() if gen > g), default=None)
                    for c in self.conns if not c.dead]
        raise ValueError(f"unknown command {cmd!r}")

    def pump(self, wait: float, ctrl: Any = None) -> bool:
        """One turn: I/O ready within ``wait`` seconds, then due heartbeats and votes. Returns False
        once ``ctrl`` says stop."""
        for key, mask in self.sel.select(wait):
            now = time.monotonic()
            if key.data == "ctrl":
                cmd = ctrl.recv()
                if cmd[0] == "stop":
                    return False
                ctrl.send(self.command(cmd))
                continue
            c: SimConn = key.data
            if mask & selectors.EVENT_WRITE and not c.dead and c.wire is not None and not c.wire.flush():
                self._lose(c)
            if mask & selectors.EVENT_READ and not c.dead:
                self._read(c, now)
        now = time.monotonic()
        self._heartbeats(now)
        self._votes(now)
        return True

    def loop(self, ctrl: Any) -> None:
        """Serves the connections and the control channel ``ctrl`` until ``("stop",)``."""
        self.sel.register(ctrl, selectors.EVENT_READ, "ctrl")
        while self.pump(max(0.0, min(self._due[0][0] - time.monotonic() if self._due else 0.05, 0.05)), ctrl):
            pass


def layout_conns(replicas: list[int], ranks: int, relay: bool) -> list[SimConn]:
    """The connections of ``replicas`` (each of ``ranks`` ranks): one per rank, or one per replica."""
    if relay:
        return [SimConn(r, 0, ranks, True) for r in replicas]
    return [SimConn(r, k, ranks, False) for r in replicas for k in range(ranks)]


def serve(ctrl: Any, host: str, port: int, token: str, replicas: list[int], ranks: int, relay: bool,
          hb_s: float, step_s: float) -> None:
    """Worker process entry: connects ``replicas``' connections, answers ``("ready", n)``, then loops."""
    sim = Sim(host, port, token, layout_conns(replicas, ranks, relay), hb_s, step_s)
    try:
        sim.connect_all()
    except OSError as exc:
        ctrl.send(("error", f"cannot connect to the coordinator at {host}:{port}: {exc}"))
        return
    ctrl.send(("ready", len(sim.conns)))
    sim.loop(ctrl)
