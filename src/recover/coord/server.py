"""The coordinator service: sockets for membership, failure notices, commit votes, and the c10d store.

Contract: one :class:`Coordinator` per job, in its own process (``recover coordinator``) or in a
driver that is not a worker; it must never run inside a worker, since a worker's death must not take
the store with it. It hosts the c10d ``TCPStore`` (``store_port``, bound to ``host`` unless that is a
wildcard) on which every generation's process group rendezvouses under ``gen{g}`` (lane k of replicas
of P > 1 ranks under ``gen{g}/lane{k}``), every entry sealed with the generation's secret
(:mod:`recover.coord.sealing`: the store authenticates nobody), and a TCP service (``port``,
length-prefixed JSON, :mod:`recover.coord.protocol`) to which every worker process keeps one
persistent connection (over TLS with mutual authentication when given ``tls``,
:mod:`recover.coord.tls`). Replica ids are admitted in ``[0, max_replicas)``; a joiner that has not
started its rendezvous ``join_ready_s`` after its admission is fenced (:mod:`recover.coord.admission`:
the server looks its sealed probe key up in the store it hosts).

This module only moves bytes: it accepts connections, decodes frames, hands each event to
:class:`recover.coord.ranks.RankAggregator` (authentication, timeouts, the aggregation of a
replica's ranks, and through it :class:`recover.coord.state.MembershipState`) and carries out the
actions that come back (send, close, log). The rules themselves are documented and unit-tested there.

Invariants:
  * A closed worker connection is reported at once (the replica is marked dead within the same loop
    turn); a connection silent for longer than ``heartbeat_timeout_s`` is fenced on the next tick.
  * This side is never silent either: every registered connection gets a ``beat`` every half
    heartbeat timeout (:func:`recover.coord.deadline.beat_interval`), so a worker that hears nothing
    for its read deadline knows it is cut off or this process is paused (:mod:`recover.coord.deadline`).
  * One thread runs the event loop and is the only caller of the logic: no two workers ever see
    different generations.
  * Bad peers (wrong token, garbage, oversized or malformed frames, stale generations, too many
    connections, unread output piling up) are refused or dropped, logged to ``events.jsonl``, and
    never stop the service.

Scale (:mod:`recover.coord.scale`): the heartbeat interval and timeout are adapted to the job's
size (its replicas, ranks per replica and connections per replica), and every worker is told the
interval in its ``ok``; timeouts are judged on a coarser scan clock; one notice to every member is
encoded once, whatever the number of connections; the open-files limit is raised to the hard limit
at start, and a job that needs more connections than it allows is refused before anything binds.
Long-lived objects (torch's modules, every registered rank's records) are moved out of the garbage
collector's reach (``gc.freeze``) at start and whenever a generation forms, so that a full collection
over them (tens to hundreds of ms) never lands inside a failure round; the event log reaches the disk
(``fsync``) between two turns of the loop, after their frames went out, and not while a failure round
waits for its acks.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from recover.coord import scale
from recover.coord.admission import JOIN_READY_S, JoinWatch
from recover.coord.conn import FramedConn
from recover.coord.deadline import beat_interval
from recover.coord.graylinks import FACTOR, STEPS, SlowLinks
from recover.coord.liveness import Liveness
from recover.coord.protocol import CLIENT_TYPES, ProtocolError, encode
from recover.coord.ranks import Close, Out, RankAggregator, SendTo
from recover.coord.state import MembershipState
from recover.coord.tls import Tls
from recover.errors import ConfigError
from recover.names import Event
from recover.observe.events import EventLog

MAX_OUTBUF = 4 << 20  # a peer that lets this much pile up unread is dropped
MAX_CONNECTIONS = 4096
"""Connections accepted before :meth:`Coordinator.start` has read the open-files limit; from then on
``Coordinator.max_connections`` (that limit less :data:`recover.coord.scale.RESERVED_FDS`)."""


WILDCARDS = ("", "0.0.0.0", "::")


def _store_listener(host: str, port: int) -> int | None:
    """The store's listening socket, bound to ``host`` (its file descriptor, handed over to the store,
    which closes it); None for a wildcard ``host``: the store then binds every interface itself."""
    if host in WILDCARDS:
        return None
    family = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=4096).detach()


def advertised(host: str, advertise_host: str | None = None) -> str:
    """Where replicas reach the coordinator's store: ``advertise_host`` when given, else the bound
    ``host``, unless that is a wildcard (0.0.0.0, ::), which names no machine to connect to: then this
    machine's name. Behind a Kubernetes Service, or when the name does not resolve to a reachable
    address elsewhere, give ``advertise_host`` (``recover coordinator --advertise-host``)."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in WILDCARDS else host


