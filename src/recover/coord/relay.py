"""A replica's relay: its ranks reach the coordinator through one connection, their heartbeats batched.

Contract: rank 0 of a replica of P ranks starts one :class:`Relay` (a background thread with one
selector loop, in rank 0's own process) before any rank registers; every rank of the replica, rank
0 included, points its unchanged :class:`~recover.coord.client.CoordinatorClient` at the relay's
:attr:`Relay.address` instead of the coordinator. To a rank the relay *is* the coordinator (the
same protocol); to the coordinator the relay is one connection registered with ``relay=true`` for
all P ranks (:mod:`recover.coord.protocol`).

What it does:
  * ``register``: each local rank's is checked (token, replica, ``ranks`` = P, rank in range, once,
    the same ``join``); once all P are in, one upstream ``register`` (``relay=true``). Its reply
    goes to every rank with that rank's own request id.
  * ``hb``: kept; every heartbeat interval (the ``heartbeat_s`` of the coordinator's ``ok``, else the
    configured one) one upstream ``hbs`` with the newest progress, activity and generation of each
    rank heard since the last batch. A rank that went silent is left out, so the coordinator, which
    times out every rank on its own, still fences the replica when one rank freezes.
  * ``ack`` of generation g: one upstream ``ack`` (for every rank) once all P ranks acked g.
  * ``vote``: held until every rank voted; the same ballot (generation, step, ids) from all P is one
    upstream ``vote`` for the whole replica (the slowest rank's ``mb_s``), whose reply goes to every
    rank with its own id, so a commit costs the coordinator one message per replica. Ranks that
    vote differently are forwarded one by one with their ``rank`` (the coordinator fences the
    replica); held votes of a generation that a ``failing`` or ``membership`` push ends are answered
    ``aborted`` here, as the coordinator answers the votes it holds.
  * ``report``: forwarded with the sender's ``rank`` under an upstream request id; the reply goes
    back to that rank with its own id. ``bye``: forwarded (the replica leaves).
  * Pushes (``failing``, ``membership``, ``fenced``) are encoded once and fanned out to every rank.

Invariants: the relay lives and dies with rank 0's process, and a rank's death is the replica's:
when any local connection closes, or :meth:`Relay.stop` is called, the relay closes every
connection, upstream and local, so the coordinator fences the replica at once
(``connection_closed``) and every rank's waiting calls raise ``CoordinatorLost``.

Coordinator restart: when the upstream connection ends without a fence, the ranks keep their
connections and notice nothing but requests answered ``coordinator_restarted`` (as their own
clients would answer them, :mod:`recover.coord.client`); the relay reconnects every
``RECONNECT_EVERY_S`` for ``reconnect_s`` and registers again with what the replica holds (newest
generation and members, last committed step, speeds: it sees every membership and commit go by).
Not back in time: every rank gets ``coordinator_gone`` (its client gives up at once), then the
relay ends. A local peer that
does not speak the protocol is refused and closed, which also ends the relay (it cannot be a rank).
"""

from __future__ import annotations

import hmac
import itertools
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from recover.coord.client import RECONNECT_EVERY_S
from recover.coord.protocol import (
    ACTIVITY_LETTERS,
    CLIENT_TYPES,
    SERVER_TYPES,
    FrameDecoder,
    ProtocolError,
    encode,
    register_ranks,
)

_LETTER = {name: letter for letter, name in ACTIVITY_LETTERS.items()}


@dataclass(eq=False)
class _Local:
    """One rank's connection to the relay."""

    sock: socket.socket
    decoder: FrameDecoder = field(default_factory=lambda: FrameDecoder(CLIENT_TYPES))
    out: bytearray = field(default_factory=bytearray)
    rank: int | None = None


