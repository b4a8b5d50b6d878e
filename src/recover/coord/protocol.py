"""Coordinator wire protocol: versioned, length-prefixed JSON frames. Never pickle.

Frame: ``b"RCVR"`` magic, a 4-byte big-endian body length, then a UTF-8 JSON object whose ``v``
is :data:`PROTOCOL_VERSION` and whose ``type`` names the message. Bodies above
:data:`MAX_FRAME_BYTES` are refused before they are read. Every message received is checked
against :data:`SCHEMAS` (field names and types, bools never pass as ints) before anyone acts on it.

Invariant: a byte stream either decodes into schema-valid messages or raises :class:`ProtocolError`
with a stable ``code`` (``bad_magic``, ``oversized``, ``malformed``, ``bad_version``,
``unknown_type``); after ``bad_magic`` or ``oversized`` the stream cannot be resynchronised and the
connection must be closed.

Messages (client -> coordinator): ``register`` (token, replica, join; optional ``rank`` of ``ranks``,
default 0 of 1, for a replica made of several processes; ``resume``, what a replica that lost its
coordinator holds: see :func:`resume_info`), ``hb`` (heartbeat, with the training
thread's progress, activity and newest generation), ``ack`` (of a ``failing`` notice), ``report`` (a
collective failed), ``nonfinite`` (microbatches whose loss or gradient was not finite on it), ``vote`` (commit vote,
a :class:`Ballot` built once by the voter and carried unchanged to the membership state,
with ``mb_s``, the seconds per microbatch the voter measured in the step, ``stop`` when its process
was asked to stop the job, ``leave`` when it was asked to leave it (a graceful leave), ``fp``, the
fingerprint of its parameters, ``audit``, that of the audited microbatch's gradient, and ``comp_s`` and
``comm_s``, its wall seconds of compute and of waiting in the reduction: the slow-link rule's measure,
:mod:`recover.coord.graylinks`), ``rates`` (the answer to ``rate``: ``times`` maps each peer to the seconds
of a round trip with it), ``bye``; from an
operator's short-lived connection that is no member (:mod:`recover.coord.operator`): ``status`` (the job
now, answered by ``job_status`` with its ``status`` object) and ``drain`` (replica ``replica`` leaves at
the next commit, answered by ``drained`` with the ``step`` it left at and the ``generation`` formed
without it), each carrying the token. Coordinator ->
client: ``ok`` / ``error`` / ``committed`` (with the ``speeds`` to plan the next step with, and
``stop``: every member stops after this step;
``left``: to a voter that asked to leave, the step is its last and it is no member of the next
generation) / ``aborted`` replies (``re`` names the request ``id``; an
``error`` of code ``diverged`` or ``nonfinite`` ends the job and ``sides`` maps each parameter
fingerprint to the replicas that hold it), and
the pushes ``failing`` (generation g is being replaced), ``membership`` (a new generation) and ``beat``
(nothing to tell: the coordinator is there; every ``beat_s`` named in the ``ok`` reply to a
``register``, so that a worker's read deadline tells a silence from a quiet stretch,
:mod:`recover.coord.deadline`) and ``reach`` (to a joiner held back by a known cut, :mod:`recover.coord.links`:
``peers`` maps replica ids to their probe addresses, which each ``register`` may name as ``probe``; the
joiner probes them and answers ``reached``, the ids it reached) and ``rate`` (the slow-link rule: time a
round trip of ``bytes`` each way with each of ``peers``' probe listeners; answered by ``rates``).

Replicas of several ranks: each rank (process) of a replica keeps its own connection and numbers
its own requests 1, 2, 3...; ``re`` always names the id *that connection* sent. Every rank of a
replica declares the same ``ranks`` and ``join``; :func:`register_ranks` checks ``0 <= rank < ranks``
(the coordinator refuses anything else with ``bad_rank``).

One connection per replica (a *relay*, :mod:`recover.coord.relay`): ``register`` with ``relay=true``
registers all ``ranks`` ranks of the replica on that one connection. On it, ``hbs`` (a batched
heartbeat: parallel lists ``ranks``, ``progress``, ``generation`` and an ``activity`` string of one
letter per rank, :data:`ACTIVITY_LETTERS`; without ``ranks`` it names every rank of the replica in
rank order, and a ``generation`` that is one int is every named rank's: the usual batch, which
:func:`batch_message` writes so and the coordinator reads a list at a time, wire protocol 2) replaces
``hb``; ``ack``, ``vote``, ``report`` and
``bye`` carry the ``rank`` they speak for, and without one they speak for every rank of the
replica (one ``ack`` once all ranks acked, one ``vote`` when all ranks cast the same ballot).
Pushes go once per connection. The ``ok`` reply to a ``register`` may name ``heartbeat_s``, the
interval the coordinator asks for (adapted to the job size, :mod:`recover.coord.scale`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from recover import __version__

PROTOCOL_VERSION = 2
"""2: an ``hbs`` may leave out ``ranks`` (every rank) and name one ``generation`` for all (1: lists)."""
RELEASE = __version__
"""This recover release: every ``register`` carries it (``release``), and the coordinator admits only its own."""
MAGIC = b"RCVR"
HEADER = struct.Struct(">4sI")
MAX_FRAME_BYTES = 1 << 20

# Fields each message type must carry (beyond ``v`` and ``type``), with their JSON types.
# A kind ending in "?" may be absent; "int?" and "dict?" may also be null, "int|absent?" may not.
_INT, _STR, _BOOL, _INTS, _OPT_INT, _OPT_DICT = "int", "str", "bool", "ints", "int?", "dict?"
_ABSENT_INT = "int|absent?"
_ABSENT_STR = "str|absent?"
_ABSENT_BOOL = "bool|absent?"
_ABSENT_NUM = "num|absent?"
_ABSENT_DICT = "dict|absent?"
_ABSENT_INTS = "ints|absent?"
_INT_OR_INTS = "int|ints"
MAX_RANKS = 1 << 16
SCHEMAS: dict[str, dict[str, str]] = {
    "register": {"id": _INT, "token": _STR, "replica": _INT, "join": _BOOL, "rank": _ABSENT_INT,
                 "ranks": _ABSENT_INT, "relay": _ABSENT_BOOL, "resume": _ABSENT_DICT, "release": _ABSENT_STR},
    "hb": {"progress": _ABSENT_INT, "activity": _ABSENT_STR, "generation": _ABSENT_INT},
    "hbs": {"ranks": _ABSENT_INTS, "progress": _INTS, "activity": _STR, "generation": _INT_OR_INTS},
    "ack": {"generation": _INT, "rank": _ABSENT_INT},
    "report": {"id": _INT, "generation": _INT, "suspects": _INTS, "timeout": _ABSENT_BOOL, "rank": _ABSENT_INT},
    "nonfinite": {"id": _INT, "generation": _INT, "step": _INT, "ids": _INTS, "rank": _ABSENT_INT},
    "vote": {"id": _INT, "generation": _INT, "step": _INT, "ids": _INTS, "mb_s": _ABSENT_NUM, "rank": _ABSENT_INT,
             "stop": _ABSENT_BOOL, "fp": _ABSENT_STR, "audit": _ABSENT_DICT, "leave": _ABSENT_BOOL,
             "comp_s": _ABSENT_NUM, "comm_s": _ABSENT_NUM},
    "bye": {"rank": _ABSENT_INT},
    "status": {"id": _INT, "token": _STR},
    "job_status": {"re": _INT, "status": _OPT_DICT},
    "drain": {"id": _INT, "token": _STR, "replica": _INT},
    "died": {"id": _INT, "token": _STR, "pid": _INT},
    "drained": {"re": _INT, "replica": _INT, "step": _INT, "generation": _INT},
    "ok": {"re": _INT, "heartbeat_s": _ABSENT_NUM, "beat_s": _ABSENT_NUM},
    "error": {"re": _OPT_INT, "code": _STR, "message": _STR, "sides": _ABSENT_DICT,
              "release": _ABSENT_STR},
    "committed": {"re": _INT, "generation": _INT, "step": _INT, "new_generation": _OPT_INT, "speeds": _OPT_DICT,
                  "stop": _ABSENT_BOOL, "left": _ABSENT_BOOL},
    "aborted": {"re": _INT, "generation": _INT, "reason": _STR},
    "failing": {"generation": _INT, "dead": _INTS, "reason": _STR},
    "membership": {"membership": _OPT_DICT},
    "beat": {},
    "reach": {"peers": _OPT_DICT},
    "reached": {"reached": _INTS, "rank": _ABSENT_INT},
    "rate": {"peers": _OPT_DICT, "bytes": _INT},
    "rates": {"times": _OPT_DICT, "rank": _ABSENT_INT},
}
CLIENT_TYPES = frozenset({"register", "hb", "hbs", "ack", "report", "nonfinite", "vote", "bye", "status", "drain",
                          "died", "reached", "rates"})
SERVER_TYPES = frozenset(SCHEMAS) - CLIENT_TYPES
OPERATOR_TYPES = frozenset({"status", "drain", "died"})
"""The requests of an operator's connection (no member): the first message may be one of these."""
ACTIVITY_LETTERS = {"c": "compute", "w": "wait", "i": "io"}
"""The one-letter activities of a batched heartbeat (``hbs``), by letter."""


