"""The real relay (recover.coord.relay) between P local ranks and a stand-in coordinator, on loopback sockets.

The test plays both sides with plain blocking sockets: the coordinator's end of the relay's upstream
connection and each rank's connection to the relay. One thread (the relay's) and no processes: ms.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from recover.coord.deadline import AckClock
from recover.coord.protocol import CLIENT_TYPES, PROTOCOL_VERSION, SERVER_TYPES, FrameDecoder, encode
from recover.coord.relay import Relay

V = PROTOCOL_VERSION

TOKEN = "t0ken"
P = 3
WAIT_S = 5.0


class Peer:
    """One end of a connection that sends frames and reads the next message, blocking up to WAIT_S."""

    def __init__(self, sock: socket.socket, allowed: frozenset[str]) -> None:
        sock.settimeout(WAIT_S)
        self.sock, self.decoder = sock, FrameDecoder(allowed)
        self.pending: list[Any] = []

    def send(self, **msg: Any) -> None:
        self.sock.sendall(encode(msg))

    def next(self) -> dict[str, Any]:
        while not self.pending:
            data = self.sock.recv(1 << 16)
            assert data, "the connection closed"
            self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def closed(self) -> bool:
        """True once the other end closed (after any messages still pending)."""
        try:
            return self.sock.recv(1 << 16) == b""
        except OSError:
            return True


@contextmanager
def relay_of(reconnect_s: float = 0.0, **ok: Any) -> Iterator[tuple[Relay, Peer, list[Peer]]]:
    """A relay for replica 5 of P ranks, its upstream end, and P registered ranks (ok'ed with ``ok``'s fields)."""
    server = socket.create_server(("127.0.0.1", 0))
    relay = Relay("127.0.0.1", server.getsockname()[1], TOKEN, 5, P, heartbeat_interval_s=60.0,
                  bind_host="127.0.0.1", reconnect_s=reconnect_s).start()
    up = Peer(server.accept()[0], CLIENT_TYPES)
    server.close()
    ranks = [Peer(socket.create_connection(relay.address), SERVER_TYPES) for _ in range(P)]
    try:
        for k in (2, 0, 1):
            ranks[k].send(type="register", id=100 + k, token=TOKEN, replica=5, join=False, rank=k, ranks=P)
        reg = up.next()
        assert {k: reg[k] for k in ("type", "replica", "ranks", "relay", "join")} == \
            {"type": "register", "replica": 5, "ranks": P, "relay": True, "join": False}
        up.send(type="ok", re=reg["id"], heartbeat_s=0.5, **ok)
        assert [r.next() for r in ranks] == [{"v": V, "type": "ok", "re": 100 + k, **ok} for k in range(P)]
        yield relay, up, ranks
    finally:
        relay.stop()
        for peer in (up, *ranks):
            peer.sock.close()


@pytest.fixture
def relayed() -> Iterator[tuple[Relay, Peer, list[Peer]]]:
    with relay_of() as parts:
        yield parts


def test_alike_votes_go_up_as_one_and_the_reply_reaches_every_rank_with_its_own_id(relayed: Any) -> None:
    _, up, ranks = relayed
    for k, (mb_s, fp) in enumerate([(0.25, "a"), (0.5, "b"), (0.125, "c")]):
        ranks[k].send(type="vote", id=10 + k, generation=1, step=3, ids=[2, 0, 1], mb_s=mb_s, fp=fp,
                      stop=k == 1)
    vote = up.next()
    assert {k: v for k, v in vote.items() if k not in ("v", "id")} == \
        {"type": "vote", "generation": 1, "step": 3, "ids": [0, 1, 2], "mb_s": 0.5, "stop": True, "fp": "a|b|c"}
    up.send(type="committed", re=vote["id"], generation=1, step=3, new_generation=None, speeds=None)
    assert [r.next()["re"] for r in ranks] == [10, 11, 12]


def test_ranks_that_vote_differently_go_up_one_by_one_with_their_rank(relayed: Any) -> None:
    _, up, ranks = relayed
    ranks[0].send(type="vote", id=10, generation=1, step=3, ids=[0, 1])
    ranks[2].send(type="vote", id=12, generation=1, step=3, ids=[0])
    first, second = up.next(), up.next()
    assert (first["rank"], first["ids"], second["rank"], second["ids"]) == (0, [0, 1], 2, [0])
    up.send(type="aborted", re=second["id"], generation=1, reason="x")
    assert ranks[2].next() == {"v": V, "type": "aborted", "re": 12, "generation": 1, "reason": "x"}


def settled(up: Peer, ranks: list[Peer]) -> None:
    """Waits until the relay has handled what ``ranks`` sent so far: each sends a report, which the
    relay forwards at once behind it."""
    for k, rank in enumerate(ranks):
        rank.send(type="report", id=90 + k, generation=1, suspects=[])
    assert [up.next()["type"] for _ in ranks] == ["report"] * len(ranks)


def test_an_ack_goes_up_once_every_rank_acked(relayed: Any) -> None:
    _, up, ranks = relayed
    up.send(type="failing", generation=1, dead=[3], reason="died")
    assert all(r.next()["type"] == "failing" for r in ranks)
    for k in range(P - 1):
        ranks[k].send(type="ack", generation=1)
    settled(up, ranks[:P - 1])  # no ack went up before them
    ranks[P - 1].send(type="ack", generation=1)
    assert up.next() == {"v": V, "type": "ack", "generation": 1}


def test_a_failing_push_answers_the_held_votes_aborted_here(relayed: Any) -> None:
    _, up, ranks = relayed
    ranks[1].send(type="vote", id=11, generation=1, step=3, ids=[0])
    ranks[0].send(type="vote", id=10, generation=1, step=3, ids=[0])
    settled(up, ranks[:2])
    up.send(type="failing", generation=1, dead=[3], reason="died")
    assert ranks[0].next()["type"] == "failing" and ranks[1].next()["type"] == "failing"
    assert [ranks[k].next() for k in (0, 1)] == [
        {"v": V, "type": "aborted", "re": 10 + k, "generation": 1, "reason": "generation is failing"} for k in (0, 1)]


def test_a_second_vote_of_a_rank_is_refused_to_that_rank(relayed: Any) -> None:
    _, _, ranks = relayed
    ranks[0].send(type="vote", id=10, generation=1, step=3, ids=[0])
    ranks[0].send(type="vote", id=11, generation=1, step=3, ids=[0])
    reply = ranks[0].next()
    assert (reply["type"], reply["re"], reply["code"]) == ("error", 11, "duplicate_vote")


def test_a_rank_that_closes_ends_the_relay_and_the_coordinator_sees_the_replica_gone(relayed: Any) -> None:
    relay, up, ranks = relayed
    ranks[1].sock.close()
    assert up.closed() and ranks[0].closed()
    relay.stop()
    assert relay.closed_why is not None and "rank 1" in relay.closed_why


def test_a_local_peer_of_another_replica_is_refused_and_ends_the_relay() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    relay = Relay("127.0.0.1", server.getsockname()[1], TOKEN, 5, P, bind_host="127.0.0.1").start()
    up = Peer(server.accept()[0], CLIENT_TYPES)
    rank = Peer(socket.create_connection(relay.address), SERVER_TYPES)
    try:
        rank.send(type="register", id=1, token=TOKEN, replica=6, join=False, rank=0, ranks=P)
        reply = rank.next()
        assert (reply["type"], reply["code"]) == ("error", "rank_mismatch")
        assert up.closed()
    finally:
        relay.stop()
        server.close()
        up.sock.close()
        rank.sock.close()


def test_a_beat_reaches_every_rank_and_the_ok_carries_beat_s() -> None:
    with relay_of(beat_s=30.0) as (_, up, ranks):
        up.send(type="beat")
        assert [r.next() for r in ranks] == [{"v": V, "type": "beat"}] * P


def test_a_relay_whose_coordinators_host_answers_nothing_tells_its_ranks_they_are_cut_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AckClock, "age", lambda self, now: 9.0)  # its heartbeats wait for an acknowledgement
    with relay_of(reconnect_s=30.0, beat_s=0.05) as (relay, _, ranks):
        t0 = time.monotonic()
        told = [r.next() for r in ranks]
        assert {(m["type"], m["code"]) for m in told} == {("error", "cut_off")} and "cut off" in told[0]["message"]
        assert 0.2 <= time.monotonic() - t0 < 1.5 and all(r.closed() for r in ranks)
        assert relay.closed_why == told[0]["message"]


def test_a_relay_whose_coordinator_is_silent_but_there_gives_up_after_the_reconnect_window() -> None:
    with relay_of(reconnect_s=0.6, beat_s=0.05) as (_, _, ranks):  # the stand-in reads nothing, answers nothing
        t0 = time.monotonic()
        told = [r.next() for r in ranks]
        assert {m["code"] for m in told} == {"coordinator_gone"} and "(paused?)" in told[0]["message"]
        assert 0.6 <= time.monotonic() - t0 < 2