class Coordinator:
    """Serves membership for ``expected_replicas`` replicas (see the module docstring).

    Args:
        host, port: where workers connect (127.0.0.1 unless told otherwise; 0 picks a free port).
        token: the shared secret a worker must present to register.
        events_path: ``events.jsonl`` for membership changes, failures and refusals (None: no log).
        heartbeat_interval_s: how often workers heartbeat, at least (raised for large jobs, see
            :func:`recover.coord.scale.cadence`; sets the loop's tick).
        heartbeat_timeout_s: silence after which a registered replica is declared dead, at least.
        store_port: the c10d TCPStore's port (0 picks a free one).
        min_members: the quorum; generations below it are logged as ``quorum_lost``.
        expected_replicas: the first generation forms when this many replicas have registered.
        register_timeout_s: an unregistered connection is closed after this long.
        hang_timeout_s: a replica that makes no progress this long while others wait for it is fenced
            as hung; 0 derives it from the step time (:mod:`recover.coord.liveness`).
        die_at_commit: fault injection: ``(step, sent)`` SIGKILLs this process in the middle of step
            ``step``'s commit, once ``sent`` of its ``committed`` replies went out (0: none did).
        ranks_per_replica: processes per replica (for the job's size).
        per_replica_connections: each replica reaches the coordinator through one connection (a relay,
            :mod:`recover.coord.relay`) instead of one per rank.
        advertise_host: the address replicas are told to reach the c10d store at (:func:`advertised`).
        max_replicas: replica ids are admitted in ``[0, max_replicas)`` (None: ``expected_replicas``).
        join_ready_s: an admitted joiner that has not started its rendezvous this long after its
            admission is fenced (:mod:`recover.coord.admission`).
        tls: serve the wire over TLS, every worker (or relay) presenting a certificate signed by the
            job's CA (:mod:`recover.coord.tls`; None: plain TCP).
        on_event: called as ``(kind, fields)`` with every record logged (``events.jsonl``'s), in order, from
            the loop thread (the job's metrics, :class:`recover.observe.jobmetrics.JobMetrics`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str, events_path: str | None = None,
                 heartbeat_interval_s: float = 0.1, heartbeat_timeout_s: float = 1.0, store_port: int = 0,
                 min_members: int = 1, expected_replicas: int = 1, register_timeout_s: float = 10.0,
                 hang_timeout_s: float = 0.0, die_at_commit: tuple[int, int] | None = None,
                 ranks_per_replica: int = 1, per_replica_connections: bool = False,
                 advertise_host: str | None = None, max_replicas: int | None = None,
                 join_ready_s: float = JOIN_READY_S, tls: Tls | None = None, start_timeout_s: float = 60.0,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 slow_link: tuple[float, int] = (FACTOR, STEPS)) -> None:
        if not token:
            raise ValueError("token must be a non-empty string")
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed "
                             f"heartbeat_interval_s ({heartbeat_interval_s})")
        self.host = host
        self.advertise_host = advertised(host, advertise_host)
        self._req_port = port
        self._req_store_port = store_port
        self._token = token
        self._events = EventLog(events_path, deferred_sync=True) if events_path else None  # synced between turns
        self._on_event = on_event
        self.connections, ranks = scale.job_connections(expected_replicas, ranks_per_replica, per_replica_connections)
        self.heartbeat_interval_s, self.heartbeat_timeout_s = scale.cadence(
            heartbeat_interval_s, heartbeat_timeout_s, self.connections, ranks)
        self.max_connections = MAX_CONNECTIONS
        self.min_members = min_members
        self.expected_replicas = expected_replicas
        self.max_replicas = max_replicas
        self._joins = JoinWatch(join_ready_s)
        self.tls = tls
        self._tls_ctx = tls.server() if tls is not None else None
        self.register_timeout_s = register_timeout_s
        self.start_timeout_s = start_timeout_s
        self.slow_link = slow_link
        """The slow-link rule's (factor, steps) (:mod:`recover.coord.graylinks`)."""
        self.hang_timeout_s = hang_timeout_s
        self.die_at_commit = die_at_commit
        self._replies_sent = 0  # committed replies of the die_at_commit step sent so far
        self._tick_s = min(0.02, self.heartbeat_interval_s / 2)
        self._cond = threading.Condition()
        self._conns: set[FramedConn] = set()
        self._stopping = False
        self.failure: Exception | None = None
        """What broke the serving loop, if anything (:meth:`serve_forever` raises it)."""
        self._stop_job = False  # request_stop() was called: handed to the loop
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self.state: MembershipState | None = None
        self.aggregator: RankAggregator | None = None
        self.port = 0
        self.store_port = 0

    # ------------------------------------------------------------- lifecycle

    def start(self) -> Coordinator:
        """Binds the store and the service, then serves in a background thread; returns at once.

        Raises:
            ConfigError: the job needs more connections than the open-files limit allows.
        """
        from torch.distributed import TCPStore

        soft, hard = scale.raise_open_files()
        problem = scale.check_connections(self.connections, soft, hard)
        if problem is not None:
            raise ConfigError(problem)
        self.max_connections = scale.max_connections(soft)

        self._store = TCPStore(self.host, self._req_store_port, None, True, timedelta(seconds=300),
                               wait_for_workers=False, multi_tenant=False,
                               master_listen_fd=_store_listener(self.host, self._req_store_port))
        self.store_port = int(self._store.port)
        gc.freeze()  # torch's objects live as long as this process: no collection should walk them
        self._listener = socket.create_server((self.host, self._req_port), backlog=512)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.state = MembershipState(expected=self.expected_replicas, min_members=self.min_members,
                                     store_host=self.advertise_host, store_port=self.store_port,
                                     ack_timeout_s=self.heartbeat_timeout_s, max_replicas=self.max_replicas,
                                     start_timeout_s=self.start_timeout_s, slow=SlowLinks(*self.slow_link))
        self.aggregator = RankAggregator(
            self.state, token=self._token, heartbeat_timeout_s=self.heartbeat_timeout_s,
            register_timeout_s=self.register_timeout_s, liveness=Liveness(self.hang_timeout_s),
            heartbeat_s=self.heartbeat_interval_s, beat_s=beat_interval(self.heartbeat_timeout_s),
            scan_s=scale.scan_interval(self.heartbeat_timeout_s, self.register_timeout_s, self.hang_timeout_s))
        self._log(Event.COORDINATOR_START, host=self.host, advertise_host=self.advertise_host, port=self.port,
                  store_port=self.store_port, tls=self.tls is not None, cpu_s=round(time.process_time(), 3),
                  expected_replicas=self.expected_replicas, max_replicas=self.state.max_replicas,
                  heartbeat_s=self.heartbeat_interval_s,
                  heartbeat_timeout_s=self.heartbeat_timeout_s, connections=self.connections,
                  max_connections=self.max_connections)
        self._thread = threading.Thread(target=self._serve, name="recover-coordinator", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Starts (if needed) and blocks until :meth:`stop`, KeyboardInterrupt, or the end of a job that
        was stopped (a stop committed and every replica gone)."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        try:
            while self._thread.is_alive() and not self.finished:
                self._thread.join(0.2)
            if self.failure is not None:  # the loop broke: the process says so and fails (not a quiet 0)
                raise self.failure
        finally:
            self.stop()

    def request_stop(self) -> None:
        """Stops the job gracefully: its next commit is a stop (every member saves nothing but the lowest
        live replica's checkpoint, then exits). Safe from a signal handler: the loop carries it out."""
        self._stop_job = True
        try:
            self._wake_w.send(b"s")
        except OSError:
            pass

    @property
    def finished(self) -> bool:
        """A stop was committed and no replica is registered any more."""
        state = self.state
        return state is not None and state.stopped and not state.live

    def stop(self) -> None:
        """Stops serving, closes every connection and the store. Idempotent."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5.0)
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()
        self._log(Event.COORDINATOR_STOP)
        if self._events is not None:
            self._events.close()
        self._store = None

    def snapshot(self) -> dict[str, Any]:
        """Generation, members, committed step and live replicas, read consistently (for tests, CLI);
        ``registering`` maps a replica still waiting for some of its ranks to the ranks in so far."""
        with self._cond:
            assert self.aggregator is not None, "start() the coordinator first"
            return self.aggregator.snapshot()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """Blocks until ``predicate(snapshot)`` holds; returns that snapshot. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                snap = self.snapshot()
                if predicate(snap):
                    return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"coordinator state did not reach the condition: {snap}")
                self._cond.wait(min(left, 0.1))

    # ------------------------------------------------------------- the loop

    def _serve(self) -> None:
        """The loop's thread: an exception that breaks the loop is kept in :attr:`failure` (and the event
        log's ``coordinator_failed``) for :meth:`serve_forever` to raise, not printed from the thread."""
        try:
            self._loop()
        except Exception as exc:  # whatever it is: serve_forever raises it
            self.failure = exc
            self._log(Event.COORDINATOR_FAILED, error=f"{type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        """Serves until stopped. Judge others only when running: when this loop was not scheduled for
        longer than half the heartbeat timeout (a VM pause, swapping, SIGSTOP), it first reads
        everything pending and gives every connection a fresh grace before any timeout is judged."""
        agg = self.aggregator
        assert agg is not None
        last = time.monotonic()
        formed = 0
        while not self._stopping:
            events = self._sel.select(self._tick_s)
            now = time.monotonic()
            stall, last = now - last - self._tick_s, now  # from the last pass's start: a pause inside a pass counts
            with self._cond:
                if self._stop_job:
                    self._stop_job = False
                    self._run(agg.on_stop_requested(now))
                self._handle(events, now)
                if stall > self.heartbeat_timeout_s / 2:
                    for _ in range(1000):  # bounded: what arrived while we were not running
                        pending = self._sel.select(0)
                        if not pending:
                            break
                        self._handle(pending, now)
                    self._joins.pause(stall)
                    self._run(agg.on_resumed(stall, now))
                self._run(agg.on_tick(now))
                self._check_joiners(now)
                self._cond.notify_all()
                if agg.state.generation != formed:  # the records of its members will live on
                    formed = agg.state.generation
                    if agg.state.current is not None:
                        self._joins.formed(agg.state.current, self._lanes_of, now)
                    gc.freeze()
            if self._events is not None and not agg.state.failing:  # after the turn's frames went out, and never
                self._events.sync_due()  # while a failure round waits for acks (fsync: 0.3-12 ms on a VM disk)

    def _lanes_of(self, replica: int) -> int | None:
        assert self.aggregator is not None
        slot = self.aggregator.slots.get(replica)
        return slot.ranks if slot is not None else None

    def _check_joiners(self, now: float) -> None:
        """Fences the admitted joiners that did not start their rendezvous in time (:mod:`recover.coord.admission`)."""
        assert self.aggregator is not None
        late = self._joins.due(now, lambda key: bool(self._store.check([key])))
        if late:
            self._run(self.aggregator.on_not_ready(
                late, f"admitted but did not start its rendezvous within {self._joins.ready_s:g} s", now))

    def _handle(self, events: list[tuple[Any, int]], now: float) -> None:
        for key, mask in events:
            if key.data == "accept":
                self._accept(now)
            elif key.data == "wake":
                self._drain_wake()
            else:
                conn: FramedConn = key.data
                if mask & selectors.EVENT_WRITE and not conn.closed:
                    conn.flush()
                if mask & selectors.EVENT_READ and not conn.closed:
                    self._read(conn, now)

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _accept(self, now: float) -> None:
        assert self.aggregator is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            peer = f"{addr[0]}:{addr[1]}"
            if len(self._conns) >= self.max_connections:
                sock.close()
                self._log(Event.REFUSED, peer=peer, code="too_many_connections")
                continue
            if self.tls is not None:
                assert self._tls_ctx is not None  # made with tls
                sock = self.tls.accept(self._tls_ctx, sock)
            conn = FramedConn(sock, CLIENT_TYPES).register(self._sel)
            self._conns.add(conn)
            self.aggregator.on_open(conn, peer, now)

    def _read(self, conn: FramedConn, now: float) -> None:
        agg = self.aggregator
        assert agg is not None
        try:
            items = conn.receive()
        except EOFError:
            if conn.error is not None:
                self._log(Event.REFUSED, code="tls", message=str(conn.error))
            self._run(agg.on_closed(conn, "connection_closed", now))
            return
        except ProtocolError as exc:  # the stream is out of sync
            agg.on_heard(conn, now)
            self._run(agg.on_bad_frame(conn, exc, now))
            return
        if items is None:
            return
        agg.on_heard(conn, now)
        for item in items:
            if conn.closed:
                return
            if isinstance(item, ProtocolError):
                self._run(agg.on_bad_frame(conn, item, now))
            else:
                out = agg.on_message(conn, item, now)
                if out:  # most messages (heartbeats, acks of a round still open) ask for nothing
                    self._run(out)

    # ------------------------------------------------------------- actions

    def _run(self, actions: list[Out]) -> None:
        frames: dict[int, bytes] = {}  # a notice to every member is one dict: encoded once (ids stay valid
        dying = self.die_at_commit is not None  # while ``actions`` holds the messages)
        for act in actions:
            if isinstance(act, SendTo):
                if dying:
                    self._maybe_die(act.msg, before=True)
                frame = frames.get(id(act.msg))
                if frame is None:
                    frame = frames[id(act.msg)] = encode(act.msg)
                assert isinstance(act.conn, FramedConn)  # the logic's connections are this server's
                self._send(act.conn, frame)
                if dying:
                    self._maybe_die(act.msg, before=False)
            elif isinstance(act, Close):
                assert isinstance(act.conn, FramedConn)
                self._close(act.conn)
            else:
                self._log(act.kind, **act.fields)

    def _maybe_die(self, msg: dict[str, Any], before: bool) -> None:
        """Fault injection (``die_at_commit``): a coordinator killed while its commit replies go out."""
        if self.die_at_commit is None or msg["type"] != "committed" or msg["step"] != self.die_at_commit[0]:
            return
        self._replies_sent += 0 if before else 1
        if self._replies_sent >= self.die_at_commit[1]:
            self._log(Event.COORDINATOR_KILLED, step=msg["step"], replies_sent=self._replies_sent)
            os.kill(os.getpid(), signal.SIGKILL)

    def _send(self, conn: FramedConn, frame: bytes) -> None:
        if conn.closed:
            return
        if not conn.out:  # nothing queued: straight to the socket (what it does not take is queued)
            conn.send(frame)
            return
        conn.out += frame
        if len(conn.out) > MAX_OUTBUF:
            assert self.aggregator is not None
            self._run(self.aggregator.on_closed(conn, "slow_consumer", time.monotonic()))
            return
        conn.flush()

    def _close(self, conn: FramedConn) -> None:
        self._conns.discard(conn)
        conn.close()

    def _log(self, kind: Event, **fields: Any) -> None:
        if self._events is not None:
            self._events.event(kind, **fields)
        if self._on_event is not None:
            self._on_event(kind, fields)