class ProtocolError(Exception):
    """A message that breaks the protocol; ``code`` is stable and sent back in the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def fatal(self) -> bool:
        """True when the byte stream is out of sync and the connection must be closed."""
        return self.code in ("bad_magic", "oversized")


@dataclass(frozen=True)
class Membership:
    """One membership generation, decided by the coordinator alone.

    Attributes:
        generation: epoch number, >= 1; its process group rendezvouses on the store under
            :func:`rendezvous_prefix` (``gen{generation}``, lane k of replicas of several ranks
            ``gen{generation}/lane{k}``), every key and value sealed with ``secret``.
        members: live replica ids, sorted; a replica's rank is its index here.
        store_host, store_port: the coordinator's c10d TCPStore.
        step: the first step this generation runs (last committed step + 1).
        dead: replicas of the previous generation that are not in this one.
        joined: replicas admitted since the last commit (they need state from a peer); carried
            on to a generation formed by a failure before that commit.
        min_members: the quorum; fewer members than this means the job must stop.
        reason: why the generation was formed (``initial``, ``failure``, ``join``, ...).
        speeds: the planned seconds per microbatch of the last commit (None: the even split), so a
            joiner plans its first step as the members do (:mod:`recover.workload.speeds`).
        resync: formed by a restarted coordinator: the ``joined`` members are behind (they missed
            the last commit, or never had state) and take the state of the others before any step.
        restore: no member holds the training state (every replica that did was lost): each member
            loads the newest complete checkpoint instead, and the job goes on from its step (a
            checkpoint-restart of last resort inside the running job; ``step`` is then the step the
            coordinator had reached, and the first vote says where the checkpoint put the members).
        secret: random, chosen by the coordinator for this generation alone and told only to its
            members over their authenticated connections: it seals every store entry the generation's
            group uses (:mod:`recover.coord.sealing`), so nobody without the token can find, forge or
            alter them. Never printed nor logged (left out of ``repr``).
    """

    generation: int
    members: tuple[int, ...]
    store_host: str
    store_port: int
    step: int
    dead: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    min_members: int = 1
    reason: str = ""
    speeds: dict[int, float] | None = field(default=None, compare=False)
    resync: bool = False
    restore: bool = False
    secret: str = field(default="", repr=False, compare=False)

    def prefix(self, rank: int = 0, ranks: int = 1) -> str:
        """This generation's store prefix for rank ``rank`` of a replica of ``ranks`` (:func:`rendezvous_prefix`)."""
        return rendezvous_prefix(self.generation, rank, ranks)

    def rank_of(self, replica: int) -> int:
        """The rank of ``replica`` in this generation's process group."""
        return self.members.index(replica)

    @property
    def size(self) -> int:
        return len(self.members)

    def to_wire(self) -> dict[str, Any]:
        return {
            "generation": self.generation, "members": list(self.members), "store_host": self.store_host,
            "store_port": self.store_port, "step": self.step, "dead": list(self.dead),
            "joined": list(self.joined), "min_members": self.min_members, "reason": self.reason,
            "speeds": speeds_to_wire(self.speeds), "resync": self.resync, "restore": self.restore,
            "secret": self.secret,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Membership:
        spec = {"generation": _INT, "members": _INTS, "store_host": _STR, "store_port": _INT, "step": _INT,
                "dead": _INTS, "joined": _INTS, "min_members": _INT, "reason": _STR, "secret": _ABSENT_STR}
        _check_fields(d, spec, "membership")
        return cls(
            generation=d["generation"], members=tuple(sorted(d["members"])), store_host=d["store_host"],
            store_port=d["store_port"], step=d["step"], dead=tuple(sorted(d["dead"])),
            joined=tuple(sorted(d["joined"])), min_members=d["min_members"], reason=d["reason"],
            speeds=speeds_from_wire(d.get("speeds")), resync=d.get("resync") is True,
            restore=d.get("restore") is True, secret=d.get("secret", ""),
        )


def rendezvous_prefix(generation: int, rank: int = 0, ranks: int = 1) -> str:
    """The store prefix of generation ``generation``'s group for rank ``rank`` of a replica of ``ranks``
    processes: ``gen{g}`` for one, ``gen{g}/lane{rank}`` for several."""
    return f"gen{generation}" if ranks <= 1 else f"gen{generation}/lane{rank}"


@dataclass(frozen=True)
class Resume:
    """What a replica that lost its coordinator holds, sent in the ``resume`` field of its new
    ``register``: the newest generation it knows and its members, the last step it committed
    (-1: none) and the planned speeds of that commit. A restarted coordinator rebuilds the
    membership from these (:meth:`recover.coord.state.MembershipState.on_register`)."""

    generation: int
    members: tuple[int, ...]
    committed: int
    speeds: dict[int, float] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members), "committed": self.committed,
                "speeds": speeds_to_wire(self.speeds)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Resume:
        """Raises ProtocolError ``malformed``."""
        _check_fields(d, {"generation": _INT, "members": _INTS, "committed": _INT, "speeds": _OPT_DICT}, "resume")
        if d["generation"] < 1 or d["committed"] < -1:
            raise ProtocolError("malformed", f"resume needs generation >= 1 and committed >= -1, got {d}")
        return cls(d["generation"], tuple(sorted(d["members"])), d["committed"], speeds_from_wire(d.get("speeds")))


