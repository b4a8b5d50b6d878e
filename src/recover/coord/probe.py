"""Link probes: after a collective timed out, which peer replicas can this one exchange a byte with?

Contract: each replica process that takes part in a generation runs one :class:`LinkProbe` (owned by
its :class:`~recover.coord.client.CoordinatorClient`): a listener on the interface that reaches the
coordinator, published as ``host:port`` (:meth:`LinkProbe.address`), that answers one byte to a peer
that connects and sends its replica id; and :meth:`LinkProbe.unreachable`, which probes every peer's
listener in parallel and names those that did not answer within the timeout. The coordinator judges
the names these probes report (the link rule, :mod:`recover.coord.links`).

Fault injection: ``blocked(replica)`` (the injected broken links, :mod:`recover.faults`) makes the
link to that replica fail both ways: no probe goes out to it and its probes get no answer.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading
from collections.abc import Callable

PROBE_TIMEOUT_S = 2.0
"""How long a link probe waits for a peer's answer."""

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
            with conn:
                try:
                    conn.settimeout(PROBE_TIMEOUT_S)
                    data = conn.recv(4)
                    if len(data) == 4 and not self.blocked(struct.unpack(">i", data)[0]):
                        conn.sendall(b"!")
                except OSError:
                    pass
