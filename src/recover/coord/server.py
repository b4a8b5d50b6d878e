"""The coordinator service: membership, failure notices, commit votes, joins, and the c10d store.

Contract: one :class:`Coordinator` per job, in its own process (``recover coordinator``) or in a
driver that is not a worker; it must never run inside a worker, since a worker's death must not take
the store with it. It hosts the c10d ``TCPStore`` (``store_port``) on which every generation's process
group rendezvouses under ``PrefixStore(f"gen{g}")``, and a TCP service (``port``, length-prefixed
JSON, :mod:`recover.coord.protocol`) to which every worker keeps one persistent connection.

Invariants:
  * A closed worker connection marks that replica dead at once; a connection silent for longer than
    ``heartbeat_timeout_s`` (a frozen process) is fenced (closed) and marked dead.
  * One thread runs the event loop and is the only writer of the membership state
    (:class:`recover.coord.state.MembershipState`): no two workers ever see different generations.
  * Bad peers (wrong token, garbage, oversized or malformed frames, stale generations) get an error
    reply, are logged to ``events.jsonl`` as ``refused``, and never stop the service.
"""

from __future__ import annotations

import hmac
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from recover.coord.protocol import CLIENT_TYPES, FrameDecoder, ProtocolError, encode
from recover.coord.state import Action, Fence, Log, MembershipState, Refused, Send
from recover.observe.events import EventLog

MAX_OUTBUF = 4 << 20  # a peer that lets this much pile up unread is dropped
MAX_CONNECTIONS = 4096


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    opened: float
    last_seen: float
    decoder: FrameDecoder = field(default_factory=lambda: FrameDecoder(CLIENT_TYPES))
    out: bytearray = field(default_factory=bytearray)
    replica: int | None = None
    closed: bool = False