class Ballot(NamedTuple):
    """A commit vote: built once where the vote starts and carried unchanged to the state (immutable:
    a named tuple, cheap to build for every rank's vote).

    ``ids`` are sorted; ``mb_s``: seconds per microbatch measured in the step (None: none computed);
    ``stop``: the voter was asked to stop; ``fp``: the fingerprint of its parameters (a replica of
    several ranks: its lanes' joined by ``|`` in rank order); ``audit``: ``{id, fp, norm, exact}`` of
    the audited microbatch's gradient, when the voter computed it; ``leave``: the voter was asked to
    leave the job after this step (its process got SIGTERM: a graceful leave).
    """

    generation: int
    step: int
    ids: tuple[int, ...]
    mb_s: float | None = None
    stop: bool = False
    fp: str | None = None
    audit: Mapping[str, Any] | None = None
    leave: bool = False
    comp_s: float | None = None
    comm_s: float | None = None

    @classmethod
    def make(cls, generation: int, step: int, ids: Any, mb_s: float | None = None, stop: bool = False,
             fp: str | None = None, audit: Mapping[str, Any] | None = None, leave: bool = False,
             comp_s: float | None = None, comm_s: float | None = None) -> Ballot:
        """A ballot with ``ids`` sorted and ``mb_s`` kept only when it is a positive, finite time (``comp_s`` and
        ``comm_s`` likewise, ``comm_s`` also when 0)."""
        return cls(int(generation), int(step), tuple(sorted(map(int, ids))), _speed(mb_s), bool(stop), fp, audit,
                   bool(leave), _speed(comp_s), _seconds(comm_s))

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Ballot:
        """The ballot of a schema-valid ``vote`` message (its numbers are ints already)."""
        return cls(msg["generation"], msg["step"], tuple(sorted(msg["ids"])), _speed(msg.get("mb_s")),
                   msg.get("stop") is True, msg.get("fp"), msg.get("audit"), msg.get("leave") is True,
                   _speed(msg.get("comp_s")), _seconds(msg.get("comm_s")))

    def to_wire(self) -> dict[str, Any]:
        """The ``vote`` message of this ballot (without its request id)."""
        vote: dict[str, Any] = {"type": "vote", "generation": self.generation, "step": self.step,
                                "ids": list(self.ids)}
        if self.mb_s is not None:
            vote["mb_s"] = self.mb_s
        if self.stop:
            vote["stop"] = True
        if self.fp is not None:
            vote["fp"] = self.fp
        if self.audit is not None:
            vote["audit"] = dict(self.audit)
        if self.leave:
            vote["leave"] = True
        if self.comp_s is not None:
            vote["comp_s"] = self.comp_s
        if self.comm_s is not None:
            vote["comm_s"] = self.comm_s
        return vote

    @property
    def key(self) -> tuple[int, int, tuple[int, ...]]:
        """What the ranks of one replica must agree on: generation, step and ids."""
        return self.generation, self.step, self.ids

    @classmethod
    def of_ranks(cls, ballots: list[Ballot]) -> Ballot:
        """The one ballot of a replica from its ranks' alike ballots, in rank order: the slowest rank's
        seconds per microbatch, a stop (a leave) if any rank asked for one, the ranks' fingerprints joined in rank
        order (lane k is compared with lane k; None unless every rank sent one), and no audit (a
        replica of several ranks does not audit). One rank: its ballot."""
        first = ballots[0]
        if len(ballots) == 1:
            return first
        speeds = [b.mb_s for b in ballots if b.mb_s is not None]
        fps = [b.fp for b in ballots if b.fp is not None]
        comp = [b.comp_s for b in ballots if b.comp_s is not None]
        comm = [b.comm_s for b in ballots if b.comm_s is not None]
        return cls(first.generation, first.step, first.ids, max(speeds) if speeds else None,
                   any(b.stop for b in ballots), "|".join(fps) if len(fps) == len(ballots) else None, None,
                   any(b.leave for b in ballots), max(comp) if comp else None, max(comm) if comm else None)