class Relay:
    """See the module docstring.

    Args:
        host, port: the coordinator.
        token: the job's shared secret (every local rank must present it too).
        replica_id, ranks: the replica this relay speaks for and its number of ranks (P).
        heartbeat_interval_s: the batch interval until the coordinator names one.
        bind_host: where the ranks reach the relay (None: the address this node reaches the
            coordinator from, so ranks on the node and their link probes work as without a relay).
    """

    def __init__(self, host: str, port: int, token: str, replica_id: int, ranks: int,
                 heartbeat_interval_s: float = 0.1, bind_host: str | None = None,
                 connect_timeout_s: float = 10.0, reconnect_s: float = 0.0) -> None:
        if ranks < 1:
            raise ValueError(f"a relay speaks for ranks >= 1, got {ranks}")
        self.upstream_addr = (host, int(port))
        self._token, self.replica_id, self.ranks = token, int(replica_id), int(ranks)
        self.interval_s = heartbeat_interval_s
        self.bind_host, self.connect_timeout_s = bind_host, connect_timeout_s
        self._locals: set[_Local] = set()
        self._by_rank: dict[int, _Local] = {}
        self._reg: dict[int, tuple[int, bool]] = {}  # rank -> (its register id, join)
        self._routes: dict[int, list[tuple[_Local, int]]] = {}  # upstream id -> (local, its id)
        self._ids = itertools.count(1)
        self._beats: dict[int, tuple[int, str, int]] = {}  # rank -> newest (progress, letter, generation)
        self._acks: dict[int, set[int]] = {}
        self._votes: dict[int, tuple[_Local, dict[str, Any]]] = {}  # rank -> its held vote
        self._registered = False
        self._reg_uid: int | None = None  # the upstream register's request id
        self._next_batch = 0.0
        self._up_out = bytearray()
        self._up_decoder = FrameDecoder(SERVER_TYPES)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed_why: str | None = None
        """Why the relay ended (None while it runs)."""
        self.reconnect_s = reconnect_s
        self._fenced = False
        self._join = False
        self._held: dict[str, Any] = {"generation": 0, "members": [], "committed": -1, "speeds": None}
        """What the replica holds, from the memberships and commits relayed (a re-registration's ``resume``)."""
        self._lost_at: float | None = None  # when the upstream connection ended (None: connected)
        self._outage_since: float | None = None  # when the coordinator went away (None: registered with it)
        self._next_try = 0.0

    # ------------------------------------------------------------- lifecycle

    def start(self) -> Relay:
        """Connects upstream, binds the local listener and serves in a daemon thread.

        Raises:
            OSError: the coordinator cannot be reached or the listener cannot bind.
        """
        self._up = socket.create_connection(self.upstream_addr, timeout=self.connect_timeout_s)
        self._up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._up.setblocking(False)
        bind = self.bind_host or self._up.getsockname()[0]
        self._listener = socket.create_server((bind, 0), backlog=max(16, self.ranks))
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._up, selectors.EVENT_READ, "up")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name=f"recover-relay-{self.replica_id}", daemon=True)
        self._thread.start()
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
        except BaseException as exc:  # a bug here must not pass silently: the replica is lost with it
            self._end(f"the relay failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._close_all(self.closed_why or "relay stopped")
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
                self._flush(what)
            if mask & selectors.EVENT_READ:
                self._read_local(what)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loc = _Local(sock)
            self._locals.add(loc)
            self._sel.register(sock, selectors.EVENT_READ, loc)

    # ------------------------------------------------------------- local ranks

    def _read_local(self, loc: _Local) -> None:
        try:
            data = loc.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        who = "a local connection" if loc.rank is None else f"rank {loc.rank}"
        if not data:
            self._end(f"{who} of replica {self.replica_id} closed its connection")
            return
        try:
            items = loc.decoder.feed(data)
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
        if loc.rank is None:
            self._register_local(loc, msg)
        elif kind == "hb":
            if msg.get("progress") is not None:
                self._beats[loc.rank] = (msg["progress"], _LETTER.get(msg.get("activity", "compute"), "c"),
                                         msg.get("generation", 0))
        elif kind == "ack":
            got = self._acks.setdefault(msg["generation"], set())
            got.add(loc.rank)
            if len(got) == self.ranks:
                for g in [g for g in self._acks if g <= msg["generation"]]:
                    del self._acks[g]
                self._send_up({"type": "ack", "generation": msg["generation"]})
        elif kind == "vote":
            self._vote(loc, msg)
        elif kind in ("report", "nonfinite"):
            self._forward(msg, [(loc, msg["id"])], rank=loc.rank)
        elif kind == "bye":
            self._send_up({"type": "bye", "rank": loc.rank})
        elif kind == "register":
            self._reply_error(loc, msg.get("id"), "already_registered", f"rank {loc.rank} is already registered")
        else:
            self._reply_error(loc, msg.get("id"), "unknown_type", f"a rank does not send {kind} to its relay")

    def _vote(self, loc: _Local, msg: dict[str, Any]) -> None:
        """Holds a rank's vote; all P alike go up as one, any difference goes up rank by rank."""
        assert loc.rank is not None
        self._votes[loc.rank] = (loc, msg)
        ballots = {_ballot(m) for _, m in self._votes.values()}
        if len(ballots) > 1:
            votes, self._votes = self._votes, {}
            for k, (held, m) in sorted(votes.items()):
                self._forward(m, [(held, m["id"])], rank=k)
        elif len(self._votes) == self.ranks:
            votes, self._votes = self._votes, {}
            first = votes[min(votes)][1]
            vote = {k: first[k] for k in ("type", "generation", "step", "ids")}
            speeds = [m["mb_s"] for _, m in votes.values() if "mb_s" in m]
            if speeds:
                vote["mb_s"] = max(speeds)
            if any(m.get("stop") for _, m in votes.values()):
                vote["stop"] = True
            if all("fp" in m for _, m in votes.values()):  # the lanes' parameter fingerprints, in rank order
                vote["fp"] = "|".join(votes[k][1]["fp"] for k in sorted(votes))
            self._forward(vote, [(held, m["id"]) for _, (held, m) in sorted(votes.items())])

    def _abort_votes(self, below: int, reason: str) -> None:
        """Answers ``aborted`` to the held votes of generations before ``below``."""
        for k, (held, m) in list(self._votes.items()):
            if m["generation"] < below:
                del self._votes[k]
                self._send(held, encode({"type": "aborted", "re": m["id"], "generation": m["generation"],
                                         "reason": reason}))

    def _register_local(self, loc: _Local, msg: dict[str, Any]) -> None:
        req = msg.get("id")
        problem = None
        if msg["type"] != "register":
            problem = ("unauthenticated", "the first message must be register")
        elif not hmac.compare_digest(msg["token"].encode(), self._token.encode()):
            problem = ("unauthorized", "wrong token")
        else:
            try:
                rank, ranks = register_ranks(msg)
            except ProtocolError as exc:
                problem = (exc.code, exc.message)
            else:
                joins = {j for _, j in self._reg.values()} | {msg["join"]}
                if msg["replica"] != self.replica_id or ranks != self.ranks:
                    problem = ("rank_mismatch", f"this relay speaks for replica {self.replica_id} of {self.ranks} "
                                                f"ranks, not replica {msg['replica']} of {ranks}")
                elif rank in self._reg:
                    problem = ("duplicate_rank", f"rank {rank} of replica {self.replica_id} is already registered")
                elif len(joins) > 1:
                    problem = ("rank_mismatch", f"rank {rank} declares join={msg['join']} unlike the others")
        if problem is not None:
            self._reply_error(loc, req, *problem)
            self._end(f"a local peer was refused: {problem[0]}: {problem[1]}")
            return
        loc.rank = rank
        self._by_rank[rank] = loc
        self._reg[rank] = (req, msg["join"])
        self._join = msg["join"]
        if len(self._reg) == self.ranks:
            asked = [(self._by_rank[k], rid) for k, (rid, _) in sorted(self._reg.items())]
            self._reg_uid = self._forward({"type": "register", "token": self._token, "replica": self.replica_id,
                           "join": msg["join"], "ranks": self.ranks, "relay": True}, asked)

    def _reply_error(self, loc: _Local, re: Any, code: str, message: str) -> None:
        self._send(loc, encode({"type": "error", "re": re if isinstance(re, int) else None, "code": code,
                                "message": message}))

    # ------------------------------------------------------------- upstream

    def _forward(self, msg: dict[str, Any], asked: list[tuple[_Local, int]], rank: int | None = None) -> int:
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
        self._send_up({"type": "hbs", "ranks": ranks, "progress": [beats[k][0] for k in ranks],
                       "activity": "".join(beats[k][1] for k in ranks), "generation": [beats[k][2] for k in ranks]})

    def _read_up(self) -> None:
        try:
            data = self._up.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._upstream_ended("the coordinator closed the relay's connection")
            return
        try:
            items = self._up_decoder.feed(data)
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
                self._next_batch = time.monotonic() + self.interval_s
            elif re == self._reg_uid and msg["type"] == "error" and not asked:  # refused after a restart
                gone = encode({"type": "error", "re": None, "code": "coordinator_gone",
                               "message": f"the restarted coordinator refused replica {self.replica_id}: "
                                          f"{msg['code']}: {msg['message']}"})
                for loc in list(self._by_rank.values()):
                    self._send(loc, gone)
                self._end(f"the restarted coordinator refused the relay: {msg['message']}")
                return
            for loc, cid in asked:
                self._send(loc, encode({**msg, "re": cid}))
            return
        frame = encode(msg)  # a push: encoded once, to every rank
        for loc in list(self._by_rank.values()):
            self._send(loc, frame)
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
        if self._outage_since is None:
            self._outage_since = self._lost_at
        self._next_try = time.monotonic() + RECONNECT_EVERY_S
        self._registered = False
        try:
            self._sel.unregister(self._up)
        except (KeyError, ValueError):
            pass
        self._up.close()
        self._up_out.clear()
        self._up_decoder = FrameDecoder(SERVER_TYPES)
        self._answer_restarted()
        for k, (held, m) in list(self._votes.items()):
            del self._votes[k]
            self._send(held, encode({"type": "error", "re": m["id"], "code": "coordinator_restarted",
                                     "message": "the coordinator restarted while this vote was held"}))

    def _answer_restarted(self) -> None:
        routes, self._routes = self._routes, {}
        for asked in routes.values():
            for loc, cid in asked:
                self._send(loc, encode({"type": "error", "re": cid, "code": "coordinator_restarted",
                                        "message": "the coordinator restarted while this request was in flight"}))

    def _try_reconnect(self) -> None:
        assert self._lost_at is not None
        now = time.monotonic()
        assert self._outage_since is not None
        if now - self._outage_since > self.reconnect_s:
            gone = encode({"type": "error", "re": None, "code": "coordinator_gone",
                           "message": f"the coordinator did not come back within {self.reconnect_s:g} s"})
            for loc in list(self._by_rank.values()):
                self._send(loc, gone)
            self._end(f"the coordinator did not come back within {self.reconnect_s:g} s")
            return
        if now < self._next_try:
            return
        self._next_try = now + RECONNECT_EVERY_S
        try:
            up = socket.create_connection(self.upstream_addr, timeout=min(1.0, self.connect_timeout_s))
        except OSError:
            return
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up.setblocking(False)
        self._up, self._lost_at = up, None
        self._sel.register(up, selectors.EVENT_READ, "up")
        msg = {"type": "register", "token": self._token, "replica": self.replica_id, "join": self._join,
               "ranks": self.ranks, "relay": True}
        if self._held["generation"] > 0:
            msg["resume"] = dict(self._held)
        self._reg_uid = self._forward(msg, [])  # the ranks asked nothing: the reply stays here

    # ------------------------------------------------------------- bytes out

    def _send_up(self, msg: dict[str, Any]) -> None:
        if self._lost_at is not None:
            return  # the coordinator is away: nothing goes up until the relay registers again
        self._up_out += encode(msg)
        self._flush_up()

    def _flush_up(self) -> None:
        try:
            while self._up_out:
                del self._up_out[:self._up.send(self._up_out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._upstream_ended(f"the coordinator connection failed: {exc}")
            return
        self._want(self._up, "up", bool(self._up_out))

    def _send(self, loc: _Local, frame: bytes) -> None:
        loc.out += frame
        self._flush(loc)

    def _flush(self, loc: _Local) -> None:
        try:
            while loc.out:
                del loc.out[:loc.sock.send(loc.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            loc.out.clear()
            return
        self._want(loc.sock, loc, bool(loc.out))

    def _want(self, sock: socket.socket, data: Any, write: bool) -> None:
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            if self._sel.get_key(sock).events != want:
                self._sel.modify(sock, want, data)
        except (KeyError, ValueError):
            pass

    # ------------------------------------------------------------- endings

    def _end(self, why: str) -> None:
        if self.closed_why is None:
            self.closed_why = why

    def _close_all(self, why: str) -> None:
        """Closes upstream first (the coordinator fences the replica), then every rank: best effort
        to let pending output (a ``fenced`` error, the last replies) reach the ranks first."""
        for sock in (self._up, self._listener):
            try:
                sock.close()
            except OSError:
                pass
        for loc in list(self._locals):
            try:
                loc.sock.setblocking(True)
                loc.sock.settimeout(0.2)
                if loc.out:
                    loc.sock.sendall(loc.out)
            except OSError:
                pass
            loc.sock.close()
        self._locals.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


def _ballot(vote: dict[str, Any]) -> tuple[int, int, tuple[int, ...]]:
    return vote["generation"], vote["step"], tuple(sorted(vote["ids"]))
