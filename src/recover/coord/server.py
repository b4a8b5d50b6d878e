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

Replicas of several ranks (processes): each rank k of replica R registers on its own connection
with ``rank=k, ranks=P``; the membership state stays per replica and this server aggregates:
  * R is registered with the state once, when all P ranks have (same P and ``join``; a duplicate
    rank, a different P or ``join``, or an R already alive is refused and that connection closed).
  * Every request forwarded to the state gets a server-unique id; the state's reply goes back to
    exactly the connection(s) that asked, each with its own request id. Pushes go to all P.
  * ``ack`` of g reaches the state once all P acked g; ``report`` at once (reply to that rank);
    ``vote`` once all P voted the same (generation, step, ids): the reply goes to all P. Ranks that
    vote differently fence the replica. A ``failing`` push answers buffered votes ``aborted``.
  * Any rank's connection closing, missing heartbeats or being fenced fences all the others (they
    get the ``fenced`` error first) and marks R dead once. Lane k (the rank-k processes of all
    members) rendezvouses under ``PrefixStore(f"gen{g}/lane{k}")`` (``gen{g}`` when P = 1).
"""

from __future__ import annotations

import hmac
import itertools
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from recover.coord.protocol import CLIENT_TYPES, FrameDecoder, ProtocolError, encode, register_ranks
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
    replica: int | None = None  # set once its register is accepted (its replica may still wait for ranks)
    rank: int = 0
    closed: bool = False


@dataclass(eq=False)
class _Slot:
    """The connections of one replica, by rank. The state hears of the replica (``registered``)
    once all ``ranks`` ranks registered; it is dropped as a whole when any of them goes."""

    replica: int
    ranks: int
    join: bool
    conns: dict[int, _Conn] = field(default_factory=dict)
    reg_ids: dict[int, int] = field(default_factory=dict)  # rank -> its register request id
    registered: bool = False
    acks: dict[int, set[int]] = field(default_factory=dict)  # generation -> ranks that acked it
    votes: dict[int, tuple[int, tuple[int, int, tuple[int, ...]]]] = field(default_factory=dict)
    # ^ rank -> (its request id, (generation, step, sorted ids)) until all ranks voted
    routes: dict[int, list[tuple[_Conn, int]]] = field(default_factory=dict)  # server id -> who asked

    def who(self, rank: int) -> str:
        return f"replica {self.replica}" + (f" rank {rank}" if self.ranks > 1 else "")


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
        self._slots: dict[int, _Slot] = {}
        self._sids = itertools.count(1)  # server-side request ids: those of different ranks collide
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
        """Generation, members, committed step and live replicas, read consistently (for tests, CLI);
        ``registering`` maps a replica still waiting for some of its ranks to the ranks in so far."""
        with self._cond:
            st = self.state
            assert st is not None
            return {"generation": st.generation, "members": list(st.current.members) if st.current else [],
                    "committed_step": st.committed_step, "live": sorted(st.live),
                    "pending_join": sorted(st.pending_join), "failing": st.round is not None,
                    "registering": {r: sorted(sl.conns) for r, sl in sorted(self._slots.items())
                                    if not sl.registered}}

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
                self._register(conn, msg, now)
            return
        slot = self._slots.get(conn.replica)
        if slot is None or slot.conns.get(conn.rank) is not conn:
            return  # its replica is gone; the connection is being closed
        r = conn.replica
        try:
            if kind == "hb":
                return
            if kind == "bye":
                self._drop(conn, "left", now)
                return
            if kind == "register":
                raise Refused("already_registered", f"this connection is already {slot.who(conn.rank)}")
            if not slot.registered:
                raise Refused("not_registered", f"replica {r} waits for its other ranks "
                                                f"({len(slot.conns)} of {slot.ranks} registered)")
            if kind == "ack":
                self._ack(slot, conn, msg["generation"], now)
            elif kind == "report":
                self._forward(slot, [(conn, msg["id"])], False, now,
                              lambda sid: st.on_report(r, sid, msg["generation"], msg["suspects"], now))
            else:
                self._vote(slot, conn, msg, now)
        except Refused as ref:
            self._refuse(conn, ref.code, ref.message, req, False, now)

    def _register(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        """Rank ``rank`` of replica ``r`` registers; the state hears of ``r`` once all its ranks did."""
        st = self.state
        assert st is not None
        r, join, req = msg["replica"], msg["join"], msg["id"]
        slot = self._slots.get(r)
        try:
            if r < 0:
                raise Refused("bad_replica", f"replica id must be >= 0, got {r}")
            try:
                rank, ranks = register_ranks(msg)
            except ProtocolError as exc:
                raise Refused(exc.code, f"replica {r}: {exc.message}") from None
            if r in st.live or (slot is not None and slot.registered):
                raise Refused("duplicate_replica", f"replica {r} is already registered and alive")
            if slot is not None and (slot.ranks != ranks or slot.join != join):
                raise Refused("rank_mismatch", f"rank {rank} of replica {r} declares ranks={ranks} join={join}, "
                                               f"but its rank(s) {sorted(slot.conns)} declared ranks={slot.ranks} "
                                               f"join={slot.join}")
            if slot is not None and rank in slot.conns:
                raise Refused("duplicate_rank", f"rank {rank} of replica {r} is already registered")
        except Refused as ref:
            self._refuse(conn, ref.code, ref.message, req, True, now)
            return
        if slot is None:
            slot = self._slots[r] = _Slot(r, ranks, join)
        conn.replica, conn.rank = r, rank
        slot.conns[rank] = conn
        slot.reg_ids[rank] = req
        if ranks > 1:
            self._log("rank_register", replica=r, rank=rank, ranks=ranks, registered=len(slot.conns))
        if len(slot.conns) < ranks:
            return
        for c in slot.conns.values():
            c.last_seen = now  # the heartbeats start with the ok reply
        asked = [(slot.conns[k], slot.reg_ids[k]) for k in sorted(slot.conns)]
        self._forward(slot, asked, True, now, lambda sid: st.on_register(r, join, sid, now))

    def _forward(self, slot: _Slot, asked: list[tuple[_Conn, int]], fatal: bool, now: float,
                 call: Any) -> bool:
        """Calls the state with a server-unique request id whose reply goes to ``asked`` (each
        connection with its own id); a refusal goes to each of them. True if not refused."""
        sid = next(self._sids)
        slot.routes[sid] = asked
        try:
            acts = call(sid)
        except Refused as ref:
            slot.routes.pop(sid, None)
            for c, cid in asked:
                self._refuse(c, ref.code, ref.message, cid, fatal, now)
            return False
        slot.registered = True  # news for a register the state accepted: its ok and pushes go out now
        self._apply(acts)
        return True

    def _ack(self, slot: _Slot, conn: _Conn, generation: int, now: float) -> None:
        got = slot.acks.setdefault(generation, set())
        got.add(conn.rank)
        if len(got) < slot.ranks:
            return
        for g in [g for g in slot.acks if g <= generation]:
            del slot.acks[g]
        assert self.state is not None
        self._apply(self.state.on_ack(slot.replica, generation, now))

    def _vote(self, slot: _Slot, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        """Buffers a rank's vote until all ranks of the replica voted; then one vote to the state."""
        st = self.state
        assert st is not None
        r, cid = slot.replica, msg["id"]
        g, step, ids = msg["generation"], msg["step"], msg["ids"]
        cur = st.current
        if (slot.ranks == 1 or cur is None or g != cur.generation or r not in cur.members
                or st.round is not None or step <= st.committed_step or r in st.votes):
            # the state refuses or aborts it at once (or P = 1): for this rank alone
            self._forward(slot, [(conn, cid)], False, now, lambda sid: st.on_vote(r, sid, g, step, ids, now))
            return
        if conn.rank in slot.votes:
            raise Refused("duplicate_vote", f"{slot.who(conn.rank)} already voted in generation {g}")
        slot.votes[conn.rank] = (cid, (g, step, tuple(sorted(ids))))
        if len({b for _, b in slot.votes.values()}) > 1:
            reason = f"the ranks of replica {r} voted differently in generation {g}"
            self._log("rank_vote_disagreement", replica=r, generation=g, ballots={
                str(k): {"generation": b[0], "step": b[1], "ids": len(b[2])} for k, (_, b) in slot.votes.items()})
            self._kill(slot, "rank_disagreement", reason, now)
            return
        if len(slot.votes) < slot.ranks:
            return
        votes, slot.votes = slot.votes, {}
        asked = [(slot.conns[k], votes[k][0]) for k in sorted(votes)]
        self._forward(slot, asked, False, now, lambda sid: st.on_vote(r, sid, g, step, ids, now))

    def _check_timeouts(self, now: float) -> None:
        for conn in list(self._conns):
            if conn.closed:
                continue
            if conn.replica is None:
                if now - conn.opened > self.register_timeout_s:
                    self._refuse(conn, "register_timeout", "no valid register message in time", None, True, now)
                continue
            slot = self._slots.get(conn.replica)
            # a rank waiting for its replica's other ranks does not heartbeat yet
            if slot is not None and slot.registered and now - conn.last_seen > self.heartbeat_timeout_s:
                self._fence(conn, f"no heartbeat for {now - conn.last_seen:.3f} s", "heartbeat_timeout", now)

    # ------------------------------------------------------------- actions

    def _apply(self, actions: list[Action]) -> None:
        now = time.monotonic()
        for act in actions:
            if isinstance(act, Send):
                slot = self._slots.get(act.replica)
                if slot is not None and slot.registered:
                    self._deliver(slot, act.msg, now)
            elif isinstance(act, Fence):
                slot = self._slots.get(act.replica)
                if slot is not None:
                    self._kill(slot, "fenced", act.reason, now)
            elif isinstance(act, Log):
                self._log(act.kind, **act.fields)

    def _deliver(self, slot: _Slot, msg: dict[str, Any], now: float) -> None:
        """A reply to the connection(s) whose request it answers (with their own ids); anything
        else to every rank of the replica."""
        re = msg.get("re")
        if re is not None and re in slot.routes:
            for c, cid in slot.routes.pop(re):
                self._send(c, {**msg, "re": cid}, now)
            return
        for c in list(slot.conns.values()):
            self._send(c, msg, now)
        if msg["type"] == "failing":  # the votes a replica's ranks are still collecting can't commit
            self._abort_votes(slot, msg["generation"] + 1, "generation is failing", now)
        elif msg["type"] == "membership" and msg["membership"] is not None:
            self._abort_votes(slot, msg["membership"]["generation"], "generation replaced", now)

    def _abort_votes(self, slot: _Slot, below: int, reason: str, now: float) -> None:
        """Answers ``aborted`` to buffered rank votes for generations before ``below``."""
        for k, (cid, (g, _, _)) in list(slot.votes.items()):
            if g < below:
                del slot.votes[k]
                self._send(slot.conns[k], {"type": "aborted", "re": cid, "generation": g, "reason": reason}, now)

    def _fence(self, conn: _Conn, reason: str, cause: str, now: float) -> None:
        self._send(conn, {"type": "error", "re": None, "code": "fenced", "message": reason}, now)
        self._drop(conn, cause, now, detail=reason)

    def _kill(self, slot: _Slot, cause: str, detail: str, now: float, first: _Conn | None = None) -> None:
        """Replica ``slot`` is dead: fences every connection of it (but ``first``, already gone) and
        tells the state once (unless it never heard of the replica)."""
        r = slot.replica
        if self._slots.get(r) is not slot:
            return
        del self._slots[r]
        if first is None:
            why = detail
        else:
            why = f"{slot.who(first.rank)} is gone ({cause}{': ' + detail if detail else ''})"
        for c in list(slot.conns.values()):
            if c is not first and not c.closed:
                self._send(c, {"type": "error", "re": None, "code": "fenced", "message": why}, now)
                self._close(c)
        if not slot.registered:
            self._log("register_abandoned", replica=r, ranks=slot.ranks, registered=sorted(slot.conns),
                      cause=cause)
            return
        if detail:
            self._log("fenced", replica=r, reason=detail)
        assert self.state is not None
        self._apply(self.state.on_dead(r, cause, now))

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

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _drop(self, conn: _Conn, cause: str, now: float, detail: str = "") -> None:
        """Closes ``conn``; if it belonged to a replica, that whole replica is dead (see ``_kill``)."""
        if conn.closed:
            return
        self._close(conn)
        slot = self._slots.get(conn.replica) if conn.replica is not None else None
        if slot is not None and slot.conns.get(conn.rank) is conn:
            self._kill(slot, cause, detail, now, first=conn)

    def _log(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.event(kind, **fields)