def _speed(mb_s: float | None) -> float | None:
    """Seconds per microbatch kept only when a positive, finite time."""
    return float(mb_s) if mb_s is not None and math.isfinite(mb_s) and mb_s > 0 else None


def _seconds(s: float | None) -> float | None:
    """Seconds kept only when a finite time >= 0."""
    return float(s) if s is not None and math.isfinite(s) and s >= 0 else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, float) and math.isfinite(x)) or _is_int(x)


def speeds_to_wire(speeds: dict[int, float] | None) -> dict[str, float] | None:
    """Planned seconds per microbatch by replica, as a JSON object (keys are replica ids as strings)."""
    return None if speeds is None else {str(r): float(t) for r, t in sorted(speeds.items())}


def speeds_from_wire(d: Any) -> dict[int, float] | None:
    """Inverse of :func:`speeds_to_wire`. Raises ProtocolError ``malformed`` unless every key is a
    replica id and every value a positive finite number."""
    if d is None:
        return None
    try:
        out = {int(k): v for k, v in d.items()}
    except (AttributeError, ValueError):
        raise ProtocolError("malformed", f"speeds must map replica ids to seconds, got {d!r}") from None
    if not all(_is_num(t) and t > 0 for t in out.values()):
        raise ProtocolError("malformed", f"speeds must be positive finite seconds, got {d!r}")
    return {r: float(out[r]) for r in sorted(out)}


