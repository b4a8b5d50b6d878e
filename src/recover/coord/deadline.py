"""The read deadline of a worker's coordinator connection: cut off, or a coordinator away?

Pure rules (no sockets, no clock) shared by the client (:mod:`recover.coord.client`) and a replica's
relay (:mod:`recover.coord.relay`), plus :class:`AckClock`, the one socket read they feed in.

Contract:
* The coordinator is never legitimately silent: it sends every registered connection a ``beat``
  every :func:`beat_interval` (half its heartbeat timeout) and names that interval as ``beat_s`` in
  its ``ok`` reply to a ``register``. A connection told no ``beat_s`` (an older coordinator) has no
  read deadline. The deadline is :data:`DEADLINE_BEATS` beats (three heartbeat timeouts: by then the
  coordinator has fenced a replica whose heartbeats stopped reaching it).
* :func:`judge` decides what a silence means, from how long the coordinator has been silent and how
  long ago its *host* last answered anything (a TCP acknowledgement of this side's heartbeats on the
  connection, :class:`AckClock`; a refused or accepted connect while reconnecting):

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

import array
import fcntl
import socket
import struct
import termios
from enum import Enum

DEADLINE_BEATS = 6
"""Beats missed before a silence is judged (three heartbeat timeouts)."""
_TCP_INFO_BYTES = 232
_BYTES_ACKED, _SND_WND = 120, 228
"""Offsets in Linux's ``struct tcp_info`` of ``tcpi_bytes_acked`` (u64, since 4.1) and ``tcpi_snd_wnd``
(the peer's advertised window, u32, newer kernels: absent from a shorter answer)."""


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


class AckClock:
    """How long data written to one TCP connection has waited for the peer's *host*: seconds since
    the host last acknowledged new data while some waits (a route that drops packets sends nothing
    at all), 0 while nothing waits or the host advertises a zero window (it answers; its process does
    not read: paused). Sampled at every beat, so that an age is never older than the samples. A
    segment the host merely retransmits does not count: it proves the path towards this side only.

    Args:
        sock: a connected TCP socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._acked: int | None = None
        self._since = 0.0

    def age(self, now: float) -> float | None:
        """The age at ``now`` (``time.monotonic()``); None where the platform does not tell."""
        state = _tcp_state(self.sock)
        if state is None:
            return None
        queued, acked, window = state
        if queued == 0 or window == 0 or acked != self._acked:
            self._acked, self._since = acked, now
        return now - self._since


def _tcp_state(sock: socket.socket) -> tuple[int, int, int | None] | None:
    """``(bytes not yet acknowledged, bytes acknowledged so far, the peer's window or None)``, or None."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        queued = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)  # SIOCOUTQ: written, not yet acknowledged
    except (AttributeError, OSError):
        return None
    if len(info) < _BYTES_ACKED + 8:
        return None
    window = struct.unpack_from("=I", info, _SND_WND)[0] if len(info) >= _SND_WND + 4 else None
    return queued[0], struct.unpack_from("=Q", info, _BYTES_ACKED)[0], window
