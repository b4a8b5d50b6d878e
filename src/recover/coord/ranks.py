"""The coordinator's connection logic: authentication, timeouts and per-replica rank aggregation.

Pure: no sockets, no threads, no clock (every event carries ``now``). The server owns the sockets,
names each connection by an opaque hashable key, feeds one :class:`RankAggregator` from one thread
in the order it observes them (``on_open``, ``on_heard``: any bytes count as a heartbeat,
``on_message``, ``on_bad_frame``, ``on_closed``, ``on_tick``, ``on_resumed``, ``on_stop_requested``)
and carries out the actions each returns, in order (:mod:`recover.coord.slots`: ``SendTo``,
``Close``; a :class:`~recover.coord.state.Log` record). The membership stays in the
:class:`~recover.coord.state.MembershipState` this object wraps and alone drives.

Invariants:
  * A connection's first message must be a ``register`` with the right token that passes
    :func:`~recover.coord.slots.check_register`, or an operator's ``status`` or ``drain`` with the right
    token (:mod:`recover.coord.operator`: such a connection is no member, never judged by a timeout,
    and each of its requests carries the token); anything else is refused (``error`` reply,
    ``refused`` log) and the connection closed. So is a connection that does not register within
    ``register_timeout_s``, or one whose stream is out of sync. A bad message on a registered
    connection is refused and the connection stays.
  * Rank k of replica R registers on its own connection (``rank=k, ranks=P``), or one connection
    carries all P (a *relay*, ``relay=true``: messages name the ``rank`` they speak for, none for
    every rank; a rank's silence is that of its entries in the batched ``hbs`` heartbeats). R reaches
    the state once all P registered. Pushes and shared replies go once per connection.
  * ``register``, ``ack`` and ``vote`` follow the rule "the P ranks are one member"
    (:mod:`recover.coord.member`); a vote the state would refuse or abort anyway goes to it at once,
    for that rank alone. Ranks that vote differently fence the replica. ``failing`` and
    ``membership`` pushes answer the votes still held for the generations they end ``aborted``.
    ``report`` and ``nonfinite`` go to the state at once. Every request forwarded to the state gets
    a unique id; its reply goes back to exactly the connection(s) that asked, each with its own id.
  * A ``report`` that a collective of the current generation timed out fences the members that never
    reached it (computing or in io, by their heartbeats). When every member reached it (a broken
    link), the reports are held and judged by the link rule (:mod:`recover.coord.links`); so is any other
    report of the current generation while it is not failing (a backend error after a peer's timeout).
  * With ``beat_s``, every registered connection gets a ``beat`` that often (the coordinator is never
    silent for longer: a worker's read deadline, :mod:`recover.coord.deadline`).
  * Timeouts (heartbeat, registration, hangs) are judged on a coarser clock (``scan_s``,
    :func:`recover.coord.scale.scan_interval`), not at every tick: at most one scan late.
  * Any rank's connection closing, its silence beyond ``heartbeat_timeout_s`` (counted from the
    replica's registration), its lack of progress while others wait for it (a *hung* replica,
    :mod:`recover.coord.liveness`), or its fencing fences all the replica's other ranks (each gets
    the ``fenced`` error, then is closed) and tells the state once that R is dead. A replica the
    state never heard of (not all ranks registered yet) is only logged as ``register_abandoned``.
"""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any

from recover.coord.actions import Action, Fence, Log, Refused, Send
from recover.coord.graylinks import PROBE_BYTES
from recover.coord.links import LinkJudge
from recover.coord.liveness import Liveness
from recover.coord.member import Agreed, Disagreed
from recover.coord.operator import job_status
from recover.coord.protocol import (
    OPERATOR_TYPES,
    RELEASE,
    Ballot,
    ProtocolError,
    Resume,
    batch_lists,
    check_release,
)
from recover.coord.slots import Close, Link, Out, SendTo, Slot, check_register, replica_resume
from recover.coord.state import MembershipState
from recover.names import Event

LINK_GRACE_S = 5.0
ISOLATION_HOLD_S = 30.0
"""How long every member's silence at once is taken for the coordinator's isolation (the default of the
workers' ``fault_tolerance.coordinator_reconnect_s``)."""
REACH_EVERY_S = 2.0
"""How often a joiner held back by a known cut is asked to probe the replicas it was cut from."""