def _is_ints(val: Any) -> bool:
    """A list of ints (not bools): the element types gathered in C, for the 128-long lists of a relay's
    heartbeat that the coordinator checks a thousand times a second at 131k GPUs."""
    return isinstance(val, list) and not set(map(type, val)) - {int}


_CHECKS: dict[str, Any] = {
    _INT: _is_int,
    _STR: lambda v: isinstance(v, str),
    _BOOL: lambda v: isinstance(v, bool),
    _INTS: _is_ints,
    _OPT_INT: lambda v: v is None or _is_int(v),
    _ABSENT_INT: _is_int,
    _ABSENT_STR: lambda v: isinstance(v, str),
    _ABSENT_BOOL: lambda v: isinstance(v, bool),
    _ABSENT_NUM: _is_num,
    _ABSENT_DICT: lambda v: isinstance(v, dict),
    _ABSENT_INTS: _is_ints,
    _INT_OR_INTS: lambda v: _is_int(v) or _is_ints(v),
    _OPT_DICT: lambda v: v is None or isinstance(v, dict),
}
"""Each field kind's check (a kind of :data:`SCHEMAS`)."""


def _check_fields(msg: dict[str, Any], spec: dict[str, str], what: str) -> None:
    _check_compiled(msg, _compile(spec), what)


