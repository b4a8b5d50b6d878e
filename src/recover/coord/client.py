"""A worker's connection to the coordinator: registration, heartbeats, notices, reports, commit votes.

Contract: one :class:`CoordinatorClient` per replica process, created before any process group.
A replica of P processes has one client per process: ``CoordinatorClient(..., rank=k, ranks=P)``
for k in 0..P-1, all with the same ``replica_id``; each acks, heartbeats, reports and votes on its
own (the coordinator acts for the replica once all P did), and the death of any one rank (closed
connection, missed heartbeats) fences the others: their waiting calls raise CoordinatorLost.
``register()`` opens one persistent TCP connection; from then on a background reader thread receives
pushed notices (``failing``, ``membership``) and acks ``failing`` at once, and a heartbeat thread
sends a heartbeat every ``heartbeat_interval_s``. Everything else is a request from the caller's
thread that waits for its reply.

Invariants:
  * What the pushes tell (``membership``, ``failure_notice(g)``, ``dead_since(g)``) is kept by
    :class:`~recover.coord.generations.Generations`, with its invariants; ``failure_notice`` is a
    lock-free read, cheap enough for a poll loop.
  * A lost coordinator connection (or being fenced) is never silent: every waiting call raises
    :class:`CoordinatorLost`.

Commit vote: ``vote_commit(g, step, ids)`` returns ``None`` when every member of g voted the same
(step, ids) and the step is committed; it returns a new :class:`Membership` when the step is
committed *and* joiners were admitted at this step boundary (the new generation starts at
``step + 1``); it raises :class:`~recover.errors.PeerFailure` when a member died or the votes
disagreed: then nothing was committed, and the caller recovers on the next generation and votes
the same step again there.

Liveness (:mod:`recover.coord.liveness`): the training thread calls ``advance()`` at every phase
point; heartbeats carry that counter and the thread's activity (``compute``; ``wait`` inside
``activity("wait")``, which every blocking wait of this client and of a fault-tolerant group uses;
``io`` around checkpoints and evaluation), so the coordinator fences a replica whose training loop
stopped while its heartbeats go on. A fenced process whose training thread does not act on it
within ``fence_exit_s`` (it may be the stuck one) is ended by this client's watchdog with
``on_fenced`` (a one-line message, the fenced exit status), never left running.

Coordinator restart: with ``reconnect_s`` > 0, a connection that closes without a fence (the
coordinator crashed or was restarted) is not fatal: heartbeats pause, the client reconnects to the
same address every ``RECONNECT_EVERY_S`` and registers again with what it holds
(:class:`~recover.coord.protocol.Resume`: newest generation and members, last committed step,
speeds). Requests in flight get a ``coordinator_restarted`` refusal once it is back (a vote then
ends as an aborted vote, a report is moot), so the training thread moves on to the rebuilt
generation like after a failure; gloo collectives between the replicas go on meanwhile. Only when
it is not back within ``reconnect_s`` is it lost (``gone``), and every waiting call raises
CoordinatorLost.

Read deadline (:mod:`recover.coord.deadline`): a coordinator that names ``beat_s`` in its ``ok`` beats
this connection that often; a thread judges every beat whether it was heard within the deadline
(six beats, three heartbeat timeouts). Silent beyond it while the coordinator's host acknowledges
nothing (nor answers a reconnect): this replica is *cut off* (``cut_off`` says why; a relay tells
its ranks the same with a ``cut_off`` error): lost, and the process ends like a fenced one
(``on_fenced`` after ``fence_exit_s``) unless its training thread leaves first. Silent while its
host answers (the coordinator is paused): it waits like for a restart, and past ``reconnect_s`` of
silence it is ``gone``. A request is never timed out (TimeoutError) while the coordinator is away
like this or being reconnected to: the outage ends as a reply, a refusal or CoordinatorLost.

Stop: ``stop_requested = True`` (the worker's SIGINT handler) goes with the next vote; a commit
that is a stop sets ``stopping`` (every member stops after that step), and so does the
``stopping`` push to a replica still waiting to be admitted (then the connection is lost too).
Leave: ``leave_requested = True`` (the worker's SIGTERM handler) goes with the next vote as
``leave``; its commit sets ``left`` (this replica is no member of the next generation: it closes).

TLS (:mod:`recover.coord.tls`): with ``tls`` the connection is TLS with mutual authentication, its
handshake made at connect; reader and senders then share it through a
:class:`~recover.coord.tls.SerialSocket`.

Join: ``register(join=True)`` returns once a commit admitted the replica (``membership.joined``
lists it); the old members get that Membership back from ``vote_commit`` (the state transfer that
follows: docs/DESIGN.md §4.3).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from recover.coord.conn import connect_patiently
from recover.coord.deadline import DEADLINE_BEATS, AckClock, Verdict, host_answered, judge, read_deadline
from recover.coord.generations import Generations
from recover.coord.graylinks import PROBE_TIMEOUT_S as RATE_PROBE_TIMEOUT_S
from recover.coord.probe import MAX_RATE_BYTES, PROBE_TIMEOUT_S, LinkProbe
from recover.coord.protocol import (
    RELEASE,
    SERVER_TYPES,
    Ballot,
    FrameDecoder,
    Membership,
    ProtocolError,
    Resume,
    encode,
    speeds_from_wire,
)
from recover.coord.tls import SerialSocket, Tls
from recover.errors import CoordinatorLost, CoordinatorRefused, Diverged, Expelled, PeerFailure, QuorumLost
from recover.faults.perturb import NONE
from recover.observe import cpu

RECONNECT_EVERY_S = 0.2
"""How often a client that lost the coordinator tries to reach it again."""
_SERVER_TYPES = SERVER_TYPES


_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def in_collective(skip: int) -> bool:
    """Whether a thread of this process but ``skip`` (the caller) is blocked in ``torch.distributed``: its
    innermost Python frame is that package's (a collective or a wait on one; the C++ call below it has no
    frame of its own)."""
    import sys

    return any(_DISTRIBUTED in frame.f_code.co_filename
               for ident, frame in sys._current_frames().items() if ident != skip)


class CoordinatorClient:
    """See the module docstring. Thread-safe."""

    def __init__(self, host: str, port: int, token: str, replica_id: int, heartbeat_interval_s: float = 0.1,
                 connect_timeout_s: float = 10.0, request_timeout_s: float = 60.0, *, rank: int = 0,
                 ranks: int = 1, fence_exit_s: float | None = None,
                 on_fenced: Callable[[str], Any] | None = None, reconnect_s: float = 0.0,
                 on_reconnected: Callable[[float], Any] | None = None, tls: Tls | None = None) -> None:
        self.host, self.port, self.replica_id = host, int(port), int(replica_id)
        self.rank, self.ranks = int(rank), int(ranks)  # this process within its replica (checked at register)
        self._token = token
        self.tls = tls
        """Connect over TLS with this certificate (:mod:`recover.coord.tls`; None: plain TCP)."""
        self.heartbeat_interval_s = heartbeat_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._sock: Any = None  # a socket, or a SerialSocket over TLS
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._known = Generations()  # what the coordinator pushed: read under self._cond, or lock-free
        self._lost: str | None = None
        self._closing = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wakers: set[threading.Event] = set()
        self._progress = 0
        self._entered = 0
        self._activity = "compute"
        self._beat_progress = -1  # the progress the previous heartbeat carried
        self.fence_exit_s, self.on_fenced = fence_exit_s, on_fenced
        self.speeds: dict[int, float] | None = None
        """The planned seconds per microbatch from the last commit this client voted in (None: even)."""
        self.perturb = NONE
        """Injected faults (:class:`~recover.faults.Perturbation`): broken links, muted heartbeats."""
        self._probe = LinkProbe(self.replica_id, lambda replica: self.perturb.unreachable(replica))
        self.reconnect_s, self.on_reconnected = reconnect_s, on_reconnected
        self._join = False
        self._registered = False  # the coordinator accepted this client's register (a reconnect makes sense)
        self._pending: dict[int, dict[str, Any]] = {}  # request id -> request, until its reply
        self._reconnecting = False
        self._attempt_failed = False
        self.gone = False
        """The coordinator did not come back within ``reconnect_s``."""
        self.refused: CoordinatorRefused | None = None
        """The coordinator speaks another wire protocol (another release): refused, not lost."""
        self.cut_off: str | None = None
        """Why this replica is cut off from the coordinator (its host answers nothing): it leaves."""
        self._heard = time.monotonic()  # when the coordinator last sent a byte
        self._deadline_s: float | None = None  # the read deadline (None: the coordinator does not beat)
        self._away = False  # silent beyond the deadline while its host answers: paused or restarting
        self.committed_step = -1
        """The last step this replica knows committed (the worker sets it on resume and after a join)."""
        self.stop_requested = False
        """Set by the worker when its process is asked to stop; sent with the next vote."""
        self.stopping = False
        """The job stops: the last commit was a stop, or this replica was told while waiting to join."""
        self.leave_requested = False
        """Set by the worker when its process is asked to leave the job; sent with the next vote."""
        self.left = False
        """The last commit was this replica's leave: it is no member of the next generation."""
        self.finished = False
        """The job had finished when this replica registered: nothing to join."""
        self.diverged: Diverged | None = None
        """The coordinator ended the job for a divergence (pushed to a member not voting at the time)."""

    # ------------------------------------------------------------- public API

    def register(self, join: bool = False, timeout: float = 600.0) -> Membership:
        """Connects, registers and blocks until a generation includes this replica; returns it.

        With ``join=False`` before the first generation, this replica counts towards the initial
        ``expected`` replicas. Otherwise (or with ``join=True``) it waits for admission at the next
        commit (step boundary); the returned membership lists it in ``joined``. A replica of several
        ranks is registered once all its ranks are (every rank passes the same ``join``).

        Raises:
            CoordinatorRefused: wrong token, duplicate replica id, ``bad_rank``, ``duplicate_rank``,
                ``rank_mismatch`` (another rank declared a different ``ranks`` or ``join``), ...
            CoordinatorLost, TimeoutError.
        """
        if self._sock is not None:
            raise RuntimeError("register() was already called on this client")
        try:
            self._use(self._connect(patient=True))
        except OSError as exc:
            raise CoordinatorLost(f"{self._who} cannot reach the coordinator at "
                                  f"{self.host}:{self.port}: {exc}; is `recover coordinator` running?") from None
        self._join = join
        ok = self._request(self._register_msg(), timeout)
        if "heartbeat_s" in ok:  # the coordinator adapts the interval to the job's size (recover.coord.scale)
            self.heartbeat_interval_s = max(self.heartbeat_interval_s, float(ok["heartbeat_s"]))
        self._registered = True
        self._spawn(self._heartbeat, "recover-coord-heartbeat")
        self._deadline_s = read_deadline(ok.get("beat_s"))
        if self._deadline_s is not None:
            self._spawn(self._watch, "recover-coord-deadline")
        return self._wait(lambda: self._known.admitted(self.replica_id), timeout, "admission to a generation")

    def _connect(self, patient: bool = False) -> Any:
        """``patient``: the first connection, to a coordinator that may still be starting; else one try
        within the read deadline, when there is one. Over TLS the handshake is made here (a refused one
        raises ``ssl.SSLError``, an OSError)."""
        address = (self.host, self.port)
        sock = (connect_patiently(address, self.connect_timeout_s) if patient else
                socket.create_connection(address, timeout=min(self.connect_timeout_s, self._deadline_s or math.inf)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                return SerialSocket(self.tls.client().wrap_socket(sock, server_hostname=self.host))
            except OSError:
                sock.close()
                raise
        sock.settimeout(None)
        return sock

    def _use(self, sock: Any) -> None:
        """``sock`` is the coordinator connection from now on; a reader thread serves it."""
        self._sock = sock
        self._spawn(lambda: self._reader(sock), "recover-coord-reader")

    def _register_msg(self) -> dict[str, Any]:
        msg = {"type": "register", "token": self._token, "replica": self.replica_id, "join": self._join,
               "rank": self.rank, "ranks": self.ranks, "pid": os.getpid(), "release": RELEASE,
               "probe": self.probe_address()}
        m = self.membership
        if m is not None:  # a registration again, after the coordinator was lost: what this replica holds
            speeds = self.speeds if self.speeds is not None else m.speeds
            msg["resume"] = Resume(m.generation, m.members, self.committed_step, speeds).to_wire()
        return msg

    # ---- link probes (recover.coord.probe): after a collective timed out, who can this replica reach?
    def probe_address(self) -> str:
        """``host:port`` of this replica's probe listener, on the interface that reaches the coordinator."""
        host = "127.0.0.1"
        if self._sock is not None:
            try:
                host = self._sock.getsockname()[0]
            except OSError:  # a closed connection: the listener, started on first use, keeps its address
                pass
        return self._probe.address(host)

    def unreachable(self, peers: dict[int, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
        """The replicas of ``peers`` (replica -> probe address) this one cannot reach (:mod:`recover.coord.probe`)."""
        return self._probe.unreachable(peers, timeout_s)

    def _answer_reach(self, peers: dict[int, str]) -> None:
        """The coordinator asks whether this replica (a joiner held back by a known cut) reaches ``peers``
        now: the probe's answer goes back as ``reached`` (:mod:`recover.coord.links`)."""
        missing = set(self._probe.unreachable(peers))
        try:
            self._send({"type": "reached", "reached": sorted(set(peers) - missing)})
        except OSError:
            pass  # the connection is gone: the reader marks it lost

    def _answer_rate(self, peers: dict[int, str], nbytes: int) -> None:
        """The coordinator asks how fast this replica's links to ``peers`` are (the slow-link rule,
        :mod:`recover.coord.graylinks`): each round trip's seconds go back as ``rates``."""
        times = self._probe.rates(peers, nbytes, RATE_PROBE_TIMEOUT_S)
        try:
            self._send({"type": "rates", "times": {str(r): round(t, 6) for r, t in times.items()}})
        except OSError:
            pass  # the connection's own loss is seen by the reader

    def advance(self) -> None:
        """The training loop passed a phase point (its progress, sent with the heartbeats)."""
        self._progress += 1

    def _reported_activity(self, progress: int) -> str:
        """The activity a heartbeat carries: ``compute`` without progress since the previous beat while a
        thread of this process is blocked in a ``torch.distributed`` call (a collective inside the replica:
        FSDP, tensor parallel, a pipeline's send or receive) is ``wait``: this rank waits for a peer of its
        replica, and the hang rule names the stuck one (:mod:`recover.coord.liveness`)."""
        if self._activity != "compute" or progress != self._beat_progress:
            return self._activity
        return "wait" if in_collective(threading.get_ident()) else "compute"

    def entering(self, generation: int) -> None:
        """The training thread moves on to ``generation`` (forms its group): sent with the heartbeats,
        so a training thread stuck in a wait of an older generation is told apart from a waiting one."""
        self._entered = max(self._entered, generation)

    @contextmanager
    def activity(self, kind: str) -> Iterator[None]:
        """Marks what the training thread does inside: ``wait`` (blocked for the others) or ``io``
        (a checkpoint, an evaluation); ``compute`` outside. Nests."""
        before, self._activity = self._activity, kind
        try:
            yield
        finally:
            self._activity = before

    @property
    def membership(self) -> Membership | None:
        """The newest generation this client knows of (None before the first)."""
        return self._known.newest

    def failure_notice(self, generation: int) -> bool:
        """True once the coordinator has declared ``generation`` failing or formed a later one."""
        return self._known.notice(generation)

    def notice_time(self, generation: int) -> float | None:
        """``time.monotonic()`` when this process first learnt that ``generation`` failed."""
        return self._known.notice_time(generation)

    def add_waker(self, event: threading.Event) -> None:
        """``event`` is set whenever a notice or membership arrives or the connection is lost."""
        with self._cond:
            self._wakers.add(event)
            if self._lost is not None:
                event.set()

    def remove_waker(self, event: threading.Event) -> None:
        with self._cond:
            self._wakers.discard(event)

    def _wake(self) -> None:
        with self._cond:
            for event in self._wakers:
                event.set()

    @property
    def lost(self) -> str | None:
        """Why the coordinator connection is gone, or None while it is up."""
        return self._lost

    def settle(self) -> str | None:
        """Blocks until the read deadline has judged the coordinator's silence, at most one deadline
        and one beat (at once without a deadline); returns :attr:`lost` then. For a caller that met a
        broken network path elsewhere (a store, a peer): was it this replica's?"""
        wait_s = 0.0 if self._deadline_s is None else self._deadline_s * (1 + 1 / DEADLINE_BEATS)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._lost is None and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return self._lost

    def report_failure(self, generation: int, suspects: tuple[int, ...] | list[int] = (),
                       timed_out: bool = False) -> None:
        """Tells the coordinator that a collective of ``generation`` failed (idempotent); ``timed_out``:
        it ran out of time (the coordinator then fences the members that never reached it, or, when
        all did, the replica that the ``suspects`` of the members' reports, those they could not
        reach, implicate)."""
        try:
            self._request({"type": "report", "generation": generation, "suspects": sorted(suspects),
                           "timeout": timed_out})
        except CoordinatorRefused as exc:
            if exc.code not in ("bad_generation", "coordinator_restarted"):
                raise

    def report_nonfinite(self, generation: int, step: int, ids: list[int]) -> None:
        """Microbatches ``ids`` of ``step`` had a loss or gradient that is not finite here (they are
        not in this replica's gradient). The coordinator fences this replica (its microbatches are
        recomputed by the others) or, when another replica reported one of them too, ends the job
        (raises :class:`Diverged`)."""
        self._request({"type": "nonfinite", "generation": generation, "step": step, "ids": sorted(ids)})

    def wait_for_generation(self, after: int, timeout: float) -> Membership:
        """Blocks until a generation newer than ``after`` exists; returns the newest one.

        Raises:
            QuorumLost: the new generation has fewer members than the job's ``min_members``.
            Expelled: this replica is not in it. CoordinatorLost, TimeoutError.
        """
        m = self._wait(lambda: self._known.newer_than(after), timeout, f"a generation after {after}")
        if self.replica_id not in m.members:
            raise Expelled(f"replica {self.replica_id} is not a member of generation {m.generation} "
                           f"(members {list(m.members)}): it was declared dead")
        if len(m.members) < m.min_members:
            raise QuorumLost(f"generation {m.generation} has {len(m.members)} live replicas "
                             f"{list(m.members)}, fewer than min_members={m.min_members}")
        return m

    def dead_since(self, generation: int) -> tuple[int, ...]:
        """Members of ``generation`` that are not in the newest known generation."""
        return self._known.dead_since(generation)

    def vote_commit(self, generation: int, step: int, ids: list[int] | tuple[int, ...],
                    timeout: float | None = None, mb_s: float | None = None,
                    fp: str | None = None, audit: dict[str, Any] | None = None, comp_s: float | None = None,
                    comm_s: float | None = None) -> Membership | None:
        """Commit vote for ``step`` of ``generation`` with the microbatch ``ids`` in the reduced gradient
        and ``mb_s``, the seconds per microbatch this rank measured in the step (None: it computed none);
        ``comp_s`` and ``comm_s``, its wall seconds of compute and of waiting in the reduction.
        A commit sets :attr:`speeds` to the times the next step is planned with. ``fp``: the fingerprint
        of this rank's parameters (the coordinator fences a minority that differs from the majority);
        ``audit``: ``{id, fp, norm, exact}`` of the audited microbatch's gradient, when this replica took part.

        Returns:
            None when all members agreed and the step is committed; a new Membership when the step
            is committed and joiners were admitted or a replica left (a new generation starts at
            ``step + 1``); None to the replica that left at it (``left`` is set).
        Raises:
            PeerFailure: a member died, the votes disagreed, or a divergent minority was fenced; nothing
                was committed.
            Diverged: the fingerprints disagree with no majority: the job ends.
        """
        ballot = Ballot.make(generation, step, ids, mb_s, self.stop_requested, fp, audit, self.leave_requested,
                             comp_s, comm_s)
        try:
            reply = self._request(ballot.to_wire(), timeout)
        except Diverged:
            raise
        except CoordinatorRefused as exc:
            if exc.code not in ("stale_generation", "coordinator_restarted"):
                raise
            reply = {"type": "aborted", "reason": exc.code}
        if reply["type"] == "committed":
            self.speeds = speeds_from_wire(reply.get("speeds"))
            self.committed_step = max(self.committed_step, step)
            self.stopping = self.stopping or reply.get("stop") is True
            self.left = reply.get("left") is True
            new = reply.get("new_generation")
            return None if new is None else self._known.of(new)
        self.wait_for_generation(generation, timeout or self.request_timeout_s)
        raise PeerFailure(generation, self.dead_since(generation), f"commit vote aborted: {reply['reason']}")

    def close(self) -> None:
        """Says goodbye (the coordinator marks this replica as left) and stops the threads."""
        self._closing = True
        self._stop.set()
        if self._sock is not None and self._lost is None:
            try:
                self._send({"type": "bye"})
            except OSError:
                pass
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self._probe.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals

    @property
    def _who(self) -> str:
        return f"replica {self.replica_id}" + (f" rank {self.rank}/{self.ranks}" if self.ranks > 1 else "")

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=f"{name}-{self.replica_id}", daemon=True)
        self._threads.append(t)
        t.start()
        cpu.register(t)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._sock is not None
        data = encode(msg)
        with self._send_lock:
            self._sock.sendall(data)

    def _request(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        rid = next(self._ids)
        with self._cond:
            self._pending[rid] = msg
        try:
            if not self._reconnecting:
                self._send({**msg, "id": rid})
        except OSError as exc:
            if self.reconnect_s <= 0:
                self._mark_lost(f"send failed: {exc}")
            # else: the reader sees the connection end and reconnects; the request is answered then
        try:
            reply = self._wait(lambda: self._replies.pop(rid, None), timeout or self.request_timeout_s,
                               f"the reply to {msg['type']}")
        finally:
            with self._cond:
                self._pending.pop(rid, None)
        if reply["type"] == "error":
            if reply["code"] in ("diverged", "nonfinite"):
                raise Diverged(reply["code"], reply["message"], reply.get("sides"))
            raise CoordinatorRefused(reply["code"], reply["message"])
        return reply

    def _wait(self, ready: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond, self.activity("wait"):
            while True:
                value = ready()
                if value is not None:
                    return value
                if self.refused is not None:
                    raise self.refused
                if self._lost is not None:
                    raise CoordinatorLost(f"{self._who} lost the coordinator at "
                                          f"{self.host}:{self.port} while waiting for {what}: {self._lost}")
                left = deadline - time.monotonic()
                if left <= 0 and self._outage():  # it ends within reconnect_s: a reply, a refusal or lost
                    deadline = time.monotonic() + (self._deadline_s / DEADLINE_BEATS if self._deadline_s
                                                   else RECONNECT_EVERY_S)
                    continue
                if left <= 0:
                    raise TimeoutError(f"{self._who}: no {what} from the coordinator "
                                       f"within {timeout:g} s")
                self._cond.wait(left)

    def _outage(self) -> bool:
        """The coordinator is away: being reconnected to, judged away, or silent for two beats (the
        read deadline judges it soon)."""
        if self._reconnecting or self._away:
            return True
        return self._deadline_s is not None and time.monotonic() - self._heard > 2 * self._deadline_s / DEADLINE_BEATS

    def _mark_lost(self, why: str) -> None:
        with self._cond:
            if self._lost is None:
                self._lost = why
            self._cond.notify_all()
            for event in self._wakers:
                event.set()

    def _reader(self, sock: Any) -> None:
        decoder = FrameDecoder(_SERVER_TYPES)
        why, answered = "coordinator closed the connection", True
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                self._heard, self._away = time.monotonic(), False
                for msg in decoder.feed(data):
                    if isinstance(msg, ProtocolError):
                        raise msg
                    self._on_message(msg)
        except (OSError, ProtocolError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            answered = not isinstance(exc, OSError) or host_answered(exc)
            if isinstance(exc, ProtocolError) and exc.code == "bad_version":  # another release's coordinator
                self.refused = CoordinatorRefused("bad_version", exc.message.replace("the peer", "the coordinator")
                                                  .replace("this side", f"{self._who}"))
                self._mark_lost(str(self.refused))
                return
        if sock is not self._sock:
            return  # a connection already given up (a reconnect replaced it)
        if self._closing:
            self._mark_lost("closed")
        elif self._lost is None and self.reconnect_s > 0 and self._registered and not self.stopping:
            with self._cond:
                if self._reconnecting:  # the reconnect's own new connection ended: it tries again
                    self._attempt_failed = True
                    self._cond.notify_all()
                    return
                self._reconnecting = True  # one reconnect at a time, started by the current connection's reader
            self._spawn(lambda: self._reconnect(why, answered), "recover-coord-reconnect")
        else:
            self._mark_lost(why)

    def _reconnect(self, why: str, answered: bool) -> None:
        """The coordinator connection ended without a fence: reach it again within ``reconnect_s``,
        register with what this replica holds, then answer the requests in flight (see the module
        docstring). A new connection that ends before its register is answered (a dying listener took
        it) is tried again. Not back in time: lost for good (``gone``). Its host answering none of the
        tries for the read deadline (``answered``: the old connection's end was its answer): cut off."""
        t0 = time.monotonic()
        deadline = t0 + self.reconnect_s
        last_answer = t0 if answered else self._heard
        reply = None
        while reply is None:
            if self._stop.is_set() or self._lost is not None:
                return
            if time.monotonic() >= deadline:
                self.gone = True
                self._mark_lost(f"the coordinator did not come back within {self.reconnect_s:g} s ({why})")
                return
            rid, sock = next(self._ids), None
            try:
                sock = self._connect()
                sock.sendall(encode({**self._register_msg(), "id": rid}))
            except OSError as exc:
                if sock is not None:
                    sock.close()
                now = time.monotonic()
                last_answer = now if host_answered(exc) else last_answer
                if self._judge(now - self._heard, now - last_answer, f" (it closed: {why}; again: {exc})"):
                    return
                self._stop.wait(RECONNECT_EVERY_S)
                continue
            with self._send_lock, self._cond:
                self._attempt_failed = False
                self._use(sock)
            with self._cond:  # not _wait: that would mark the training thread's activity
                while (reply := self._replies.pop(rid, None)) is None and self._lost is None \
                        and not self._attempt_failed and time.monotonic() < deadline:
                    self._cond.wait(max(0.01, deadline - time.monotonic()))
            if reply is None and self._attempt_failed:
                self._stop.wait(RECONNECT_EVERY_S)
        if reply["type"] == "error":
            self._mark_lost(f"the restarted coordinator refused this replica: {reply['code']}: {reply['message']}")
            return
        with self._cond:
            for pending, msg in self._pending.items():
                self._replies[pending] = {**reply, "re": pending} if msg["type"] == "register" else {
                    "type": "error", "re": pending, "code": "coordinator_restarted",
                    "message": "the coordinator restarted while this request was in flight"}
            self._reconnecting = False
            self._cond.notify_all()
        if self.on_reconnected is not None:
            self.on_reconnected(time.monotonic() - t0)

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "failing":
            g = msg["generation"]
            self._known.failing(g, time.monotonic())
            self._wake()
            try:
                self._send({"type": "ack", "generation": g})
            except OSError as exc:
                self._mark_lost(f"ack failed: {exc}")
        elif kind == "membership" and msg["membership"] is not None:
            m = Membership.from_wire(msg["membership"])
            with self._cond:
                self._known.formed(m, time.monotonic())
                self._cond.notify_all()
                for event in self._wakers:
                    event.set()
        elif kind == "reach":
            peers = {int(r): str(a) for r, a in (msg["peers"] or {}).items() if str(r).isdigit()}
            self._spawn(lambda: self._answer_reach(peers), "recover-reach")
        elif kind == "rate" and self.rank == 0:  # rank 0's listener is the replica's probe address
            peers = {int(r): str(a) for r, a in (msg["peers"] or {}).items() if str(r).isdigit()}
            nbytes = max(0, min(int(msg["bytes"]), MAX_RATE_BYTES))
            self._spawn(lambda: self._answer_rate(peers, nbytes), "recover-rate")
        elif kind == "error" and msg.get("re") is None:
            if msg["code"] == "fenced":  # otherwise a refused frame; a fatal one is followed by EOF
                self._mark_lost(f"fenced by the coordinator: {msg['message']}")
                self._start_watchdog(msg["message"])
            elif msg["code"] in ("stopping", "finished"):
                self.stopping = True
                self.finished = msg["code"] == "finished"
                self._mark_lost(msg["message"])
            elif msg["code"] == "coordinator_gone":  # from the replica's relay: it gave up reconnecting
                self.gone = True
                self._mark_lost(msg["message"])
            elif msg["code"] == "cut_off":  # from the replica's relay: the coordinator's host answers it nothing
                self._leave(msg["message"])
            elif msg["code"] in ("diverged", "nonfinite"):
                self.diverged = Diverged(msg["code"], msg["message"], msg.get("sides"))
                self._mark_lost(msg["message"])
        elif msg.get("re") is not None:
            with self._cond:
                self._replies[msg["re"]] = msg
                self._cond.notify_all()

    def _start_watchdog(self, why: str) -> None:
        """After ``fence_exit_s``, calls ``on_fenced(why)`` unless the client was closed meanwhile."""
        on_fenced, after = self.on_fenced, self.fence_exit_s
        if on_fenced is None or after is None:
            return

        def watch() -> None:
            if not self._stop.wait(after) and not self._closing:
                on_fenced(why)

        threading.Thread(target=watch, name="recover-fence-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """The read deadline (:mod:`recover.coord.deadline`): every beat, judges the coordinator's silence."""
        assert self._deadline_s is not None
        acks: AckClock | None = None
        while not self._stop.wait(self._deadline_s / DEADLINE_BEATS):
            sock = self._sock
            if self._lost is not None:
                return
            if self._reconnecting or sock is None:
                continue  # the reconnect judges its own tries
            if acks is None or acks.sock is not sock:
                acks = AckClock(sock)
            now = time.monotonic()
            self._judge(now - self._heard, acks.age(now))

    def _judge(self, silent_s: float, answered_s: float | None, detail: str = "") -> bool:
        """Acts on the verdict on a silence of ``silent_s``, the coordinator's host having answered
        ``answered_s`` ago; True when it ended the connection for good."""
        if self._deadline_s is None:
            return False
        verdict = judge(silent_s, self._deadline_s, answered_s, self.reconnect_s)
        self._away = verdict is Verdict.AWAY
        if verdict is Verdict.CUT_OFF:
            self._leave(f"cut off from the coordinator at {self.host}:{self.port}: nothing heard from it for "
                        f"{silent_s:.1f} s and its host answered nothing for {answered_s:.1f} s{detail}")
        elif verdict is Verdict.GONE and not self._reconnecting:
            self.gone = True
            self._end(f"the coordinator was silent for {silent_s:.1f} s (paused?), more than "
                      f"{self.reconnect_s:g} s")
        return verdict in (Verdict.CUT_OFF, Verdict.GONE) and self._lost is not None

    def _leave(self, why: str) -> None:
        """Cut off: lost (every waiting call raises CoordinatorLost), and the process ends like a fenced
        one (the coordinator has fenced it by now) if its training thread does not leave first."""
        self.cut_off = why
        self._end(why)
        self._start_watchdog(why)

    def _end(self, why: str) -> None:
        """Lost for good: every waiting call raises CoordinatorLost; a send blocked on a dead path returns."""
        self._mark_lost(why)
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            if self._lost is not None:
                return
            if self._reconnecting or not self.perturb.heartbeats():
                continue
            progress = self._progress
            activity = self._reported_activity(progress)
            self._beat_progress = progress
            try:
                self._send({"type": "hb", "progress": progress, "activity": activity, "generation": self._entered})
            except OSError as exc:
                if self.reconnect_s <= 0:
                    self._mark_lost(f"heartbeat failed: {exc}")
                    return
