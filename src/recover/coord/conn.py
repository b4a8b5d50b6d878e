"""One framed, non-blocking connection: bytes in decoded to messages, frames out buffered until sent.

Contract: a :class:`FramedConn` wraps a connected socket (made non-blocking, ``TCP_NODELAY``) that a
selector loop owns: the coordinator's server (:mod:`recover.coord.server`), a replica's relay
(:mod:`recover.coord.relay`) and the bench's simulated clients (:mod:`recover.bench.simclients`).
The loop calls :meth:`FramedConn.receive` when the socket is readable and :meth:`FramedConn.flush`
when it is writable; :meth:`FramedConn.send` queues a frame (:func:`recover.coord.protocol.encode`)
and writes what the socket takes at once.

Invariants:
  * Nothing blocks: what the socket does not take stays in :attr:`FramedConn.out`, and the selector
    watches for writability exactly while it is not empty (:meth:`FramedConn.watch`).
  * A failed write never raises: :meth:`FramedConn.flush` answers False and the caller decides
    (the server and the relay's local side drop the output, the relay's upstream side reconnects).
  * :meth:`FramedConn.receive` answers None when nothing is there yet and raises EOFError when the
    peer is gone (``error`` then holds a refused TLS handshake's error, if that ended it).
  * A TLS socket (:mod:`recover.coord.tls`) is read and written alike: a read or write that TLS cannot
    complete yet (its handshake, a partial record) counts as "nothing yet", and what TLS already
    decrypted is read at once (the selector cannot see it).

:func:`connect_patiently` is a replica's first connection to a coordinator that may still be starting
(the launcher starts it beside the workers, so its import of torch overlaps theirs): a refused
connection is tried again until the deadline; any other error is raised at once.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time
from typing import Any

from recover.coord.protocol import FrameDecoder, ProtocolError

RETRY_S = 0.05
"""Between two tries of a refused first connection."""


def connect_patiently(address: tuple[str, int], timeout_s: float) -> socket.socket:
    """A blocking connection to ``address``, refused connections tried again for up to ``timeout_s``.

    Raises:
        OSError: the last refusal once ``timeout_s`` has passed, or any other error at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
        except ConnectionRefusedError:
            if time.monotonic() + RETRY_S >= deadline:
                raise
            time.sleep(RETRY_S)


class FramedConn:
    """See the module docstring.

    Args:
        sock: a connected socket.
        allowed: the message types this peer may send (:data:`~recover.coord.protocol.CLIENT_TYPES`
            or :data:`~recover.coord.protocol.SERVER_TYPES`).
    """

    __slots__ = ("sock", "decoder", "out", "closed", "sel", "data", "_writing", "error", "_tls")

    def __init__(self, sock: socket.socket, allowed: frozenset[str] | None) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.decoder = FrameDecoder(allowed)
        self.out = bytearray()
        self.closed = False
        self.sel: selectors.BaseSelector | None = None
        self.data: Any = self
        self._writing = False  # the selector watches for writability
        self.error: ssl.SSLError | None = None  # the refused TLS handshake that ended it, if any
        self._tls = isinstance(sock, ssl.SSLSocket)

    def register(self, sel: selectors.BaseSelector, data: Any = None) -> FramedConn:
        """Watches the socket for reading with ``sel`` (``data``: what the selector hands back)."""
        self.sel, self.data = sel, self if data is None else data
        sel.register(self.sock, selectors.EVENT_READ, self.data)
        return self

    def receive(self) -> list[dict[str, Any] | ProtocolError] | None:
        """The messages (or refused frames) completed by what arrived; ``[]`` when bytes arrived but no
        whole frame, None when nothing did. Raises EOFError when the peer closed or the socket failed,
        ProtocolError when the stream is out of sync."""
        try:
            data = self.sock.recv(1 << 16)
            if self._tls:  # what TLS decrypted already is read now: the selector cannot see it
                tls = self.sock
                assert isinstance(tls, ssl.SSLSocket)
                while data and tls.pending():
                    data += tls.recv(tls.pending())
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except ssl.SSLError as exc:
            self.error, data = exc, b""
        except OSError:
            data = b""
        if not data:
            raise EOFError("the peer closed the connection")
        return self.decoder.feed(data)

    def send(self, frame: bytes) -> bool:
        """Queues ``frame`` and writes what the socket takes; False when the write failed."""
        if self.out or self._writing:
            self.out += frame
            return self.flush()
        try:  # nothing pending: one write from the frame itself, nothing copied unless the socket leaves some
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            sent = 0
        except OSError:
            return False
        if sent < len(frame):
            self.out += memoryview(frame)[sent:]
            self.watch()
        return True

    def flush(self) -> bool:
        """Writes the pending output the socket takes now; False (output dropped) when it failed."""
        try:
            while self.out:
                del self.out[:self.sock.send(self.out)]
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError:
            self.out.clear()
            return False
        self.watch()
        return True

    def watch(self) -> None:
        """The selector watches for writability exactly while output is pending."""
        writing = bool(self.out)
        if writing == self._writing or self.sel is None or self.closed:
            return
        try:
            self.sel.modify(self.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0), self.data)
            self._writing = writing
        except (KeyError, ValueError):
            pass

    def drain(self, timeout_s: float) -> None:
        """Best effort before closing: blocks up to ``timeout_s`` to send what is pending."""
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(timeout_s)
            if self.out:
                self.sock.sendall(self.out)
        except OSError:
            pass

    def close(self) -> None:
        """Stops watching and closes the socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.sel is not None:
            try:
                self.sel.unregister(self.sock)
            except (KeyError, ValueError):
                pass
        self.sock.close()