def _compile(spec: dict[str, str]) -> tuple[tuple[str, str, Any, bool], ...]:
    """``(name, kind, check, optional)`` of each field of ``spec``: what :func:`_check_compiled` walks."""
    return tuple((name, kind, _CHECKS[kind], kind.endswith("?")) for name, kind in spec.items())


def _check_compiled(msg: dict[str, Any], fields: tuple[tuple[str, str, Any, bool], ...], what: str) -> None:
    for name, kind, check, optional in fields:
        val = msg.get(name, _ABSENT)
        if val is _ABSENT:
            if optional:
                continue
            raise ProtocolError("malformed", f"{what} message lacks field {name!r}")
        if not check(val):
            raise ProtocolError("malformed", f"{what} field {name!r} must be {kind}, got {type(val).__name__}")


_ABSENT = object()
_COMPILED = {kind: _compile(spec) for kind, spec in SCHEMAS.items()}
"""Each message type's field checks, compiled once (:func:`validate` runs them on every message)."""


def _release(release: Any) -> str:
    return f"recover {release}" if isinstance(release, str) else "a recover release that names none"


def version_mismatch(wire: Any, release: Any) -> str:
    """The line refusing a peer of wire protocol ``wire`` and recover ``release`` (None: not sent)."""
    return (f"the peer speaks wire protocol {wire!r} ({_release(release)}), this side wire protocol "
            f"{PROTOCOL_VERSION} (recover {RELEASE}): run one recover release on every host")


def check_release(msg: dict[str, Any]) -> None:
    """Raises ProtocolError ``bad_release`` when a validated ``register`` names another release (one that names
    none predates the field: its wire protocol, checked on every frame, is all there is to check)."""
    if msg.get("release", RELEASE) != RELEASE:
        raise ProtocolError("bad_release", f"replica {msg['replica']} runs {_release(msg.get('release'))} (wire "
                            f"protocol {PROTOCOL_VERSION}), the coordinator recover {RELEASE} (wire protocol "
                            f"{PROTOCOL_VERSION}): run one recover release on every host")


def validate(msg: Any, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    """Checks a decoded body: a JSON object of a known version and type with well-typed fields."""
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "message body must be a JSON object")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", version_mismatch(msg.get("v"), msg.get("release")))
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMAS or (allowed is not None and kind not in allowed):
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}")
    _check_compiled(msg, _COMPILED[kind], kind)
    return msg


def register_ranks(msg: dict[str, Any]) -> tuple[int, int]:
    """``(rank, ranks)`` of a validated ``register`` message (defaults 0 and 1).

    Raises ProtocolError ``bad_rank`` unless ``1 <= ranks <= MAX_RANKS`` and ``0 <= rank < ranks``.
    """
    rank, ranks = msg.get("rank", 0), msg.get("ranks", 1)
    if not 1 <= ranks <= MAX_RANKS:
        raise ProtocolError("bad_rank", f"ranks (processes per replica) must be in 1..{MAX_RANKS}, got {ranks}")
    if not 0 <= rank < ranks:
        raise ProtocolError("bad_rank", f"rank must be in 0..{ranks - 1} for a replica of {ranks} ranks, got {rank}")
    return rank, ranks


def batch_message(ranks: list[int], progress: list[int], activity: str, generations: list[int],
                  every: int) -> dict[str, Any]:
    """The ``hbs`` of a replica of ``every`` ranks whose ranks ``ranks`` (sorted) reported ``progress``,
    ``activity`` (one letter each, :data:`ACTIVITY_LETTERS`) and ``generations``: without ``ranks`` when they
    are every rank, with one ``generation`` when all named ranks report the same (what a relay sends)."""
    msg: dict[str, Any] = {"type": "hbs"}
    if ranks != list(range(every)):
        msg["ranks"] = ranks
    msg["progress"], msg["activity"] = progress, activity
    same = bool(generations) and generations.count(generations[0]) == len(generations)
    msg["generation"] = generations[0] if same else generations
    return msg


def batch_beats(msg: dict[str, Any], every: int) -> list[tuple[int, int, str, int]]:
    """``(rank, progress, activity, generation)`` per rank of a validated ``hbs`` message of a replica of
    ``every`` ranks.

    Raises ProtocolError ``malformed`` as :func:`batch_lists` does.
    """
    ranks, progress, acts, gens = batch_lists(msg, every)
    return list(zip(range(every) if ranks is None else ranks, progress, acts, gens, strict=True))


