"""recover.deathwatch with real processes: a child's death is seen while its sockets are still open (the
kernel releases a robust mutex before it tears the process's memory down); an exit the child chose, and
one before it held the watch, are not deaths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import subprocess_env
from recover import deathwatch

pytestmark = pytest.mark.skipif(not deathwatch.supported(), reason="needs Linux robust process-shared mutexes")

CHILD = """
import socket, sys, time
from recover import deathwatch
if sys.argv[2] != "never":
    deathwatch.hold()
ballast = bytearray(400 << 20)  # 400 MB touched: the kernel takes tens of ms to unmap it after a kill
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"r")
if sys.argv[2] == "release":
    deathwatch.release()
    sys.exit(0)
time.sleep(120)
"""


def start(port: int, mode: str) -> tuple[subprocess.Popen[bytes], deathwatch.Watch]:
    watch = deathwatch.Watch()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(port), mode], env={**subprocess_env(), **watch.env()},
                            pass_fds=(watch.fd,), start_new_session=True)
    watch.close_fd()
    return proc, watch


def test_a_killed_child_is_seen_dead_while_its_connection_is_still_open() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc, watch = start(server.getsockname()[1], "hold")
        try:
            conn, _ = server.accept()
            assert conn.recv(1) == b"r"
            seen: list[bool] = []  # per call: whether the child's connection was still open then
            called = threading.Event()

            def on_death() -> None:
                try:
                    still_open = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
                except BlockingIOError:
                    still_open = True
                seen.append(still_open)
                called.set()

            watch.start(lambda: proc.poll() is None, on_death)
            time.sleep(0.3)  # the watcher blocks on the mutex the child holds
            assert not called.is_set()
            os.kill(proc.pid, signal.SIGKILL)
            assert called.wait(10), "the death was not seen"
            assert conn.recv(1) == b""  # then the connection closes
            assert seen == [True]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    time.sleep(0.1)
    assert seen == [True]  # once


@pytest.mark.parametrize("mode", ["release", "never"])
def test_an_exit_of_its_own_or_before_holding_the_watch_is_no_death(mode: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc, watch = start(server.getsockname()[1], mode)
        called: list[int] = []
        watch.start(lambda: proc.poll() is None, lambda: called.append(1))
        try:
            conn, _ = server.accept()
            assert conn.recv(1) == b"r"
            if mode == "never":
                os.kill(proc.pid, signal.SIGKILL)  # it never held the watch
            assert proc.wait(30) == (0 if mode == "release" else -signal.SIGKILL)
            time.sleep(0.3)
            assert called == []
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
