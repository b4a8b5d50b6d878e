"""The framed non-blocking connection (recover.coord.conn) on a local socket pair."""

from __future__ import annotations

import selectors
import socket
import threading

import pytest

from recover.coord.conn import FramedConn, connect_patiently
from recover.coord.protocol import CLIENT_TYPES, PROTOCOL_VERSION, ProtocolError, encode


def pair() -> tuple[FramedConn, socket.socket]:
    """A FramedConn and the plain socket at the other end of its loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        return FramedConn(server.accept()[0], CLIENT_TYPES), peer


def test_frames_arrive_whole_however_the_bytes_are_cut() -> None:
    conn, peer = pair()
    frame = encode({"type": "ack", "generation": 3})
    assert conn.receive() is None  # nothing yet
    peer.sendall(frame[:5])
    assert conn.receive() == []  # bytes, but no whole frame
    peer.sendall(frame[5:] + encode({"type": "bogus"}))
    got = conn.receive()
    assert got is not None and got[0] == {"v": PROTOCOL_VERSION, "type": "ack", "generation": 3}
    assert isinstance(got[1], ProtocolError) and got[1].code == "unknown_type"
    peer.close()
    with pytest.raises(EOFError):
        conn.receive()


def test_output_the_socket_does_not_take_waits_and_the_selector_watches_for_it() -> None:
    conn, peer = pair()
    sel = selectors.DefaultSelector()
    conn.register(sel)
    big = encode({"type": "ack", "generation": 1}) * 200_000
    assert conn.send(big) and conn.out  # the peer reads nothing: the rest waits
    assert sel.get_key(conn.sock).events == selectors.EVENT_READ | selectors.EVENT_WRITE
    peer.setblocking(False)
    got = 0
    while conn.out:
        try:
            got += len(peer.recv(1 << 20))
        except BlockingIOError:
            pass
        assert conn.flush()
    assert sel.get_key(conn.sock).events == selectors.EVENT_READ
    conn.sock.shutdown(socket.SHUT_WR)
    assert not conn.send(b"x") and not conn.out  # a failed write drops the output
    peer.close()
    conn.close()
    conn.close()  # idempotent
    sel.close()


def test_a_first_connection_waits_for_a_coordinator_that_is_still_starting() -> None:
    with socket.create_server(("127.0.0.1", 0)) as reserved:  # a port where nothing listens once closed
        address = reserved.getsockname()[:2]
    with pytest.raises(ConnectionRefusedError):
        connect_patiently(address, timeout_s=0.2)  # nobody comes: the refusal, once the time is up
    listening: list[socket.socket] = []
    timer = threading.Timer(0.3, lambda: listening.append(socket.create_server(address)))
    timer.start()
    try:
        with connect_patiently(address, timeout_s=10.0) as sock:
            assert sock.getpeername()[:2] == address
    finally:
        timer.join()
        for s in listening:
            s.close()