class RankAggregator:
    """Connections and ranks in, actions out (see the module docstring).

    Args:
        state: the membership state machine; only this object calls it from now on.
        token: the shared secret a ``register`` must carry.
        heartbeat_timeout_s: silence after which a rank of a registered replica is fenced.
        register_timeout_s: a connection that has not registered after this long is closed.
        liveness: the progress rule that fences hung replicas (default: the automatic hang timeout).
        link_grace_s: how long the timed-out reports of a collective every member reached are
            gathered before the replica they implicate is fenced (:mod:`recover.coord.links`).
        heartbeat_s: the heartbeat interval named in every ``ok`` reply to a ``register`` (None: none).
        scan_s: seconds between timeout scans (0: at every tick).
        beat_s: every this many seconds each registered connection gets a ``beat`` (its read deadline,
            :mod:`recover.coord.deadline`), and every ``ok`` names it; 0: no beats.
        isolation_hold_s: how long a silence of every member at once is taken for this coordinator's
            own isolation, judged nobody (:meth:`_isolated`).
    """

    def __init__(self, state: MembershipState, *, token: str, heartbeat_timeout_s: float,
                 register_timeout_s: float, liveness: Liveness | None = None,
                 link_grace_s: float = LINK_GRACE_S, heartbeat_s: float | None = None, scan_s: float = 0.0,
                 beat_s: float = 0.0, isolation_hold_s: float = ISOLATION_HOLD_S) -> None:
        if not token:
            raise ValueError("token must be a non-empty string")
        self.state = state
        self._token = token.encode()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.register_timeout_s = register_timeout_s
        self.liveness = liveness or Liveness()
        self._links: dict[Hashable, Link] = {}
        self._slots: dict[int, Slot] = {}
        self._ids = itertools.count(1)  # ids of forwarded requests: those of different ranks collide
        self._out: list[Out] = []
        self._now = 0.0  # the time of the event whose actions are being applied
        self.link_rule = LinkJudge[tuple[Link, dict[str, Any]] | None](link_grace_s)  # reports held (None: a reach)
        self.heartbeat_s = heartbeat_s
        self.scan_s = scan_s
        self._next_scan = float("-inf")
        self.beat_s = beat_s
        self._next_beat = float("-inf")
        self._next_reach = float("-inf")
        self.isolation_hold_s = isolation_hold_s
        self._isolated_since: float | None = None  # the members' common silence began (see _isolated)
        self._asked: dict[int, dict[int, list[int]]] = {}  # generation -> member -> the peers it was asked about
        self._drains: dict[int, list[tuple[Link, int]]] = {}  # replica -> the operators' drains awaiting its commit

    @property
    def slots(self) -> Mapping[int, Slot]:
        """Read-only view of the replicas that have at least one rank registered, by replica id."""
        return MappingProxyType(self._slots)

    def snapshot(self) -> dict[str, Any]:
        """The state's :meth:`~MembershipState.summary` plus ``registering``: each replica still
        waiting for some of its ranks, mapped to the ranks in so far."""
        return {**self.state.summary(),
                "registering": {r: sorted(s.links) for r, s in sorted(self._slots.items()) if not s.registered}}

    # ----------------------------------------------------------------- events

    def on_open(self, conn: Hashable, peer: str, now: float) -> None:
        """A new connection ``conn`` from ``peer``; it must register within ``register_timeout_s``."""
        self._links[conn] = Link(conn, peer, now, now)

    def on_heard(self, conn: Hashable, now: float) -> None:
        """Bytes arrived on ``conn``: it is not silent."""
        link = self._links.get(conn)
        if link is not None and not link.relay:
            link.last_seen = now

    def on_message(self, conn: Hashable, msg: dict[str, Any], now: float) -> list[Out]:
        """A schema-valid client message on ``conn``."""
        link = self._links.get(conn)
        if link is not None:
            if link.replica is None:
                self._authenticate(link, msg, now)
            else:
                self._handle(link, msg, now)
        return self._take()

    def on_bad_frame(self, conn: Hashable, error: ProtocolError, now: float) -> list[Out]:
        """``conn`` sent something that is not a valid message: refused; closed if the stream is out
        of sync or the connection has not registered."""
        link = self._links.get(conn)
        if link is not None:
            self._refuse(link, error.code, error.message, None, error.fatal or link.replica is None, now)
        return self._take()

    def on_closed(self, conn: Hashable, cause: str, now: float) -> list[Out]:
        """``conn`` is gone (``cause`` goes to the log): its replica, if any, is dead."""
        link = self._links.get(conn)
        if link is not None:
            self._drop(link, cause, now)
        return self._take()

    def on_resumed(self, stall_s: float, now: float) -> list[Out]:
        """The server was not running for ``stall_s`` (and has read what arrived meanwhile): nobody is
        judged across that gap. Every connection gets a fresh grace, and the hang and failure-round
        clocks move on by the gap."""
        self._grace(stall_s, now)
        self._log(Event.COORDINATOR_STALLED, seconds=round(stall_s, 3))
        return self._take()

    def _grace(self, stall_s: float, now: float) -> None:
        """Nobody is judged across a gap of ``stall_s`` ending ``now`` (see :meth:`on_resumed`)."""
        for link in self._links.values():
            link.last_seen = max(link.last_seen, now)
            link.opened += stall_s
        for slot in self._slots.values():
            slot.seen[:] = [max(seen, now) for seen in slot.seen]
        self.liveness.pause(stall_s)
        self.state.pause(stall_s)
        self.link_rule.pause(stall_s)

    def on_stop_requested(self, now: float) -> list[Out]:
        """The coordinator was asked to stop the job: the next commit is a stop (see the state)."""
        self._apply(self.state.request_stop(), now)
        return self._take()

    def on_not_ready(self, replicas: list[int], detail: str, now: float) -> list[Out]:
        """Admitted joiners that did not start their rendezvous in time (:mod:`recover.coord.admission`):
        each is fenced (``join_not_ready``) like a hung replica, which opens a failure round."""
        for r in replicas:
            slot = self._slots.get(r)
            if slot is not None:
                self._kill(slot, "join_not_ready", detail, now)
        return self._take()

    def on_tick(self, now: float) -> list[Out]:
        """Register and heartbeat timeouts (every ``scan_s``), then the state's own deadlines."""
        if now >= self._next_scan:
            self._next_scan = now + self.scan_s
            self._scan(now)
        if self._isolated_since is None:  # cut off: no deadline of the state is judged either (see _isolated)
            self._settle_links(now)
            self._apply(self.state.on_tick(now), now)
            self._settle_slow(now)
        if self.beat_s and now >= self._next_beat:
            self._next_beat = now + self.beat_s
            self._beat()
        return self._take()

    def _beat(self) -> None:
        """One ``beat`` (a single message, encoded once) to every registered connection."""
        beat = {"type": "beat"}
        for link in self._links.values():
            if link.replica is not None:
                self._send(link, beat)

    def _isolated(self, now: float) -> bool:
        """Whether this coordinator is cut off rather than its members dead: every rank of at least two
        member replicas fell silent together (a partition around the coordinator's host, a switch that
        went down: it cannot tell which replicas failed, and fencing them all would end the job). Then
        nobody is judged, for at most ``isolation_hold_s`` (the members' own reconnect window: past it
        they save a checkpoint and stop by themselves); the first heartbeat that comes back ends it and
        gives every connection a fresh grace."""
        beating = [link for link in self._links.values() if not link.closed and link.replica is not None
                   and (slot := self._slots.get(link.replica)) is not None and slot.registered]
        # silent for half the timeout: a live member is heard every heartbeat interval, so a member that
        # died alone never finds every other one this silent, while those cut off with it fall silent
        # within a heartbeat of it (and must not be judged one by one as their timeouts come)
        silent = [link for link in beating if now - link.last_seen > self.heartbeat_timeout_s / 2]
        if len(silent) == len(beating) and len({link.replica for link in silent}) >= 2:
            since = max(link.last_seen for link in silent)
            if now - since <= self.heartbeat_timeout_s:
                return True  # not judged yet: nobody's silence is over the timeout
            if self._isolated_since is None:
                self._isolated_since = since
                self._log(Event.COORDINATOR_ISOLATED, replicas=sorted({link.replica for link in silent}),
                          silent_s=round(now - since, 3))
            if now - self._isolated_since <= self.isolation_hold_s:
                return True
            self._isolated_since = None  # held for long enough: the members gave up by now; judged as ever
            return False
        if self._isolated_since is not None:
            gap = max(0.0, now - self._isolated_since)
            self._isolated_since = None
            self._grace(gap, now)
            self._log(Event.COORDINATOR_REACHED, seconds=round(gap, 3))
        return False

    def _scan(self, now: float) -> None:
        """The timeouts: O(connections + ranks), so run on the ``scan_s`` clock."""
        if self._isolated(now):
            return
        for link in list(self._links.values()):
            if link.closed:
                continue  # fenced with a replica-mate earlier in this loop
            if link.replica is None:
                if not link.operator and now - link.opened > self.register_timeout_s:
                    self._refuse(link, "register_timeout", "no valid register message in time", None, True, now)
                continue
            slot = self._slots.get(link.replica)
            # a rank waiting for its replica's other ranks does not heartbeat yet
            if slot is not None and slot.registered and now - link.last_seen > self.heartbeat_timeout_s:
                self._fence(link, f"no heartbeat for {now - link.last_seen:.3f} s", "heartbeat_timeout", now)
        for replica, detail in self.liveness.hung(now):
            slot = self._slots.get(replica)
            if slot is not None:
                self._kill(slot, "hung", detail, now)
        if self.state.held_joiners and now >= self._next_reach:
            self._next_reach = now + REACH_EVERY_S
            self._ask_reach()

    def _ask_members(self, generation: int) -> None:
        """Reports of ``generation`` are held: every member asked whom it reaches now (a member stuck in a
        rendezvous that cannot connect reports nothing until its own timeout), so that the link rule has
        every member's links within the probe timeout, not the collective timeout."""
        self._asked[generation] = {}
        for r in self.state.current.members if self.state.current else ():
            slot = self._slots.get(r)
            if slot is None or slot.probe is None:
                continue
            peers = {str(b): self._slots[b].probe for b in self.state.current.members  # type: ignore[union-attr]
                     if b != r and b in self._slots and self._slots[b].probe is not None}
            self._asked[generation][r] = [int(b) for b in peers]
            for link in slot.conns:
                self._send(link, {"type": "reach", "peers": peers})

    def _reached(self, slot: Slot, reached: list[int], now: float) -> None:
        """A ``reach`` answered: for a member while reports of its generation are held, its links go to the
        link rule (whom it was asked about and did not reach); any pair it reached is a known cut no more."""
        g = self.state.generation
        asked = self._asked.get(g, {}).pop(slot.replica, None)
        if asked is not None and self.link_rule.holds(g) and not self.state.failing:
            self.link_rule.hold(g, slot.replica, None, sorted(set(asked) - set(reached)), now)
            self._settle_links(now)
        self._apply(self.state.on_reached(slot.replica, reached, now), now)

    def _ask_reach(self) -> None:
        """Each joiner held back by a known cut is asked to probe the replicas it was cut from
        (:mod:`recover.coord.links`): a pair it reaches again is cleared, and it joins at the next commit. One
        held back for a slow link is asked to time its links to the members (:mod:`recover.coord.graylinks`)."""
        for j in sorted(self.state.held_joiners):
            slot = self._slots.get(j)
            if slot is None or slot.probe is None:
                continue
            if self.state.slow.held(j):
                self._ask_rates(slot, self.state.current.members if self.state.current else ())
                continue
            peers = {str(b): self._slots[b].probe for b in self.state.cuts.blocked(j, set(self._slots))
                     if self._slots[b].probe is not None}
            if peers:
                for link in slot.conns:
                    self._send(link, {"type": "reach", "peers": peers})

    def _ask_rates(self, slot: Slot, peers: tuple[int, ...] | list[int]) -> None:
        """``slot`` is asked to time a round trip with each of ``peers``' probe listeners (a ``rate`` push)."""
        addresses = {str(b): self._slots[b].probe for b in peers
                     if b != slot.replica and b in self._slots and self._slots[b].probe is not None}
        if addresses:
            for link in slot.conns:
                self._send(link, {"type": "rate", "peers": addresses, "bytes": PROBE_BYTES})

    def _probe_rates(self, now: float) -> None:
        """The slow-link rule asks for a probe (:mod:`recover.coord.graylinks`): every member times its links to
        the others."""
        self.state.slow.started(now)
        members = self.state.current.members if self.state.current else ()
        for r in members:
            slot = self._slots.get(r)
            if slot is not None:
                self._ask_rates(slot, members)

    def _rates(self, slot: Slot, times: dict[str, Any], now: float) -> None:
        """A ``rates`` answer: to the state (a member's goes to the probe, a held joiner's may readmit it)."""
        got = {int(r): float(t) for r, t in times.items()
               if str(r).isdigit() and isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0}
        self._apply(self.state.on_rates(slot.replica, got, now), now)
        self._settle_slow(now)

    def _settle_slow(self, now: float) -> None:
        """The slow-link rule's verdict, once its probe is over: logged (``slow_link``), and the replica it names
        fenced with the cause ``slow_link``."""
        if self.state.slow.probing is None:
            return
        v = self.state.settle_slow(now)
        if v is None:
            return
        self._log(Event.SLOW_LINK, generation=self.state.generation, replica=v.replica, named=v.named, fenced=v.fenced,
                  step_s=round(v.step_s, 6), without_s=round(v.without_s, 6), ratio=round(v.ratio, 3),
                  factor=self.state.slow.factor, links={str(r): round(t, 6) for r, t in sorted(v.links.items())})
        r = v.replica
        slot = self._slots.get(r) if v.fenced and r is not None else None
        if slot is not None and r is not None:
            self._kill(slot, "slow_link", f"slow link: replica {r}'s link makes every step {v.step_s:.3f} s "
                                          f"against {v.without_s:.3f} s estimated without it ({v.ratio:.1f}x, above "
                                          f"{self.state.slow.factor:g}x; its probe {v.links[r]:.3f} s)", now)

    # ------------------------------------------------------------- requests

    def _authenticate(self, link: Link, msg: dict[str, Any], now: float) -> None:
        req = msg.get("id")
        if msg["type"] != "register" and msg["type"] not in OPERATOR_TYPES:
            self._refuse(link, "unauthenticated", "the first message must be register", req, True, now)
        elif not hmac.compare_digest(msg["token"].encode(), self._token):
            self._refuse(link, "unauthorized", "wrong token", req, True, now)
        elif msg["type"] == "register" and msg.get("release", RELEASE) != RELEASE:
            try:
                check_release(msg)
            except ProtocolError as exc:
                self._refuse(link, exc.code, exc.message, req, True, now)
        elif msg["type"] == "register":
            self._register(link, msg, now)
        else:
            self._operate(link, msg, now)

    def _operate(self, link: Link, msg: dict[str, Any], now: float) -> None:
        """An operator's ``status`` (answered at once), ``drain`` (answered at the commit it leaves at) or
        ``died``: the launcher saw a member's process die (:mod:`recover.deathwatch`), before its connection
        closes; the replica is dead as it would be then (cause ``process_died``). A PID no member registered
        with (a process already replaced, or another host's) changes nothing."""
        link.operator = True
        if msg["type"] == "died":
            slot = next((s for s in self._slots.values() if msg["pid"] in s.pids), None)
            if slot is not None:
                self._kill(slot, "process_died", "", now)
            self._send(link, {"type": "ok", "re": msg["id"]})
            return
        if msg["type"] == "status":
            activities = {r: self.liveness.activities(r) for r in self._slots}
            registering = [r for r, s in self._slots.items() if not s.registered]
            self._send(link, {"type": "job_status", "re": msg["id"],
                              "status": job_status(self.state, activities, registering, now)})
            return
        replica = msg["replica"]
        try:
            acts = self.state.request_drain(replica)
        except Refused as ref:
            self._refuse(link, ref.code, ref.message, msg["id"], False, now)
            return
        self._drains.setdefault(replica, []).append((link, msg["id"]))
        self._apply(acts, now)

    def _answer_drains(self) -> None:
        """Each drain whose replica left (or was lost, or the job stopped first) gets its answer."""
        for r, asked in list(self._drains.items()):
            done = self.state.drained.get(r)
            if done is None and r in self.state.draining:
                continue
            del self._drains[r]
            if done is not None:
                msg = {"type": "drained", "replica": r, "step": done[0], "generation": done[1]}
            else:
                why = "the job stopped first" if self.state.stop_requested else "it was lost before that commit"
                msg = {"type": "error", "code": "drain_failed", "message": f"replica {r} was not drained: {why}"}
            for link, cid in asked:
                self._send(link, {**msg, "re": cid})

    def _handle(self, link: Link, msg: dict[str, Any], now: float) -> None:
        assert link.replica is not None
        slot = self._slots.get(link.replica)
        if slot is None or slot.links.get(link.rank) is not link:
            return  # its replica is gone; the connection is being closed
        kind = msg["type"]
        try:
            ranks = slot.ranks_of(link, msg)
            if kind == "ack" and slot.registered:  # (the common case of a failure round first)
                self._ack(slot, ranks, msg["generation"], now)
                return
            if kind == "hb":
                if link.relay:
                    raise Refused("not_batched", "a relay connection heartbeats with hbs (one entry per rank)")
                if slot.registered:
                    self.liveness.heartbeat(slot.replica, link.rank, msg.get("progress"), msg.get("activity"), now,
                                            msg.get("generation"))
                return
            if kind == "hbs":
                if not link.relay:
                    raise Refused("not_relay", "hbs is for a connection registered with relay=true")
                if slot.registered:
                    self._beats(slot, link, msg, now)
                return
            if kind == "bye":
                self._drop(link, "left", now)
                return
            if kind == "register":
                raise Refused("already_registered", f"this connection is already {slot.who(link.rank)}")
            if kind in OPERATOR_TYPES:
                raise Refused("not_operator", f"{kind} comes on an operator's own connection, not a replica's")
            if not slot.registered:
                raise Refused("not_registered", f"replica {slot.replica} waits for its other ranks "
                                                f"({len(slot.links)} of {slot.ranks} registered)")
            if kind == "ack":
                self._ack(slot, ranks, msg["generation"], now)
            elif kind == "nonfinite":
                self._forward(slot, [(link, msg["id"])], False, now, lambda i: self.state.on_nonfinite(
                    slot.replica, i, msg["generation"], msg["step"], msg["ids"], now))
            elif kind == "reached":
                self._reached(slot, msg["reached"], now)
            elif kind == "rates":
                if msg.get("rank") in (None, 0):
                    self._rates(slot, msg["times"] or {}, now)
            elif kind == "report":
                if self._judged(msg) and not (msg.get("timeout") and self._fence_unreached(slot.replica, now)):
                    first = not self.link_rule.holds(msg["generation"])
                    self.link_rule.hold(msg["generation"], slot.replica, (link, msg), msg["suspects"], now)
                    if first:
                        self._ask_members(msg["generation"])
                    self._settle_links(now)
                    return
                self._forward(slot, [(link, msg["id"])], False, now, lambda i: self.state.on_report(
                    slot.replica, i, msg["generation"], msg["suspects"], now))
            else:
                self._vote(slot, link, ranks, msg, now)
        except Refused as ref:
            self._refuse(link, ref.code, ref.message, msg.get("id"), False, now)

    def _beats(self, slot: Slot, link: Link, msg: dict[str, Any], now: float) -> None:
        """A relay's batched heartbeat: each rank named in it is heard; the connection is as silent as
        its most silent rank."""
        try:
            ranks, progress, activity, generation = batch_lists(msg, slot.ranks)
        except ProtocolError as exc:
            raise Refused(exc.code, exc.message) from None
        if ranks is None or ranks == slot.order:  # every rank, in rank order (a relay's usual batch): at once
            slot.seen[:] = [now] * slot.ranks
            self.liveness.beats(slot.replica, progress, activity, now, generation)
            link.last_seen = now
            return
        # some ranks, in any order (a rank fell silent): one by one
        for k, p, a, g in zip(ranks, progress, activity, generation, strict=True):
            if 0 <= k < slot.ranks:
                slot.seen[k] = now
                self.liveness.heartbeat(slot.replica, k, p, a, now, g)
        link.last_seen = min(slot.seen)

    def _register(self, link: Link, msg: dict[str, Any], now: float) -> None:
        """Rank ``rank`` of replica ``r`` registers; the state hears of ``r`` once all its ranks did."""
        r, join, req, relay = msg["replica"], msg["join"], msg["id"], bool(msg.get("relay"))
        try:
            rank, ranks = check_register(msg, self._slots.get(r), self.state.is_live(r))
            resume = Resume.from_wire(msg["resume"]) if msg.get("resume") is not None else None
        except ProtocolError as exc:
            self._refuse(link, exc.code, f"replica {r}: {exc.message}", req, True, now)
            return
        except Refused as ref:
            self._refuse(link, ref.code, ref.message, req, True, now)
            return
        slot = self._slots.setdefault(r, Slot(r, ranks, join))
        asked = slot.member.register(None if relay else rank, ranks, join, (link, req))
        link.replica, link.rank, link.relay = r, rank, relay
        for k in range(ranks) if relay else (rank,):
            slot.links[k] = link
        slot.conns.append(link)
        if resume is not None:
            slot.resume[rank] = resume
        if rank == 0 and isinstance(msg.get("probe"), str):
            slot.probe = msg["probe"]
        if isinstance(msg.get("pid"), int):
            slot.pids.add(msg["pid"])
        if ranks > 1 and not relay:
            self._log(Event.RANK_REGISTER, replica=r, rank=rank, ranks=ranks, registered=len(slot.links))
        if asked is None:
            return
        for other in slot.links.values():
            other.last_seen = now  # the heartbeats start with the ok reply
        if relay:
            slot.seen = [now] * ranks
        self.liveness.start(r, ranks, now)
        held = replica_resume(slot.resume.values())
        self._forward(slot, asked, True, now, lambda i: self.state.on_register(r, join, i, now, held))

    def _forward(self, slot: Slot, asked: list[tuple[Link, int]], fatal: bool, now: float,
                 call: Callable[[int], list[Action]]) -> None:
        """Calls the state with a fresh request id whose reply goes to ``asked`` (each connection
        with its own id); a refusal goes to each of them (and closes them if ``fatal``)."""
        fid = next(self._ids)
        slot.routes[fid] = asked
        try:
            acts = call(fid)
        except Refused as ref:
            slot.routes.pop(fid, None)
            for link, cid in asked:
                self._refuse(link, ref.code, ref.message, cid, fatal, now)
            return
        slot.registered = True  # the state accepted a request of it: its ok and pushes go out now
        self._apply(acts, now)

    def _ack(self, slot: Slot, ranks: tuple[int, ...], generation: int, now: float) -> None:
        if slot.member.ack(ranks, generation):
            self._apply(self.state.on_ack(slot.replica, generation, now), now)

    def _vote(self, slot: Slot, link: Link, ranks: tuple[int, ...], msg: dict[str, Any], now: float) -> None:
        """Gathers the vote of ``ranks`` (:mod:`recover.coord.member`); the member's one vote to the state."""
        r, ballot = slot.replica, Ballot.from_wire(msg)
        if ballot.generation == self.state.generation:
            for k in ranks if len(ranks) < slot.ranks else (None,):
                self.liveness.voted(r, k, now)
        if not self.state.accepts_vote(r, ballot.generation, ballot.step):  # settled at once: this voice alone
            self._forward(slot, [(link, msg["id"])], False, now, lambda i: self.state.on_vote(r, i, ballot, now))
            return
        got = slot.member.vote(ranks, (link, msg["id"]), ballot)
        if isinstance(got, Disagreed):
            self._log(Event.RANK_VOTE_DISAGREEMENT, replica=r, generation=ballot.generation, ballots={
                str(k): {"generation": b.generation, "step": b.step, "ids": len(b.ids)}
                for k, (_, b) in got.held.items()})
            self._kill(slot, "rank_disagreement",
                       f"the ranks of replica {r} voted differently in generation {ballot.generation}", now)
        elif isinstance(got, Agreed):
            agreed = got.ballot
            self._forward(slot, got.asked, False, now, lambda i: self.state.on_vote(r, i, agreed, now))

    def _judged(self, msg: dict[str, Any]) -> bool:
        """Whether a ``report`` goes to the link rule: any of the current, healthy generation. A report without
        the timeout flag may be a peer's pair closed after that peer's own timeout (a partition elsewhere),
        and it may come first: judged with the others all the same. (A dead member is no delay: its closed
        connection starts the failure round, which hands the held reports back at once.)"""
        g = msg["generation"]
        return g == self.state.generation and not self.state.failing

    def _fence_unreached(self, reporter: int, now: float) -> bool:
        """A collective of the current generation ran out of time: the members that never reached it
        (computing, saving or evaluating, by their heartbeats) are fenced, so the next generation is never
        the same members again (a hung replica is found here too when the hang timeout is the longer one).
        Returns whether any was."""
        fenced = False
        for r, slot in list(self._slots.items()):
            if r != reporter and slot.registered and self.liveness.away(r):
                self._kill(slot, "unreached", f"it never reached the collective that replica {reporter} "
                                              "timed out in", now)
                fenced = True
        return fenced

    def _settle_links(self, now: float) -> None:
        """The link rule's verdicts (:mod:`recover.coord.links`): the broken pairs are remembered by the state,
        the replicas the rule names are fenced, then every held report goes to the state."""
        if not self.link_rule.holding:
            return
        current = self.state.current
        members = [m for m in (current.members if current else ()) if m in self._slots]
        for v in self.link_rule.settle(now, self.state.generation, not self.state.failing, members):
            if v.judged:
                self._log(Event.LINK_REPORT, generation=v.generation,
                          unreachable={str(r): u for r, u in sorted(v.unreachable.items())},
                          broken=[list(p) for p in v.broken], silent=list(v.silent), fenced=list(v.fenced))
                self.state.cuts.add(v.broken)
            for victim in v.fenced:
                slot = self._slots.get(victim)
                if slot is None:
                    continue
                peers = sorted(b if a == victim else a for a, b in v.broken if victim in (a, b))
                why = (f"it cannot connect to replicas {peers}" if peers else "it did not report its links")
                self._kill(slot, "link", f"{why} after generation {v.generation} failed with every member alive "
                                         "(the smallest set that leaves a fully connected group)", now)
            self._asked.pop(v.generation, None)
            for r, reports in v.reports.items():
                for held in reports:
                    if held is not None:
                        self._report(r, held[0], held[1], now)

    def _report(self, r: int, link: Link, msg: dict[str, Any], now: float) -> None:
        """A held report to the state, if its connection still speaks for replica ``r``."""
        slot = self._slots.get(r)
        if slot is not None and slot.links.get(link.rank) is link:
            self._forward(slot, [(link, msg["id"])], False, now,
                          lambda i: self.state.on_report(r, i, msg["generation"], msg["suspects"], now))

    # ---------------------------------------------------------- the state's actions

    def _apply(self, actions: list[Action], now: float) -> None:
        self._now = now
        for act in actions:
            if isinstance(act, Send):
                slot = self._slots.get(act.replica)
                if slot is not None and slot.registered:
                    self._deliver(slot, act.msg)
            elif isinstance(act, Fence):
                slot = self._slots.get(act.replica)
                if slot is not None:
                    self._kill(slot, "fenced", act.reason, now)
            elif isinstance(act, Log):
                self._out.append(act)
                if act.kind is Event.SLOW_LINK_PROBE:
                    self._probe_rates(now)

    def _deliver(self, slot: Slot, msg: dict[str, Any]) -> None:
        """A reply to the connection(s) whose request it answers (with their own ids); anything
        else to every rank of the replica."""
        re = msg.get("re")
        if msg["type"] == "committed":
            self.liveness.committed(msg["step"], self._now)
        elif msg["type"] == "membership" and msg["membership"] is not None:
            m = msg["membership"]
            self.liveness.formed(m["generation"], m["members"], self._now)
        if re is not None and re in slot.routes:
            extra = self._told() if msg["type"] == "ok" else {}
            for link, cid in slot.routes.pop(re):
                self._send(link, {**msg, "re": cid, **extra})
            return
        for link in slot.conns:  # once per connection (a relay carries them all)
            self._send(link, msg)
        if msg["type"] == "failing":  # the votes a replica's ranks are still collecting can't commit
            self._abort_votes(slot, msg["generation"] + 1, "generation is failing")
        elif msg["type"] == "membership" and msg["membership"] is not None:
            self._abort_votes(slot, msg["membership"]["generation"], "generation replaced")

    def _told(self) -> dict[str, float]:
        """What an ``ok`` reply to a ``register`` names: the heartbeat interval and the beat interval."""
        told = {"heartbeat_s": self.heartbeat_s, "beat_s": self.beat_s}
        return {k: v for k, v in told.items() if v}

    def _abort_votes(self, slot: Slot, below: int, reason: str) -> None:
        """Answers ``aborted`` to buffered rank votes for generations before ``below`` (once per request)."""
        for (link, cid), g in slot.member.abort_votes(below):
            self._send(link, {"type": "aborted", "re": cid, "generation": g, "reason": reason})

    # --------------------------------------------------------------- endings

    def _fence(self, link: Link, reason: str, cause: str, now: float) -> None:
        self._send(link, _fenced(reason))
        self._drop(link, cause, now, detail=reason)

    def _drop(self, link: Link, cause: str, now: float, detail: str = "") -> None:
        """Closes ``link``; if it belonged to a replica, that whole replica is dead (see ``_kill``)."""
        if link.closed:
            return
        self._close(link)
        slot = self._slots.get(link.replica) if link.replica is not None else None
        if slot is not None and slot.links.get(link.rank) is link:
            self._kill(slot, cause, detail, now, first=link)

    def _kill(self, slot: Slot, cause: str, detail: str, now: float, first: Link | None = None) -> None:
        """Replica ``slot`` is dead: fences every connection of it (but ``first``, already gone) and
        tells the state once (unless it never heard of the replica)."""
        r = slot.replica
        if self._slots.get(r) is not slot:
            return
        del self._slots[r]
        self.liveness.forget(r)
        why = (detail or cause) if first is None else \
            f"{slot.who(first.rank)} is gone ({cause}{': ' + detail if detail else ''})"
        for link in slot.conns:
            if link is not first and not link.closed:
                self._send(link, _fenced(why))
                self._close(link)
        if not slot.registered:
            self._log(Event.REGISTER_ABANDONED, replica=r, ranks=slot.ranks, registered=sorted(slot.links), cause=cause)
            return
        if detail:
            self._log(Event.FENCED, replica=r, reason=detail)
        self._apply(self.state.on_dead(r, cause, now), now)

    def _refuse(self, link: Link, code: str, message: str, re: Any, fatal: bool, now: float) -> None:
        self._log(Event.REFUSED, peer=link.peer, replica=link.replica, code=code, message=message, closed=fatal)
        self._send(link, {"type": "error", "re": re if isinstance(re, int) else None, "code": code,
                          "message": message, **({"release": RELEASE} if code.startswith("bad_") else {})})
        if fatal:
            self._drop(link, "refused", now)

    # ----------------------------------------------------------------- output

    def _send(self, link: Link, msg: dict[str, Any]) -> None:
        if not link.closed:
            self._out.append(SendTo(link.conn, msg))

    def _close(self, link: Link) -> None:
        link.closed = True
        self._links.pop(link.conn, None)
        self._out.append(Close(link.conn))

    def _log(self, kind: Event, **fields: Any) -> None:
        self._out.append(Log(kind, fields))

    def _take(self) -> list[Out]:
        if self._drains:
            self._answer_drains()
        out, self._out = self._out, []
        return out


def _fenced(reason: str) -> dict[str, Any]:
    return {"type": "error", "re": None, "code": "fenced", "message": reason}