class Coordinator:
    """Serves membership for ``expected_replicas`` replicas (see the module docstring).

    Args:
        host, port: where workers connect (127.0.0.1 unless told otherwise; 0 picks a free port).
        token: the shared secret a worker must present to register.
        events_path: ``events.jsonl`` for membership changes, failures and refusals (None: no log).
        heartbeat_interval_s: how often workers heartbeat (sets the loop's tick).
        heartbeat_timeout_s: silence after which a registered replica is declared dead.
        store_port: the c10d TCPStore's port (0 picks a free one).
        min_members: the quorum; generations below it are logged as ``quorum_lost``.
        expected_replicas: the first generation forms when this many replicas have registered.
        register_timeout_s: an unregistered connection is closed after this long.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str, events_path: str | None = None,
                 heartbeat_interval_s: float = 0.1, heartbeat_timeout_s: float = 1.0, store_port: int = 0,
                 min_members: int = 1, expected_replicas: int = 1, register_timeout_s: float = 10.0) -> None:
        if not token:
            raise ValueError("token must be a non-empty string")
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed "
                             f"heartbeat_interval_s ({heartbeat_interval_s})")
        self.host = host
        self._req_port = port
        self._req_store_port = store_port
        self._token = token.encode()
        self._events = EventLog(events_path) if events_path else None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.min_members = min_members
        self.expected_replicas = expected_replicas
        self.register_timeout_s = register_timeout_s
        self._tick_s = min(0.02, heartbeat_interval_s / 2)
        self._cond = threading.Condition()
        self._conns: set[_Conn] = set()
        self._by_replica: dict[int, _Conn] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self.state: MembershipState | None = None
        self.port = 0
        self.store_port = 0

    # ------------------------------------------------------------- lifecycle

    def start(self) -> Coordinator:
        """Binds the store and the service, then serves in a background thread; returns at once."""
        from torch.distributed import TCPStore

        self._store = TCPStore(self.host, self._req_store_port, None, True, timedelta(seconds=300),
                               wait_for_workers=False, multi_tenant=False)
        self.store_port = int(self._store.port)
        self._listener = socket.create_server((self.host, self._req_port), backlog=512)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.state = MembershipState(expected=self.expected_replicas, min_members=self.min_members,
                                     store_host=self.host, store_port=self.store_port,
                                     ack_timeout_s=self.heartbeat_timeout_s)
        self._log("coordinator_start", host=self.host, port=self.port, store_port=self.store_port,
                  expected_replicas=self.expected_replicas, heartbeat_timeout_s=self.heartbeat_timeout_s)
        self._thread = threading.Thread(target=self._loop, name="recover-coordinator", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Starts (if needed) and blocks until :meth:`stop` or KeyboardInterrupt."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        finally:
            self.stop()

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
            conn.sock.close()
        self._conns.clear()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()
        self._log("coordinator_stop")
        if self._events is not None:
            self._events.close()
        self._store = None

    def snapshot(self) -> dict[str, Any]:
        """Generation, members, committed step and live replicas, read consistently (for tests, CLI)."""
        with self._cond:
            st = self.state
            assert st is not None
            return {"generation": st.generation, "members": list(st.current.members) if st.current else [],
                    "committed_step": st.committed_step, "live": sorted(st.live),
                    "pending_join": sorted(st.pending_join), "failing": st.round is not None}

    def wait_until(self, predicate: Any, timeout: float) -> dict[str, Any]:
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

    def _loop(self) -> None:
        while not self._stopping:
            events = self._sel.select(self._tick_s)
            now = time.monotonic()
            with self._cond:
                for key, mask in events:
                    if key.data == "accept":
                        self._accept(now)
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._read(conn, now)
                self._check_timeouts(now)
                assert self.state is not None
                self._apply(self.state.on_tick(now))
                self._cond.notify_all()

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _accept(self, now: float) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                self._log("refused", peer=f"{addr[0]}:{addr[1]}", code="too_many_connections")
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", now, now)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn, now: float) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "connection_closed", now)
            return
        conn.last_seen = now
        try:
            items = conn.decoder.feed(data)
        except ProtocolError as exc:
            self._refuse(conn, exc.code, exc.message, None, fatal=True, now=now)
            return
        for item in items:
            if conn.closed:
                return
            if isinstance(item, ProtocolError):
                self._refuse(conn, item.code, item.message, None, fatal=conn.replica is None, now=now)
            else:
                self._handle(conn, item, now)

    def _handle(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        st = self.state
        assert st is not None
        kind, req = msg["type"], msg.get("id")
        if conn.replica is None:
            if kind != "register":
                self._refuse(conn, "unauthenticated", "the first message must be register", req, True, now)
            elif not hmac.compare_digest(msg["token"].encode(), self._token):
                self._refuse(conn, "unauthorized", "wrong token", req, True, now)
            else:
                try:
                    acts = st.on_register(msg["replica"], msg["join"], msg["id"], now)
                except Refused as ref:
                    self._refuse(conn, ref.code, ref.message, req, True, now)
                    return
                conn.replica = msg["replica"]
                self._by_replica[conn.replica] = conn
                self._apply(acts)
            return
        r = conn.replica
        try:
            if kind == "hb":
                return
            if kind == "bye":
                self._drop(conn, "left", now)
                return
            if kind == "register":
                raise Refused("already_registered", f"this connection is already replica {r}")
            if kind == "ack":
                acts = st.on_ack(r, msg["generation"], now)
            elif kind == "report":
                acts = st.on_report(r, msg["id"], msg["generation"], msg["suspects"], now)
            else:  # vote
                acts = st.on_vote(r, msg["id"], msg["generation"], msg["step"], msg["ids"], now)
        except Refused as ref:
            self._refuse(conn, ref.code, ref.message, req, False, now)
            return
        self._apply(acts)

    def _check_timeouts(self, now: float) -> None:
        for conn in list(self._conns):
            if conn.replica is None and now - conn.opened > self.register_timeout_s:
                self._refuse(conn, "register_timeout", "no valid register message in time", None, True, now)
            elif conn.replica is not None and now - conn.last_seen > self.heartbeat_timeout_s:
                self._fence(conn, f"no heartbeat for {now - conn.last_seen:.3f} s", "heartbeat_timeout", now)

    # ------------------------------------------------------------- actions

    def _apply(self, actions: list[Action]) -> None:
        now = time.monotonic()
        for act in actions:
            if isinstance(act, Send):
                conn = self._by_replica.get(act.replica)
                if conn is not None:
                    self._send(conn, act.msg, now)
            elif isinstance(act, Fence):
                conn = self._by_replica.get(act.replica)
                if conn is not None:
                    self._fence(conn, act.reason, "fenced", now)
            elif isinstance(act, Log):
                self._log(act.kind, **act.fields)

    def _fence(self, conn: _Conn, reason: str, cause: str, now: float) -> None:
        self._send(conn, {"type": "error", "re": None, "code": "fenced", "message": reason}, now)
        self._drop(conn, cause, now, detail=reason)

    def _refuse(self, conn: _Conn, code: str, message: str, re: Any, fatal: bool, now: float) -> None:
        self._log("refused", peer=conn.peer, replica=conn.replica, code=code, message=message,
                  closed=fatal)
        self._send(conn, {"type": "error", "re": re if isinstance(re, int) else None, "code": code,
                          "message": message}, now)
        if fatal:
            self._drop(conn, "refused", now)

    def _send(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        if conn.closed:
            return
        conn.out += encode(msg)
        if len(conn.out) > MAX_OUTBUF:
            self._drop(conn, "slow_consumer", now)
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            conn.out.clear()
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self._sel.get_key(conn.sock).events != want:
            self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: _Conn, cause: str, now: float, detail: str = "") -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        r = conn.replica
        if r is not None and self._by_replica.get(r) is conn:
            del self._by_replica[r]
            assert self.state is not None
            if detail:
                self._log("fenced", replica=r, reason=detail)
            self._apply(self.state.on_dead(r, cause, now))

    def _log(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.event(kind, **fields)
