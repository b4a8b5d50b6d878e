"""An operator's requests to a running coordinator: the job's ``status`` now, and ``drain`` of one replica.

Contract: an operator (``recover status --coordinator``, ``recover drain``; ``died`` from a launcher's death
watch, :func:`tell_died`) opens a short-lived
connection of its own, presents the job's token in each request and is never a member: it does not
register, heartbeat, vote nor count for liveness, and its connection closing is nobody's failure
(:mod:`recover.coord.ranks` answers it). :func:`ask` is that client: one request, its one reply.

:func:`job_status` (pure) is what the coordinator answers a ``status`` with, read from its membership
state and the heartbeats' activities: the generation, its members, the committed step and each
replica's state, the last of:

  ``computing``  a member whose training thread computes (or saves, evaluates: ``activity`` says which);
  ``waiting``    a member whose every rank is blocked for the others (a collective, a vote);
  ``draining``   a member an operator drains: it leaves at the next commit;
  ``joining``    registered (or registering its ranks), not yet admitted: it joins at the next commit;
  ``left``       said goodbye (drained, left on SIGTERM, trained to the end);
  ``lost``       declared dead (crashed, fenced, silent, hung) and not registered since;

with its speed: ``mb_s``, the median seconds per microbatch it measured in its last commits (None
until it has a few), and ``planned``, the relative time per microbatch the members agreed to plan with
(the median member is 1.0; None before any rebalance: the even split); and the last faults, each
``ago_s`` seconds old. The
coordinator holds no step records, so goodput is not part of it (``recover status RUN_DIR`` reads it
from the run directory). ``drain`` is answered ``drained`` once the replica left (the step it left at,
the generation formed without it), or ``error`` with one line: refused at once, or lost before that commit.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import Any

from recover.coord.protocol import SERVER_TYPES, FrameDecoder, ProtocolError, encode
from recover.coord.state import MembershipState
from recover.coord.tls import Tls
from recover.errors import RecoverError

ASK_TIMEOUT_S = 10.0
"""How long :func:`ask` waits for a ``status`` reply (a drain waits for its commit: the caller says)."""


def replica_state(replica: int, state: MembershipState, activities: tuple[str, ...], joining: bool) -> str:
    """The state of ``replica`` (see the module docstring); ``activities`` those of its ranks' last
    heartbeats, ``joining`` whether some of its ranks are registered while it is no member."""
    if state.current is not None and replica in state.current.members and state.is_live(replica):
        if replica in state.draining:
            return "draining"
        return "waiting" if activities and all(a == "wait" for a in activities) else "computing"
    if joining or state.is_live(replica):
        return "joining"
    return "left" if replica in state.left else "lost"


def job_status(state: MembershipState, activities: dict[int, tuple[str, ...]], registering: Iterable[int],
               now: float) -> dict[str, Any]:
    """The ``status`` reply (see the module docstring): ``activities`` maps each registered replica to its
    ranks' last activities, ``registering`` the replicas some ranks of which are in, ``now`` the clock the
    state's faults were stamped with."""
    members = list(state.current.members) if state.current is not None else []
    joining = set(registering)
    planned, measured = state.speeds.planned or {}, state.speeds.estimates()
    rows = []
    for r in sorted(set(members) | state.live | state.left | state.lost | joining):
        acts = activities.get(r, ())
        rows.append({"replica": r, "state": replica_state(r, state, acts, r in joining),
                     "activity": "/".join(sorted(set(acts))) or None, "mb_s": measured.get(r),
                     "planned": planned.get(r)})
    return {"generation": state.generation, "members": members, "committed_step": state.committed_step,
            "committed_steps": state.committed_step + 1, "failing": state.failing, "stopping": state.stop_requested,
            "max_replicas": state.max_replicas, "min_replicas": state.min_members, "replicas": rows,
            "faults": [{"kind": "failure_detected", "replica": f["replica"], "cause": f["cause"],
                        "generation": f["generation"], "step": f["step"], "ago_s": round(now - f["at"], 3)}
                       for f in state.faults],
            "goodput": None}


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (a bracketed IPv6 host too). Raises RecoverError (one line)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise RecoverError(f"--coordinator {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def ask(address: str, token: str, msg: dict[str, Any], tls: Tls | None = None,
        timeout_s: float = ASK_TIMEOUT_S, meanwhile: str = "") -> dict[str, Any]:
    """Sends one operator request (``msg`` without ``id`` and ``token``) to the coordinator at ``address``
    (``HOST:PORT``) and returns its reply; ``meanwhile`` ends the line of a reply that did not come in time
    (what stands all the same).

    Raises:
        RecoverError: unreachable, no reply within ``timeout_s``, or an ``error`` reply (its message).
    """
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    try:
        sock: Any = socket.create_connection((host, port), timeout=min(timeout_s, ASK_TIMEOUT_S))
    except OSError as exc:
        raise RecoverError(f"cannot reach the coordinator at {address}: {exc.strerror or exc}") from None
    try:
        if tls is not None:
            sock = tls.client().wrap_socket(sock, server_hostname=host)
        sock.sendall(encode({**msg, "id": 1, "token": token}))
        return _reply(sock, address, deadline, meanwhile)
    except (OSError, ProtocolError) as exc:
        raise RecoverError(f"the coordinator at {address} did not answer: {exc}") from None
    finally:
        sock.close()


def tell_died(address: str, token: str, pid: int, tls: Tls | None = None, timeout_s: float = 2.0) -> None:
    """Tells the coordinator at ``address`` that process ``pid`` died (:mod:`recover.deathwatch`): it fences the
    replica registered with that PID at once. Unreachable or not in time: nothing (the process's connection
    closing tells it all the same)."""
    try:
        ask(address, token, {"type": "died", "pid": pid}, tls, timeout_s=timeout_s)
    except (RecoverError, OSError):
        pass


def _reply(sock: Any, address: str, deadline: float, meanwhile: str) -> dict[str, Any]:
    """The first message on ``sock`` that answers request 1 (or an error for no request: a refusal)."""
    decoder = FrameDecoder(SERVER_TYPES)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RecoverError(f"no reply from the coordinator at {address} in time{meanwhile}")
        sock.settimeout(left)
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not data:
            raise RecoverError(f"the coordinator at {address} closed the connection without a reply")
        for item in decoder.feed(data):
            if isinstance(item, ProtocolError):
                raise item
            if item["type"] == "error" and item["re"] in (1, None):
                raise RecoverError(f"refused ({item['code']}): {item['message']}")
            if item.get("re") == 1:
                return item
