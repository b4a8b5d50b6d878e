"""A replica's relay: its ranks reach the coordinator through one connection, their heartbeats batched.

Contract: rank 0 of a replica of P ranks starts one :class:`Relay` (a background thread with one
selector loop, in rank 0's own process) before any rank registers; every rank of the replica, rank
0 included, points its unchanged :class:`~recover.coord.client.CoordinatorClient` at the relay's
:attr:`Relay.address`. To a rank the relay *is* the coordinator (the same protocol); to the
coordinator it is one connection registered with ``relay=true`` for all P ranks
(:mod:`recover.coord.protocol`). Its ranks are one member (:mod:`recover.coord.member`):

  * ``register``: each local rank's is checked (token, replica, ``ranks`` = P, rank in range, the
    member rule); once all P are in, one upstream ``register``, whose reply goes to every rank with
    that rank's own request id.
  * ``hb``: kept; every heartbeat interval (the ``heartbeat_s`` of the coordinator's ``ok``, else the
    configured one) one upstream ``hbs`` with the newest progress, activity and generation of each
    rank heard since the last batch. A rank that went silent is left out, so the coordinator, which
    times out every rank on its own, still fences the replica when one rank freezes.
  * ``ack`` of g: one upstream ``ack`` once all P ranks acked g. ``vote``: all P alike are one
    upstream ``vote`` (``Ballot.of_ranks``) whose reply goes to every rank with its own id; ranks
    that vote differently go up one by one with their ``rank`` (the coordinator fences the
    replica); held votes of a generation that a ``failing`` or ``membership`` push ends are answered
    ``aborted`` here, as the coordinator answers the votes it holds.
  * ``report``, ``nonfinite``: forwarded with the sender's ``rank``, the reply back to that rank with
    its own id. ``bye``: forwarded. Pushes are encoded once and fanned out to every rank.

Invariants: the relay lives and dies with rank 0's process, and a rank's death is the replica's:
when any local connection closes, a local peer does not speak the protocol (it is refused), or
:meth:`Relay.stop` is called, the relay closes every connection, upstream and local, so the
coordinator fences the replica at once (``connection_closed``) and every rank's waiting calls
raise ``CoordinatorLost``.

TLS (:mod:`recover.coord.tls`): with a certificate, the upstream connection is a TLS client of the
coordinator's and the local listener a TLS server to the ranks, both mutually authenticated.

Coordinator restart: when the upstream connection ends without a fence, the ranks keep their
connections and notice nothing but requests answered ``coordinator_restarted`` (as their own
clients would answer them, :mod:`recover.coord.client`); the relay reconnects every
``RECONNECT_EVERY_S`` for ``reconnect_s`` and registers again with what the replica holds (newest
generation and members, last committed step, speeds: it sees every membership and commit go by).
Not back in time: every rank gets ``coordinator_gone`` (its client gives up at once), then the
relay ends.

Read deadline (:mod:`recover.coord.deadline`): the coordinator's ``beat`` pushes reach the ranks like
any push (and ``beat_s`` with the ``ok``), so a rank judges the relay's silence as its own client
would. Upstream, the relay judges the coordinator's: silent beyond the deadline while its host
answers nothing (no acknowledgement of the batched heartbeats, no answer to a reconnect), the
replica is cut off: every rank gets ``cut_off`` (its client leaves like a fenced one), then the
relay ends; silent while its host answers (a paused coordinator) beyond ``reconnect_s``: every rank
gets ``coordinator_gone``.
"""

from __future__ import annotations

import hmac
import itertools
import selectors
import socket
import sys
import threading
import time
from typing import Any

from recover.coord.actions import Refused
from recover.coord.client import RECONNECT_EVERY_S
from recover.coord.conn import FramedConn, connect_patiently
from recover.coord.deadline import AckClock, Verdict, host_answered, judge, read_deadline
from recover.coord.member import Agreed, Ballot, Disagreed, Member
from recover.coord.protocol import (
    ACTIVITY_LETTERS,
    CLIENT_TYPES,
    RELEASE,
    SERVER_TYPES,
    ProtocolError,
    batch_message,
    encode,
    register_ranks,
)
from recover.coord.tls import Tls
from recover.observe import cpu

