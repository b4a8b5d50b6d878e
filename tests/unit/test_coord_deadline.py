"""The read deadline of a worker's coordinator connection (recover.coord.deadline): the pure verdict, the
client acting on it against a stand-in coordinator on loopback that goes silent, and the replica's end
(recover.train.processes.session) for each verdict. Threads and sockets, no processes: well under a second each.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import DistNetworkError

from recover.config import load_config
from recover.coord import deadline
from recover.coord.client import CoordinatorClient
from recover.coord.deadline import (
    DEADLINE_BEATS,
    AckClock,
    Verdict,
    beat_interval,
    host_answered,
    judge,
    read_deadline,
)
from recover.coord.protocol import CLIENT_TYPES, FrameDecoder, Membership, encode
from recover.errors import CoordinatorLost
from recover.train.processes.exits import EXIT_COORDINATOR_LOST, EXIT_FENCED
from recover.train.processes.session import Session

BEAT_S = 0.05
DEADLINE_S = DEADLINE_BEATS * BEAT_S


# ---------------------------------------------------------------------------------------- the pure rule

@pytest.mark.parametrize("silent, answered, reconnect, verdict", [
    (0.2, 9.0, 30.0, Verdict.HEARD),     # within the deadline: nothing to decide, whatever the host does
    (0.4, 0.4, 30.0, Verdict.CUT_OFF),   # silent, and its host acknowledged nothing as long: the path is gone
    (0.4, 0.0, 30.0, Verdict.AWAY),      # silent while its host acknowledges: the process is paused
    (0.4, None, 30.0, Verdict.AWAY),     # unknown: never cut off on a guess
    (30.0, 0.1, 30.0, Verdict.GONE),     # paused beyond the reconnect window
    (30.0, 30.0, 30.0, Verdict.CUT_OFF),  # cut off, however long
    (0.4, 0.0, 0.0, Verdict.GONE),       # no reconnect window: silent past the deadline is gone
])
def test_a_silence_is_judged_by_whether_the_coordinators_host_still_answers(
        silent: float, answered: float | None, reconnect: float, verdict: Verdict) -> None:
    assert judge(silent, 0.3, answered, reconnect) is verdict


def test_the_deadline_is_six_beats_of_half_a_heartbeat_timeout_and_none_without_beats() -> None:
    assert beat_interval(1.0) == 0.5 and read_deadline(0.5) == 3.0
    assert read_deadline(None) is None and read_deadline(0.0) is None


def test_a_refused_connect_is_the_host_answering_a_timeout_or_no_route_is_not() -> None:
    assert host_answered(ConnectionRefusedError()) and host_answered(ConnectionResetError())
    assert not host_answered(TimeoutError()) and not host_answered(OSError(101, "Network is unreachable"))


def test_the_ack_clock_counts_while_written_data_waits_and_the_host_acknowledges_nothing_new(
        monkeypatch: pytest.MonkeyPatch) -> None:
    states = iter([(100, 5, 900), (100, 5, 900), (100, 6, 900), (100, 6, 900), (0, 6, 900), (100, 6, 900),
                   (100, 6, 0), (100, 6, None), (100, 6, None)])
    monkeypatch.setattr(deadline, "_tcp_state", lambda sock: next(states))
    clock = AckClock(socket.socket())
    ages = [clock.age(t) for t in (0.0, 1.0, 2.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.5)]
    # waits; new bytes acknowledged; waits; nothing waits; waits; zero window (paused); waits on
    assert ages == [0.0, 1.0, 0.0, 1.5, 0.0, 1.0, 0.0, 1.0, 2.5]
    clock.sock.close()


def test_the_ack_clock_reads_a_live_connection_and_a_zero_window_as_answered_and_knows_no_unix_socket() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(server.getsockname()) as c, server.accept()[0] as peer:
        clock = AckClock(c)
        c.sendall(b"x" * 100)
        assert peer.recv(100) and clock.age(0.0) == 0.0 and clock.age(5.0) == 0.0
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                c.send(b"x" * 65536)  # the peer reads nothing: its window closes, its host still answers
        time.sleep(0.2)
        clock.age(10.0)
        time.sleep(0.1)
        queued, _, window = deadline._tcp_state(c)
        if window is None:
            pytest.skip("this kernel's tcp_info has no tcpi_snd_wnd")
        assert queued > 0 and window == 0 and clock.age(12.0) == 0.0  # nothing moved for 2 s: the window says why
    server.close()
    a, b = socket.socketpair()
    with a, b:
        assert AckClock(a).age(0.0) is None


# ---------------------------------------------------------------------------------------- the client

class Stand:
    """A coordinator on loopback that registers one client (``ok`` naming ``beat_s``, then generation 1),
    then reads everything (its kernel acknowledges) and answers nothing; it beats while ``beating``, and
    pushes ``then`` after the registration."""

    def __init__(self, beating: bool = False, then: dict[str, Any] | None = None) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.beating, self.then = beating, then
        self.conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        self.conn, dec = conn, FrameDecoder(CLIENT_TYPES)
        conn.settimeout(BEAT_S)
        while True:
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                data = None
            except OSError:
                return
            if data == b"":
                return
            for msg in dec.feed(data or b""):
                if msg["type"] == "register":
                    m = Membership(1, (0,), "127.0.0.1", 1, 0)
                    conn.sendall(encode({"type": "ok", "re": msg["id"], "beat_s": BEAT_S}) +
                                 encode({"type": "membership", "membership": m.to_wire()}) +
                                 (encode(self.then) if self.then else b""))
            if self.beating:
                conn.sendall(encode({"type": "beat"}))

    def close(self) -> None:
        self.server.close()
        if self.conn is not None:
            self.conn.close()


@pytest.fixture
def stand() -> Iterator[Stand]:
    s = Stand()
    yield s
    s.close()


def test_a_coordinator_silent_beyond_the_reconnect_window_is_lost_not_a_timeout(stand: Stand) -> None:
    """Paused (its host acknowledges): a request outlives its own timeout (shorter than the read deadline
    here) while the coordinator is silent, and ends as CoordinatorLost with ``gone`` once it stayed
    silent for ``reconnect_s``."""
    c = CoordinatorClient("127.0.0.1", stand.port, "t", 0, reconnect_s=0.5)
    try:
        c.register(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorLost, match=r"silent for 0\.\d s \(paused\?\), more than 0.5 s"):
            c.vote_commit(1, 0, [0], timeout=0.1)
        assert 0.4 < time.monotonic() - t0 < 2 and c.gone and c.cut_off is None
    finally:
        c.close()


def test_a_coordinator_that_beats_is_never_judged_and_a_request_it_leaves_unanswered_times_out() -> None:
    stand = Stand(beating=True)
    c = CoordinatorClient("127.0.0.1", stand.port, "t", 0, reconnect_s=0.2)
    try:
        c.register(timeout=5)
        with pytest.raises(TimeoutError):
            c.vote_commit(1, 0, [0], timeout=0.5)  # beyond the read deadline and the reconnect window: heard
        assert c.lost is None and not c.gone
    finally:
        c.close()
        stand.close()


def test_a_replica_whose_coordinators_host_answers_nothing_is_cut_off_and_leaves_like_a_fenced_one(
        stand: Stand, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AckClock, "age", lambda self, now: 9.0)  # its heartbeats wait for an acknowledgement
    left: list[str] = []
    c = CoordinatorClient("127.0.0.1", stand.port, "t", 0, reconnect_s=30, fence_exit_s=0.1, on_fenced=left.append)
    try:
        c.register(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorLost, match="cut off from the coordinator .* host answered nothing for 9.0 s"):
            c.wait_for_generation(1, 5)
        assert DEADLINE_S <= time.monotonic() - t0 < DEADLINE_S + 1 and not c.gone
        time.sleep(0.3)
        assert left == [c.cut_off] and c.settle() == c.lost
    finally:
        c.close()


def test_a_rank_told_cut_off_by_its_relay_leaves_like_a_fenced_one() -> None:
    why = "replica 0 is cut off from the coordinator at 10.0.0.1:5: nothing heard from it for 3.0 s"
    stand = Stand(then={"type": "error", "re": None, "code": "cut_off", "message": why})
    left: list[str] = []
    c = CoordinatorClient("127.0.0.1", stand.port, "t", 0, reconnect_s=30, fence_exit_s=0.1, on_fenced=left.append)
    try:
        c.register(timeout=5)
        with pytest.raises(CoordinatorLost, match="cut off"):
            c.wait_for_generation(1, 5)
        time.sleep(0.3)
        assert c.cut_off == why and left == [why] and not c.gone
    finally:
        c.close()
        stand.close()


# ---------------------------------------------------------------------------------------- the replica's end

def session(tmp_path: Path, client: Any, me: int, members: tuple[int, ...]) -> Session:
    s = Session(load_config("debug"), tmp_path, me, "127.0.0.1", 1, "t")
    s.client = client
    s.step = SimpleNamespace(me=me, group=SimpleNamespace(members=members), progress=SimpleNamespace(step=7))
    return s


def lost_client(why: str, *, gone: bool = False, cut_off: str | None = None) -> Any:
    return SimpleNamespace(gone=gone, diverged=None, lost=why, settle=lambda: why, cut_off=cut_off)


def test_a_gone_coordinator_makes_the_lowest_member_save_and_every_replica_exit_7(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved: list[Any] = []
    exc = CoordinatorLost("the coordinator was silent for 70.1 s (paused?), more than 70 s")
    for me in (1, 2):
        s = session(tmp_path, lost_client(str(exc), gone=True), me, (1, 2))
        assert s.status(exc, lambda root, me=me: saved.append(me) or tmp_path / "ck") == EXIT_COORDINATOR_LOST
    assert saved == [1]
    assert capsys.readouterr().err.count("\n") == 1


def test_a_cut_off_replica_exits_fenced_with_one_line_also_on_a_network_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    why = "cut off from the coordinator at 10.0.0.1:5: nothing heard from it for 3.1 s"
    s = session(tmp_path, lost_client(why, cut_off=why), 1, (0, 1))
    assert s.status(DistNetworkError("Connection reset by peer"), lambda root: pytest.fail("no save")) == EXIT_FENCED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err and "DistNetworkError meanwhile" in err
    saved: list[Any] = []  # the lowest member keeps the committed state apart, in case every replica was cut off
    s = session(tmp_path, lost_client(why, cut_off=why), 0, (0, 1))
    assert s.status(CoordinatorLost(why), lambda root: saved.append(root) or root / "step_000007") == EXIT_FENCED
    assert saved == [tmp_path / "checkpoints" / "cut_off" / "replica_0"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Saved a complete checkpoint of step 7" in err and "--resume" in err


def test_a_network_error_while_the_coordinator_is_heard_is_not_hidden(tmp_path: Path) -> None:
    s = session(tmp_path, SimpleNamespace(gone=False, diverged=None, lost=None, settle=lambda: None), 0, (0, 1))
    assert s.status(DistNetworkError("Connection reset by peer"), None) is None
