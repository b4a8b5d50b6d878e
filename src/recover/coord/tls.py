"""Optional TLS with mutual authentication on the coordinator wire (``--tls-cert/--tls-key/--tls-ca``).

Contract: a :class:`Tls` names this process's certificate, its key and the job's CA. The coordinator
and a relay's local side serve with :meth:`Tls.server` (they present their certificate and require the
peer's, signed by the CA); a worker's client and a relay's upstream connect with :meth:`Tls.client`
(they present theirs and require the server's, signed by the CA). Host names are not checked: the CA is
the job's own, and holding a certificate it signed is what belonging means (the token is still
required on top). TLS 1.2 at least. Without a :class:`Tls` (``None`` everywhere) nothing changes: plain
TCP, as before.

Sockets: the selector loops (the coordinator, a relay) wrap accepted sockets with
:meth:`Tls.accept` (no handshake at once: it proceeds inside :class:`~recover.coord.conn.FramedConn`'s
reads and writes, so a peer that never completes it costs nothing but its connection, closed by the
registration timeout); a refused handshake ends that connection only. A worker's client, whose reader
thread and senders share one connection, uses :class:`SerialSocket`: OpenSSL must not be entered by
two threads at once on one connection, so every call on it is made under one lock, and the reader
waits for data outside it.
"""

from __future__ import annotations

import argparse
import select
import socket
import ssl
import threading
from dataclasses import dataclass

from recover.errors import ConfigError

WAIT_S = 0.05
"""Longest a :class:`SerialSocket` waits outside its lock before trying again."""


@dataclass(frozen=True)
class Tls:
    """This process's certificate and key (PEM files) and the CA (PEM) that signs every party's."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> Tls | None:
        """The three flags together, or None without any. Raises ConfigError (one line) for some but not
        all of them, or files that do not load."""
        given = [f for f in (cert, key, ca) if f]
        if not given:
            return None
        if len(given) != 3:
            raise ConfigError("--tls-cert, --tls-key and --tls-ca go together: give all three or none")
        tls = cls(str(cert), str(key), str(ca))
        try:
            tls.server()
            tls.client()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--tls-cert {cert} / --tls-key {key} / --tls-ca {ca} cannot be loaded: {exc}") from None
        return tls

    def flags(self) -> list[str]:
        """The command-line flags that give this to another process."""
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server(self) -> ssl.SSLContext:
        """The context of the side that accepts: requires a client certificate signed by the CA."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client(self) -> ssl.SSLContext:
        """The context of the side that connects: requires the server's certificate signed by the CA."""
        return self._context(ssl.Purpose.SERVER_AUTH)

    def accept(self, ctx: ssl.SSLContext, sock: socket.socket) -> ssl.SSLSocket:
        """An accepted socket wrapped for a selector loop (the handshake happens as it reads and writes)."""
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` on ``recover coordinator``, ``recover worker`` and ``recover launch``."""
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this process's certificate, signed by --tls-ca: the coordinator wire over TLS with mutual "
                        "authentication (with --tls-key and --tls-ca; default: plain TCP)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="the CA that signs every party's certificate")


class SerialSocket:
    """A connected TLS socket shared by a reader thread and senders (see the module docstring): the
    ``recv``, ``sendall``, ``getsockname``, ``shutdown``, ``close``, ``getsockopt`` and ``fileno`` a worker's
    client uses."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()

    def recv(self, n: int) -> bytes:
        """Blocks until bytes arrive (b"" at the end). Raises OSError once the connection failed or closed."""
        try:
            while True:
                with self._lock:
                    try:
                        return self._sock.recv(n)
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                        pending = self._sock.pending()
                if not pending:
                    select.select([self._sock], [], [], WAIT_S)
        except ValueError as exc:  # closed meanwhile (its descriptor is gone)
            raise OSError(f"connection closed: {exc}") from None

    def sendall(self, data: bytes | bytearray) -> None:
        """Blocks until every byte is sent. Raises OSError once the connection failed or closed."""
        view = memoryview(data)
        try:
            while view:
                with self._lock:
                    try:
                        view = view[self._sock.send(view):]
                        continue
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                        pass
                select.select([], [self._sock], [], WAIT_S)
        except ValueError as exc:
            raise OSError(f"connection closed: {exc}") from None

    def getsockname(self) -> tuple:
        return self._sock.getsockname()

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self._sock, how)  # the TCP connection, not a TLS close: no lock needed

    def close(self) -> None:
        self._sock.close()

    def getsockopt(self, *args: int) -> bytes | int:
        return self._sock.getsockopt(*args)  # TCP's own state (the read deadline's acknowledgements)

    def fileno(self) -> int:
        return self._sock.fileno()