_LETTER = {name: letter for letter, name in ACTIVITY_LETTERS.items()}


class _Local(FramedConn):
    """One rank's connection to the relay (``rank``: None until its register is accepted)."""

    __slots__ = ("rank",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock, CLIENT_TYPES)
        self.rank: int | None = None


Asked = tuple[_Local, int]
"""A local request: the rank's connection and its own request id."""


class Relay:
    """See the module docstring.

    Args:
        host, port: the coordinator.
        token: the job's shared secret (every local rank must present it too).
        replica_id, ranks: the replica this relay speaks for and its number of ranks (P).
        heartbeat_interval_s: the batch interval until the coordinator names one.
        bind_host: where the ranks reach the relay (None: the address this node reaches the
            coordinator from, so ranks on the node and their link probes work as without a relay).
        tls: both sides over TLS with this certificate (:mod:`recover.coord.tls`): upstream as a
            client of the coordinator, and to its ranks as a server (None: plain TCP).
    """

    def __init__(self, host: str, port: int, token: str, replica_id: int, ranks: int,
                 heartbeat_interval_s: float = 0.1, bind_host: str | None = None,
                 connect_timeout_s: float = 10.0, reconnect_s: float = 0.0, tls: Tls | None = None) -> None:
        if ranks < 1:
            raise ValueError(f"a relay speaks for ranks >= 1, got {ranks}")
        self.upstream_addr = (host, int(port))
        self._token, self.replica_id, self.ranks = token, int(replica_id), int(ranks)
        self.interval_s = heartbeat_interval_s
        self.bind_host, self.connect_timeout_s = bind_host, connect_timeout_s
        self.tls = tls
        self._tls_server = tls.server() if tls is not None else None
        self._locals: set[_Local] = set()
        self._member: Member[Asked] | None = None  # the replica's ranks as one member (from the first register)
        self._routes: dict[int, list[Asked]] = {}  # upstream id -> who asked
        self._ids = itertools.count(1)
        self._beats: dict[int, tuple[int, str, int]] = {}  # rank -> newest (progress, letter, generation)
        self._registered = False
        self._reg_uid: int | None = None  # the upstream register's request id
        self._next_batch = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed_why: str | None = None
        """Why the relay ended (None while it runs)."""
        self.reconnect_s = reconnect_s
        self._fenced = False
        self._held: dict[str, Any] = {"generation": 0, "members": [], "committed": -1, "speeds": None}
        self._probe: dict[str, str] = {}  # rank 0's link probe address, named in the replica's register
        """What the replica holds, from the memberships and commits relayed (a re-registration's ``resume``)."""
        self._lost_at: float | None = None  # when the upstream connection ended (None: connected)
        self._outage_since: float | None = None  # when the coordinator went away (None: registered with it)
        self._next_try = 0.0
        self._deadline_s: float | None = None  # the upstream read deadline (from the ok's beat_s)
        self._heard = time.monotonic()  # when the coordinator last sent a byte
        self._answered = self._heard  # when its host last answered (an acknowledgement, a refused connect)

    # ------------------------------------------------------------- lifecycle

    def start(self) -> Relay:
        """Connects upstream, binds the local listener and serves in a daemon thread.

        Raises:
            OSError: the coordinator cannot be reached or the listener cannot bind.
        """
        up = self._secure(connect_patiently(self.upstream_addr, self.connect_timeout_s))  # it may be starting
        bind = self.bind_host or up.getsockname()[0]
        self._listener = socket.create_server((bind, 0), backlog=max(16, self.ranks))
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._up = FramedConn(up, SERVER_TYPES).register(self._sel, "up")
        self._acks = AckClock(up)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name=f"recover-relay-{self.replica_id}", daemon=True)
        self._thread.start()
        cpu.register(self._thread)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the replica's ranks connect to."""
        return self._listener.getsockname()[:2]

    def stop(self) -> None:
        """Closes every connection (the coordinator sees the replica gone) and ends the thread."""
        if self._thread is None:
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # ------------------------------------------------------------- the loop

    def _loop(self) -> None:
        try:
            while not self._stop.is_set() and self.closed_why is None:
                now = time.monotonic()
                wait = max(0.0, self._next_batch - now) if self._registered else 0.5
                if self._lost_at is not None:
                    wait = RECONNECT_EVERY_S
                for key, mask in self._sel.select(min(wait, 0.5)):
                    self._event(key.data, mask)
                    if self.closed_why is not None:
                        break
                if self._lost_at is not None:
                    self._try_reconnect()
                elif self._registered and time.monotonic() >= self._next_batch:
                    self._batch()
                if self._registered and self.closed_why is None and self._deadline_s is not None:
                    self._watch()
        except BaseException as exc:  # a bug here must not pass silently: the replica is lost with it
            self._end(f"the relay failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._close_all()
            if self.closed_why is not None and not self._stop.is_set():
                print(f"recover: replica {self.replica_id}'s relay ended: {self.closed_why}", file=sys.stderr,
                      flush=True)

    def _event(self, what: Any, mask: int) -> None:
        if what == "accept":
            self._accept()
        elif what == "wake":
            return
        elif what == "up":
            if mask & selectors.EVENT_WRITE:
                self._flush_up()
            if mask & selectors.EVENT_READ:
                self._read_up()
        else:
            if mask & selectors.EVENT_WRITE:
                what.flush()
            if mask & selectors.EVENT_READ:
                self._read_local(what)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if self.tls is not None:
                assert self._tls_server is not None  # made with tls
                sock = self.tls.accept(self._tls_server, sock)
            loc = _Local(sock)
            loc.register(self._sel)
            self._locals.add(loc)

    # ------------------------------------------------------------- local ranks

    def _read_local(self, loc: _Local) -> None:
        who = "a local connection" if loc.rank is None else f"rank {loc.rank}"
        try:
            items = loc.receive() or []
        except EOFError:
            self._end(f"{who} of replica {self.replica_id} closed its connection")
            return
        except ProtocolError as exc:
            self._end(f"{who} broke the protocol: {exc}")
            return
        for msg in items:
            if isinstance(msg, ProtocolError):
                self._end(f"{who} sent an invalid message: {msg}")
                return
            self._on_local(loc, msg)
            if self.closed_why is not None:
                return

    def _on_local(self, loc: _Local, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if loc.rank is None or self._member is None:  # (a rank is set with the member)
            self._register_local(loc, msg)
        elif kind == "hb":
            if msg.get("progress") is not None:
                self._beats[loc.rank] = (msg["progress"], _LETTER.get(msg.get("activity", "compute"), "c"),
                                         msg.get("generation", 0))
        elif kind == "ack":
            if self._member.ack((loc.rank,), msg["generation"]):
                self._send_up({"type": "ack", "generation": msg["generation"]})
        elif kind == "vote":
            self._vote(self._member, loc, loc.rank, msg)
        elif kind in ("report", "nonfinite"):
            self._forward(msg, [(loc, msg["id"])], rank=loc.rank)
        elif kind == "bye":
            self._send_up({"type": "bye", "rank": loc.rank})
        elif kind == "reached":  # a rank's answer to the coordinator's ``reach`` (recover.coord.links)
            self._send_up({"type": "reached", "reached": msg["reached"], "rank": loc.rank})
        elif kind == "rates":  # a rank's answer to the coordinator's ``rate`` (recover.coord.graylinks)
            self._send_up({"type": "rates", "times": msg["times"], "rank": loc.rank})
        elif kind == "register":
            self._reply_error(loc, msg.get("id"), "already_registered", f"rank {loc.rank} is already registered")
        else:
            self._reply_error(loc, msg.get("id"), "unknown_type", f"a rank does not send {kind} to its relay")

    def _vote(self, member: Member[Asked], loc: _Local, rank: int, msg: dict[str, Any]) -> None:
        """Holds a rank's vote; all P alike go up as one, any difference goes up rank by rank."""
        try:
            got = member.vote((rank,), (loc, msg["id"]), Ballot.from_wire(msg))
        except Refused as ref:
            self._reply_error(loc, msg["id"], ref.code, ref.message)
            return
        if isinstance(got, Disagreed):
            for k, (asked, ballot) in got.held.items():
                self._forward(ballot.to_wire(), [asked], rank=k)
        elif isinstance(got, Agreed):
            self._forward(got.ballot.to_wire(), got.asked)

    def _abort_votes(self, below: int | None, reason: str) -> None:
        """Answers ``aborted`` to the held votes of generations before ``below`` (None: all)."""
        if self._member is None:
            return
        for (loc, cid), g in self._member.abort_votes(below):
            loc.send(encode({"type": "aborted", "re": cid, "generation": g, "reason": reason}))

    def _register_local(self, loc: _Local, msg: dict[str, Any]) -> None:
        req = msg.get("id")
        try:
            rank, join = self._check_local(msg)
            member = self._member or Member(self.replica_id, self.ranks, join)
            asked = member.register(rank, self.ranks, join, (loc, msg["id"]))
        except Refused as ref:
            self._reply_error(loc, req, ref.code, ref.message)
            self._end(f"a local peer was refused: {ref.code}: {ref.message}")
            return
        self._member, loc.rank = member, rank
        if rank == 0 and isinstance(msg.get("probe"), str):
            self._probe = {"probe": msg["probe"]}
        if asked is not None:
            self._reg_uid = self._forward({"type": "register", "token": self._token, "replica": self.replica_id,
                                           "join": join, "ranks": self.ranks, "relay": True, "release": RELEASE,
                                           **self._probe}, asked)

    def _check_local(self, msg: dict[str, Any]) -> tuple[int, bool]:
        """``(rank, join)`` of a local rank's first message, which must register it. Raises Refused."""
        if msg["type"] != "register":
            raise Refused("unauthenticated", "the first message must be register")
        if not hmac.compare_digest(msg["token"].encode(), self._token.encode()):
            raise Refused("unauthorized", "wrong token")
        try:
            rank, ranks = register_ranks(msg)
        except ProtocolError as exc:
            raise Refused(exc.code, exc.message) from None
        if msg["replica"] != self.replica_id or ranks != self.ranks:
            raise Refused("rank_mismatch", f"this relay speaks for replica {self.replica_id} of {self.ranks} "
                                           f"ranks, not replica {msg['replica']} of {ranks}")
        return rank, msg["join"]

    def _reply_error(self, loc: _Local, re: Any, code: str, message: str) -> None:
        loc.send(encode({"type": "error", "re": re if isinstance(re, int) else None, "code": code,
                         "message": message}))

    def _to_ranks(self, frame: bytes) -> None:
        for loc in list(self._locals):
            if loc.rank is not None:
                loc.send(frame)

    # ------------------------------------------------------------- upstream

    def _forward(self, msg: dict[str, Any], asked: list[Asked], rank: int | None = None) -> int:
        """Sends ``msg`` upstream under a fresh id whose reply goes to ``asked``; returns the id. While
        the coordinator is away the request is answered ``coordinator_restarted`` at once."""
        uid = next(self._ids)
        self._routes[uid] = asked
        if self._lost_at is not None:
            self._answer_restarted()
            return uid
        extra = {} if rank is None else {"rank": rank}
        self._send_up({**msg, **extra, "id": uid})
        return uid

    def _batch(self) -> None:
        """One ``hbs`` with every rank heard since the last batch."""
        self._next_batch = time.monotonic() + self.interval_s
        if not self._beats:
            return
        beats, self._beats = self._beats, {}
        ranks = sorted(beats)
        self._send_up(batch_message(ranks, [beats[k][0] for k in ranks], "".join(beats[k][1] for k in ranks),
                                    [beats[k][2] for k in ranks], self.ranks))

    def _read_up(self) -> None:
        try:
            items = self._up.receive()
            if items is None:
                return
            self._heard = time.monotonic()
        except EOFError:
            self._upstream_ended("the coordinator closed the relay's connection")
            return
        except ProtocolError as exc:
            self._end(f"the coordinator's stream broke: {exc}")
            return
        for msg in items:
            if isinstance(msg, ProtocolError):
                continue  # a refused frame from a newer coordinator: not for us to act on
            self._on_up(msg)

    def _on_up(self, msg: dict[str, Any]) -> None:
        self._remember(msg)
        re = msg.get("re")
        if re is not None:
            asked = self._routes.pop(re, [])
            if msg["type"] == "ok" and "heartbeat_s" in msg:
                self.interval_s = max(self.interval_s, float(msg["heartbeat_s"]))
                msg = {k: v for k, v in msg.items() if k != "heartbeat_s"}  # the ranks keep their own pace
            if re == self._reg_uid and msg["type"] == "ok":
                self._registered, self._outage_since = True, None
                self._deadline_s = read_deadline(msg.get("beat_s"))
                self._next_batch = time.monotonic() + self.interval_s
            elif re == self._reg_uid and msg["type"] == "error" and not asked:  # refused after a restart
                self._give_up(f"the restarted coordinator refused replica {self.replica_id}: "
                              f"{msg['code']}: {msg['message']}")
                return
            for loc, cid in asked:
                loc.send(encode({**msg, "re": cid}))
            return
        self._to_ranks(encode(msg))  # a push: encoded once, to every rank
        if msg["type"] == "failing":
            self._abort_votes(msg["generation"] + 1, "generation is failing")
        elif msg["type"] == "membership" and msg["membership"] is not None:
            self._abort_votes(msg["membership"]["generation"], "generation replaced")

    def _remember(self, msg: dict[str, Any]) -> None:
        """Keeps what the replica holds (for a registration again after a coordinator restart)."""
        kind = msg["type"]
        if kind == "committed":
            self._held["committed"] = max(self._held["committed"], msg["step"])
            self._held["speeds"] = msg.get("speeds")
        elif kind == "membership" and msg["membership"] is not None:
            m = msg["membership"]
            if m["generation"] > self._held["generation"]:
                self._held.update(generation=m["generation"], members=m["members"])
                if self._held["committed"] < 0:
                    self._held["speeds"] = m.get("speeds")
        elif kind == "error" and msg.get("re") is None and msg["code"] == "fenced":
            self._fenced = True

    # ------------------------------------------------------------- coordinator restart
    def _upstream_ended(self, why: str) -> None:
        """Without a fence, a registered relay that may reconnect waits for the coordinator; else it ends."""
        if self._lost_at is not None:
            return  # already lost (its write and its read both fail): reconnecting
        if self._fenced or self._outage_since is None and not self._registered or self.reconnect_s <= 0:
            self._end(why)
        else:  # also a new connection that ends before its register is answered (a dying listener took it)
            self._lose_upstream()

    def _lose_upstream(self) -> None:
        """The coordinator went away (no fence): keep the ranks, answer what is in flight, reconnect."""
        self._lost_at = time.monotonic()
        self._answered = self._lost_at - (self._acks.age(self._lost_at) or 0.0)
        if self._outage_since is None:
            self._outage_since = self._lost_at
        self._next_try = time.monotonic() + RECONNECT_EVERY_S
        self._registered = False
        self._up.close()
        self._answer_restarted()
        if self._member is not None:
            for (loc, cid), _ in self._member.abort_votes(None):
                loc.send(encode({"type": "error", "re": cid, "code": "coordinator_restarted",
                                 "message": "the coordinator restarted while this vote was held"}))

    def _answer_restarted(self) -> None:
        routes, self._routes = self._routes, {}
        for asked in routes.values():
            for loc, cid in asked:
                loc.send(encode({"type": "error", "re": cid, "code": "coordinator_restarted",
                                 "message": "the coordinator restarted while this request was in flight"}))

    def _give_up(self, why: str) -> None:
        """Every rank gets ``coordinator_gone`` (its client gives up at once), then the relay ends."""
        self._to_ranks(encode({"type": "error", "re": None, "code": "coordinator_gone", "message": why}))
        self._end(why)

    def _secure(self, sock: socket.socket) -> socket.socket:
        """The upstream connection over TLS, its handshake made (blocking, within the connect timeout);
        ``sock`` itself without TLS. Raises OSError (``ssl.SSLError`` for a refused handshake)."""
        if self.tls is None:
            return sock
        try:
            return self.tls.client().wrap_socket(sock, server_hostname=self.upstream_addr[0])
        except OSError:
            sock.close()
            raise

    def _try_reconnect(self) -> None:
        assert self._lost_at is not None and self._outage_since is not None
        now = time.monotonic()
        if now - self._outage_since > self.reconnect_s:
            self._give_up(f"the coordinator did not come back within {self.reconnect_s:g} s")
            return
        if now < self._next_try:
            return
        self._next_try = now + RECONNECT_EVERY_S
        try:
            up = self._secure(socket.create_connection(self.upstream_addr, timeout=min(1.0, self.connect_timeout_s)))
        except OSError as exc:
            if host_answered(exc):
                self._answered = time.monotonic()
            self._judge(time.monotonic() - self._answered, f" (reconnecting: {exc})")
            return
        self._up, self._lost_at = FramedConn(up, SERVER_TYPES).register(self._sel, "up"), None
        self._acks = AckClock(up)
        join = self._member.join if self._member is not None else False
        msg = {"type": "register", "token": self._token, "replica": self.replica_id, "join": join,
               "ranks": self.ranks, "relay": True, "release": RELEASE, **self._probe}
        if self._held["generation"] > 0:
            msg["resume"] = dict(self._held)
        self._reg_uid = self._forward(msg, [])  # the ranks asked nothing: the reply stays here

    # ------------------------------------------------------------- the read deadline (recover.coord.deadline)
    def _silent_s(self) -> float:
        return time.monotonic() - self._heard

    def _watch(self) -> None:
        """Samples the upstream acknowledgements (every loop turn) and judges a silence past the deadline."""
        age = self._acks.age(time.monotonic())
        if self._deadline_s is not None and self._silent_s() >= self._deadline_s:
            self._judge(age)

    def _judge(self, answered_s: float | None, detail: str = "") -> None:
        """Cut off (the coordinator's host answers nothing): every rank gets ``cut_off`` and leaves like a
        fenced one; paused beyond the reconnect window: ``coordinator_gone``; else it waits."""
        if self._deadline_s is None:
            return
        silent = self._silent_s()
        verdict = judge(silent, self._deadline_s, answered_s, self.reconnect_s)
        if verdict is Verdict.CUT_OFF:
            why = (f"replica {self.replica_id} is cut off from the coordinator at {self.upstream_addr[0]}:"
                   f"{self.upstream_addr[1]}: nothing heard from it for {silent:.1f} s and its host answered "
                   f"nothing for {answered_s:.1f} s{detail}")
            self._to_ranks(encode({"type": "error", "re": None, "code": "cut_off", "message": why}))
            self._end(why)
        elif verdict is Verdict.GONE and self._lost_at is None:  # (while reconnecting: _try_reconnect's own window)
            self._give_up(f"the coordinator was silent for {silent:.1f} s (paused?), more than {self.reconnect_s:g} s")

    # ------------------------------------------------------------- bytes out

    def _send_up(self, msg: dict[str, Any]) -> None:
        if self._lost_at is not None:
            return  # the coordinator is away: nothing goes up until the relay registers again
        self._up.out += encode(msg)
        self._flush_up()

    def _flush_up(self) -> None:
        if not self._up.flush():
            self._upstream_ended("the coordinator connection failed")

    # ------------------------------------------------------------- endings

    def _end(self, why: str) -> None:
        if self.closed_why is None:
            self.closed_why = why

    def _close_all(self) -> None:
        """Closes upstream first (the coordinator fences the replica), then every rank: best effort
        to let pending output (a ``fenced`` error, the last replies) reach the ranks first."""
        self._up.close()
        self._listener.close()
        for loc in list(self._locals):
            loc.drain(0.2)
            loc.close()
        self._locals.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
