"""Link probes: after a collective timed out, which peer replicas can this one exchange a byte with?

Contract: each replica process that takes part in a generation runs one :class:`LinkProbe` (owned by
its :class:`~recover.coord.client.CoordinatorClient`): a listener on the interface that reaches the
coordinator, published as ``host:port`` (:meth:`LinkProbe.address`), that answers one byte to a peer
that connects and sends its replica id; and :meth:`LinkProbe.unreachable`, which probes every peer's
listener in parallel and names those that did not answer within the timeout. The coordinator judges
the names these probes report (the link rule, :mod:`recover.coord.links`).

Rate probes (the slow-link rule, :mod:`recover.coord.graylinks`): :meth:`LinkProbe.rates` times a round trip of
N bytes each way with every peer's listener in parallel (the peer id sent with :data:`RATE_FLAG` set, then N
as 4 bytes, then the N bytes; the listener echoes N bytes back once it has them all, in a thread of its own per
probe so that a slow peer holds up no other). A probe that fails or takes longer than its timeout counts as
the timeout.

Fault injection: ``blocked(replica)`` (the injected broken links, :mod:`recover.faults`) makes the
link to that replica fail both ways: no probe goes out to it and its probes get no answer.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Callable

PROBE_TIMEOUT_S = 2.0
"""How long a link probe waits for a peer's answer."""
RATE_FLAG = 1 << 30
"""Set in the id a prober sends: a rate probe (N bytes follow), not a reachability probe."""
MAX_RATE_BYTES = 16 << 20
"""The most bytes a listener echoes for one rate probe."""

LOCAL_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""A probe that fails with one of these could not even try (this process or host is out of descriptors or
memory): the peer is not named, so the fault stays this replica's own (:mod:`recover.coord.barren`)."""


class LinkProbe:
    """See the module docstring.

    Args:
        replica_id: this replica (sent to the peers it probes).
        blocked: whether the link to a replica is cut by fault injection.
    """

    def __init__(self, replica_id: int, blocked: Callable[[int], bool]) -> None:
        self.replica_id, self.blocked = replica_id, blocked
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def address(self, host: str) -> str:
        """``host:port`` of the listener, started on ``host`` on first use."""
        if self._sock is None:
            self._sock = socket.create_server((host, 0))
            self._thread = threading.Thread(target=self._answer, args=(self._sock,),
                                            name=f"recover-probe-listener-{self.replica_id}", daemon=True)
            self._thread.start()
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def unreachable(self, peers: dict[int, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
        """The replicas of ``peers`` (replica -> probe address) this one cannot exchange a byte with
        within ``timeout_s`` (probed in parallel)."""
        found: list[int] = []

        def probe(replica: int, address: str) -> None:
            host, _, port = address.rpartition(":")
            try:
                if self.blocked(replica):
                    raise OSError("link cut (fault injection)")
                with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
                    s.settimeout(timeout_s)
                    s.sendall(struct.pack(">i", self.replica_id))
                    if s.recv(1) != b"!":
                        raise OSError("no answer")
            except OSError as exc:
                if exc.errno not in LOCAL_ERRORS:  # out of descriptors or memory here says nothing of the link
                    found.append(replica)

        threads = [threading.Thread(target=probe, args=(r, a), daemon=True) for r, a in sorted(peers.items())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 1.0)
        return sorted(found)

    def rates(self, peers: dict[int, str], nbytes: int, timeout_s: float) -> dict[int, float]:
        """Seconds of a round trip of ``nbytes`` each way with each of ``peers`` (probed in parallel): a probe
        that fails, or does not end within ``timeout_s``, counts as ``timeout_s``."""
        times: dict[int, float] = {}
        payload = bytes(nbytes)

        def probe(replica: int, address: str) -> None:
            host, _, port = address.rpartition(":")
            t0 = time.perf_counter()
            took = timeout_s
            try:
                if self.blocked(replica):
                    raise OSError("link cut (fault injection)")
                with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
                    s.settimeout(timeout_s)
                    s.sendall(struct.pack(">ii", self.replica_id | RATE_FLAG, nbytes) + payload)
                    got = 0
                    while got < nbytes:
                        chunk = s.recv(min(1 << 16, nbytes - got))
                        if not chunk:
                            raise OSError("closed")
                        got += len(chunk)
                        if time.perf_counter() - t0 > timeout_s:
                            raise OSError("too slow")
                took = min(timeout_s, time.perf_counter() - t0)
            except OSError:
                pass
            times[replica] = took

        threads = [threading.Thread(target=probe, args=(r, a), daemon=True) for r, a in sorted(peers.items())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 1.0)
        return {r: times.get(r, timeout_s) for r in sorted(peers)}

    def close(self) -> None:
        """Stops the listener (its thread ends with the socket)."""
        if self._sock is None:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the listener's accept
        except OSError:
            pass
        self._sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _answer(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                conn.settimeout(PROBE_TIMEOUT_S)
                data = conn.recv(4)
                peer = struct.unpack(">i", data)[0] if len(data) == 4 else None
                if peer is not None and peer & RATE_FLAG:
                    threading.Thread(target=self._echo, args=(conn, peer & ~RATE_FLAG), daemon=True,
                                     name=f"recover-rate-probe-{self.replica_id}").start()
                    continue
                if peer is not None and not self.blocked(peer):
                    conn.sendall(b"!")
            except OSError:
                pass
            conn.close()

    def _echo(self, conn: socket.socket, peer: int) -> None:
        """A rate probe: reads the N bytes that follow and sends as many back (nothing to a blocked peer)."""
        with conn:
            try:
                conn.settimeout(RATE_TIMEOUT_S)
                head = _read(conn, 4)
                nbytes = struct.unpack(">i", head)[0] if head is not None else -1
                if not 0 <= nbytes <= MAX_RATE_BYTES or self.blocked(peer) or _read(conn, nbytes) is None:
                    return
                conn.sendall(bytes(nbytes))
            except OSError:
                pass


RATE_TIMEOUT_S = 30.0
"""How long a listener keeps a rate probe's connection (its prober gives up sooner)."""


def _read(conn: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes from ``conn``, or None if it closes first."""
    parts, got = [], 0
    while got < n:
        chunk = conn.recv(min(1 << 16, n - got))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
