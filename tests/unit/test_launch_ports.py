"""A launcher's held ports (:class:`recover.launch.processes.Ports`): nothing else binds one, the child it is for
binds and listens on it (as the coordinator's service and store do), and it stays held across the child's
restart until released."""

from __future__ import annotations

import socket

import pytest

from recover.launch.processes import Ports


def test_a_held_port_is_kept_from_others_and_free_for_its_child_again_and_again() -> None:
    ports = Ports("127.0.0.1")
    port = ports.take("coordinator")
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # another process's bind (an outgoing connection's is kept off too)
    for _ in range(2):  # the coordinator, then its restart on the same port
        with socket.create_server(("127.0.0.1", port)) as server, \
                socket.create_connection(("127.0.0.1", port), timeout=5):
            server.accept()[0].close()
    ports.release("coordinator")


def test_a_replaced_or_released_key_lets_its_port_go() -> None:
    ports = Ports("127.0.0.1")
    first = ports.take("replica_0")
    second = ports.take("replica_0")  # the replica started again: its old port goes
    with socket.socket() as other:
        other.bind(("127.0.0.1", first))
    ports.release("replica_0")
    with socket.socket() as other:
        other.bind(("127.0.0.1", second))
