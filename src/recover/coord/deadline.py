"""The read deadline of a worker's coordinator connection: cut off, or a coordinator away?

Pure rules (no sockets, no clock) shared by the client (:mod:`recover.coord.client`) and a replica's
relay (:mod:`recover.coord.relay`), plus :func:`ack_age_s`, the one socket read they feed in.

Contract:
* The coordinator is never legitimately silent: it sends every registered connection a ``beat``
  every :func:`beat_interval` (half its heartbeat timeout) and names that interval as ``beat_s`` in
  its ``ok`` reply to a ``register``. A connection told no ``beat_s`` (an older coordinator) has no
  read deadline. The deadline is :data:`DEADLINE_BEATS` beats (three heartbeat timeouts: by then the
  coordinator has fenced a replica whose heartbeats stopped reaching it).
* :func:`judge` decides what a silence means, from how long the coordinator has been silent and how
  long ago its *host* last answered anything (a TCP acknowledgement of this side's heartbeats on the
  connection, :func:`ack_age_s`; a refused or accepted connect while reconnecting):

  - silent less than the deadline: ``HEARD``, nothing to decide;
  - its host answered nothing for the deadline either: ``CUT_OFF``: the network path is gone, the
    coordinator has fenced this replica by now, so it leaves (one line, the fenced exit status);
  - its host answers (the process is paused, or died and a restarted one may come): ``AWAY`` within
    the reconnect window, ``GONE`` beyond it (the job saves a checkpoint and stops).

  The host's own acknowledgements, not a fresh connect, tell the two apart: a paused coordinator's
  listen backlog fills with probes at scale, and a dropped connect would read as a cut link.
  An unknown acknowledgement age (no ``TCP_INFO`` on this platform) never reads as cut off.
"""

from __future__ import annotations

import socket
import struct
from enum import Enum

DEADLINE_BEATS = 6
"""Beats missed before a silence is judged (three heartbeat timeouts)."""
_TCP_INFO_BYTES = 104
_UNACKED, _LAST_ACK_RECV = 24, 56
"""Offsets in Linux's ``struct tcp_info`` of ``tcpi_unacked`` (segments sent, not yet acknowledged) and
``tcpi_last_ack_recv`` (milliseconds since the peer last acknowledged)."""


class Verdict(Enum):
    """What a silence of the coordinator means (see the module docstring)."""

    HEARD = "heard"
    AWAY = "away"
    GONE = "gone"
    CUT_OFF = "cut_off"


def beat_interval(heartbeat_timeout_s: float) -> float:
    """How often the coordinator beats every registered connection."""
    return heartbeat_timeout_s / 2


def read_deadline(beat_s: float | None) -> float | None:
    """Seconds of silence before it is judged (None: the coordinator does not beat; no deadline)."""
    return None if not beat_s else DEADLINE_BEATS * beat_s


def judge(silent_s: float, deadline_s: float, answered_s: float | None, reconnect_s: float) -> Verdict:
    """What ``silent_s`` seconds without a byte from the coordinator mean, its host having last answered
    ``answered_s`` seconds ago (None: unknown) and the reconnect window being ``reconnect_s``."""
    if silent_s < deadline_s:
        return Verdict.HEARD
    if answered_s is not None and answered_s >= deadline_s:
        return Verdict.CUT_OFF
    if silent_s >= max(deadline_s, reconnect_s):
        return Verdict.GONE
    return Verdict.AWAY


def host_answered(exc: OSError) -> bool:
    """Whether a failed connect was answered by the coordinator's host (refused, reset: the process is
    not there), rather than lost on the way (timed out, no route, network down)."""
    return isinstance(exc, (ConnectionRefusedError, ConnectionResetError))


def ack_age_s(sock: socket.socket) -> float | None:
    """How long data sent on ``sock`` has waited for the peer's host: seconds since its last
    acknowledgement while some is unacknowledged, 0 when all is (None: unknown). The workers send
    heartbeats all the time, so a host that is there keeps this near 0."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (AttributeError, OSError):
        return None
    if len(info) < _LAST_ACK_RECV + 4:
        return None
    if struct.unpack_from("=I", info, _UNACKED)[0] == 0:
        return 0.0
    return struct.unpack_from("=I", info, _LAST_ACK_RECV)[0] / 1000