def batch_lists(msg: dict[str, Any], every: int) -> tuple[list[int] | None, list[int], list[str], list[int]]:
    """``(ranks, progress, activities, generations)`` of a validated ``hbs`` message of a replica of ``every``
    ranks: its parallel lists as they are (``ranks`` None: every rank, in rank order; ``activities`` by name;
    ``generations`` one per entry), checked in C rather than per entry (at 131k GPUs a coordinator reads
    100,000 entries a second).

    Raises ProtocolError ``malformed`` unless the lists are equally long (as long as ``every`` without
    ``ranks``) and every activity letter is one of :data:`ACTIVITY_LETTERS`.
    """
    ranks, progress, activity, gens = msg.get("ranks"), msg["progress"], msg["activity"], msg["generation"]
    n = every if ranks is None else len(ranks)
    if isinstance(gens, int):
        gens = [gens] * n
    if not n == len(progress) == len(activity) == len(gens):
        named = f"ranks {n}" if ranks is not None else f"every rank ({n})"
        raise ProtocolError("malformed", f"hbs lists differ in length: {named}, progress {len(progress)}, "
                                         f"activity {len(activity)}, generation {len(gens)}")
    if not _LETTERS.issuperset(activity):
        bad = next(a for a in activity if a not in _LETTERS)
        raise ProtocolError("malformed", f"hbs activity letter {bad!r} is not one of {''.join(ACTIVITY_LETTERS)}")
    return ranks, progress, list(map(ACTIVITY_LETTERS.__getitem__, activity)), gens


_LETTERS = frozenset(ACTIVITY_LETTERS)


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""``json.dumps(..., separators=(",", ":"), allow_nan=False)`` made once, not at every frame."""


def encode(msg: dict[str, Any]) -> bytes:
    """One frame for ``msg`` (``v`` is added). Raises ProtocolError if the body is too large."""
    body = _ENCODER.encode({"v": PROTOCOL_VERSION, **msg}).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError("oversized", f"message of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(MAGIC, len(body)) + body


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
"""``json.loads(..., parse_constant=_reject_constant)`` made once, not at every frame."""


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, get complete messages in arrival order.

    A well-framed but invalid body comes back as a :class:`ProtocolError` item (the stream is still
    in sync, the caller refuses that message and carries on); a broken frame (``bad_magic``,
    ``oversized``) raises, and the caller must close the connection.
    """

    def __init__(self, allowed: frozenset[str] | None = None, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._allowed = allowed
        self._max = max_bytes

    def feed(self, data: bytes) -> list[dict[str, Any] | ProtocolError]:
        if self._buf:  # the rest of a frame begun earlier: decoded from one buffer
            self._buf += data
            data, self._buf = bytes(self._buf), bytearray()
        elif not isinstance(data, bytes):
            data = bytes(data)  # (frames are sliced out of it and decoded as bytes)
        out: list[dict[str, Any] | ProtocolError] = []
        pos, size = 0, len(data)
        while size - pos >= HEADER.size:
            magic, length = HEADER.unpack_from(data, pos)
            if magic != MAGIC:
                self._buf = bytearray(data[pos:])
                raise ProtocolError("bad_magic", "stream does not start with the RCVR frame magic")
            if length > self._max:
                self._buf = bytearray(data[pos:])
                raise ProtocolError("oversized", f"frame of {length} bytes exceeds {self._max}")
            end = pos + HEADER.size + length
            if end > size:
                break
            out.append(decode_body(data[pos + HEADER.size:end], self._allowed))
            pos = end
        if pos < size:
            self._buf = bytearray(data[pos:])
        return out


def decode_body(body: bytes, allowed: frozenset[str] | None = None) -> dict[str, Any] | ProtocolError:
    """A validated message, or the ProtocolError saying why the body is refused."""
    try:
        return validate(_loads(body.decode("utf-8")), allowed)
    except ProtocolError as exc:
        return exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return ProtocolError("malformed", f"body is not valid JSON ({exc})")


def _loads(text: str) -> Any:
    """``json.loads(text, parse_constant=_reject_constant)``; a body as :func:`encode` writes it (nothing around
    the object) in one call of the C scanner."""
    if text[:1].isspace() or text[-1:].isspace():
        return _DECODER.decode(text)
    msg, end = _DECODER.raw_decode(text)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return msg
