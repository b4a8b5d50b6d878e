"""Coordinator service + clients over real sockets on 127.0.0.1 (clients as threads: no torch workers)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recover.coord import Coordinator, CoordinatorClient, CoordinatorLost, CoordinatorRefused
from recover.coord.protocol import MAGIC, FrameDecoder, encode
from recover.errors import PeerFailure
from recover.faults import NONE, Perturbation, kind
from recover.observe.events import read_jsonl

TOKEN = "s3cret"


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(token=TOKEN, events_path=str(tmp_path / "events.jsonl"), expected_replicas=3,
                    heartbeat_interval_s=0.05, heartbeat_timeout_s=0.6).start()
    try:
        yield c
    finally:
        c.stop()


def clients(c: Coordinator, ids: list[int]) -> list[CoordinatorClient]:
    return [CoordinatorClient("127.0.0.1", c.port, TOKEN, r, heartbeat_interval_s=0.05) for r in ids]


def in_threads(fns: list[Any], timeout: float = 20.0) -> list[Any]:
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a client call hung"
    return out


def crash(client: CoordinatorClient) -> None:
    """What a SIGKILL does to the connection: the peer sees EOF at once."""
    assert client._sock is not None
    client._closing = True
    client._sock.shutdown(socket.SHUT_RDWR)


def events(c: Coordinator) -> list[dict[str, Any]]:
    assert c._events is not None
    return list(read_jsonl(c._events.path))


def raw_exchange(port: int, data: bytes) -> tuple[list[Any], bool]:
    """Sends raw bytes; returns the decoded replies and whether the coordinator closed the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    dec, replies, closed = FrameDecoder(), [], False
    s.settimeout(1.0)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            replies += dec.feed(chunk)
    except TimeoutError:
        pass
    s.close()
    return replies, closed


def test_membership_failure_round_and_events(coord: Coordinator) -> None:
    cs = clients(coord, [0, 1, 2])
    try:
        ms = in_threads([c.register for c in cs])
        assert all(m.generation == 1 and m.members == (0, 1, 2) for m in ms)
        assert not cs[0].failure_notice(1)
        crash(cs[2])
        new = in_threads([lambda c=c: c.wait_for_generation(1, 10) for c in cs[:2]])
        assert all(m.generation == 2 and m.members == (0, 1) and m.dead == (2,) for m in new)
        assert cs[0].failure_notice(1) and not cs[0].failure_notice(2)
        assert cs[0].dead_since(1) == (2,) and cs[0].notice_time(1) is not None
        gens = [e for e in events(coord) if e["kind"] == "generation"]
        assert [g["members"] for g in gens] == [[0, 1, 2], [0, 1]] and all("t" in g for g in gens)
        assert any(e["kind"] == "failure_detected" and e["cause"] == "connection_closed" for e in events(coord))
    finally:
        for c in cs:
            c.close()


def test_commit_vote_death_and_join(coord: Coordinator) -> None:
    cs = clients(coord, [0, 1, 2])
    try:
        in_threads([c.register for c in cs])
        ids = list(range(6))
        assert in_threads([lambda c=c: c.vote_commit(1, 0, ids) for c in cs]) == [None, None, None]
        # replica 2 dies while 0 and 1 wait in the vote of step 1: nobody commits
        out = in_threads([lambda: cs[0].vote_commit(1, 1, ids), lambda: cs[1].vote_commit(1, 1, ids),
                          lambda: (time.sleep(0.2), crash(cs[2]))])
        assert all(isinstance(o, PeerFailure) and o.dead == (2,) and o.generation == 1 for o in out[:2])
        assert coord.snapshot()["committed_step"] == 0
        # replica 2 comes back; it is admitted at the next commit (step 1 is voted again on generation 2)
        joiner = clients(coord, [2])[0]
        cs[2] = joiner
        out = in_threads([lambda: joiner.register(join=True),
                          lambda: (coord.wait_until(lambda s: 2 in s["pending_join"], 10),
                                   cs[0].vote_commit(2, 1, ids))[1],
                          lambda: (coord.wait_until(lambda s: 2 in s["pending_join"], 10),
                                   cs[1].vote_commit(2, 1, ids))[1]])
        assert all(m.generation == 3 and m.members == (0, 1, 2) and m.joined == (2,) and m.step == 2
                   for m in out), out
        assert coord.snapshot()["committed_step"] == 1
        # disagreeing votes: no commit, everyone gets PeerFailure with nobody dead and a new generation
        out = in_threads([lambda c=c, i=i: c.vote_commit(3, 2, ids[: 6 - (i == 1)]) for i, c in enumerate(cs)])
        assert all(isinstance(o, PeerFailure) and o.dead == () for o in out)
        assert coord.snapshot()["generation"] == 4 and coord.snapshot()["committed_step"] == 1
    finally:
        for c in cs:
            c.close()


def test_frozen_member_is_fenced_after_heartbeat_timeout(coord: Coordinator) -> None:
    cs = clients(coord, [0, 1])
    t0 = time.monotonic()  # before the frozen member's last word: its silence starts after this
    frozen = socket.create_connection(("127.0.0.1", coord.port))
    try:
        frozen.sendall(encode({"type": "register", "id": 1, "token": TOKEN, "replica": 2, "join": False}))
        ms = in_threads([c.register for c in cs])
        assert ms[0].members == (0, 1, 2)
        m = cs[0].wait_for_generation(1, 10)  # replica 2 never heartbeats
        assert m.members == (0, 1) and m.dead == (2,)
        assert 0.6 <= time.monotonic() - t0 < 5.0  # heartbeat_timeout_s = 0.6
        assert any(e["kind"] == "failure_detected" and e["cause"] == "heartbeat_timeout" for e in events(coord))
    finally:
        frozen.close()
        for c in cs:
            c.close()


def test_bad_peers_are_refused_logged_and_service_continues(coord: Coordinator) -> None:
    bad = clients(coord, [0])[0]
    bad._token = "wrong"
    with pytest.raises(CoordinatorRefused, match="unauthorized"):
        bad.register(timeout=5)
    bad.close()
    replies, closed = raw_exchange(coord.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert replies[0]["code"] == "bad_magic" and closed
    replies, closed = raw_exchange(coord.port, MAGIC + struct.pack(">I", 50 << 20))
    assert replies[0]["code"] == "oversized" and closed
    replies, closed = raw_exchange(coord.port, encode({"type": "hb"}))
    assert replies[0]["code"] == "unauthenticated" and closed

    cs = clients(coord, [0, 1, 2])
    try:
        in_threads([c.register for c in cs])
        # a registered member sending a malformed frame gets an error but stays registered
        cs[0]._send({"type": "vote", "id": 99, "generation": "one", "step": 0, "ids": []})
        with pytest.raises(CoordinatorRefused, match="stale_generation"):  # a vote for generation 0
            cs[1]._request({"type": "vote", "generation": 0, "step": 0, "ids": [1]})
        with pytest.raises(CoordinatorRefused, match="duplicate_replica"):
            dup = clients(coord, [2])[0]
            try:
                dup.register(timeout=5)
            finally:
                dup.close()
        # the service still works: everybody commits a step
        assert in_threads([lambda c=c: c.vote_commit(1, 0, [0, 1]) for c in cs]) == [None, None, None]
        assert coord.snapshot()["live"] == [0, 1, 2]
        codes = {e["code"] for e in events(coord) if e["kind"] == "refused"}
        assert {"unauthorized", "bad_magic", "oversized", "unauthenticated", "malformed",
                "stale_generation", "duplicate_replica"} <= codes
    finally:
        for c in cs:
            c.close()


def test_lost_coordinator_is_never_silent(tmp_path: Path) -> None:
    c = Coordinator(token=TOKEN, expected_replicas=1).start()
    client = clients(c, [0])[0]
    try:
        assert client.register(timeout=10).members == (0,)
        c.stop()
        with pytest.raises(CoordinatorLost):
            client.wait_for_generation(1, 10)
    finally:
        client.close()
        c.stop()


def cut(client: CoordinatorClient, peer: int) -> None:
    """An injected broken link from ``client``'s replica to ``peer``, struck at once (``--cut R@0:PEER``)."""
    client.perturb = Perturbation([kind("cut").parse(f"{client.replica_id}@0:{peer}")], client.replica_id)
    assert client.perturb.at_phase(0, "forward")


def test_link_probes_reach_a_listening_peer_and_not_a_cut_or_closed_one() -> None:
    """The direct probe a replica runs after a collective timed out (real sockets on loopback)."""
    a, b = CoordinatorClient("127.0.0.1", 1, "t", 0), CoordinatorClient("127.0.0.1", 1, "t", 1)
    try:
        addr = b.probe_address()
        assert a.unreachable({1: addr}, timeout_s=1.0) == []
        cut(b, 0)  # b refuses a: the link is cut on b's side
        assert a.unreachable({1: addr}, timeout_s=1.0) == [1]
        b.perturb = NONE
        cut(a, 1)
        assert a.unreachable({1: addr}, timeout_s=1.0) == [1]
        a.perturb = NONE
        with socket.socket() as s:  # nothing listens on a closed port
            s.bind(("127.0.0.1", 0))
            closed = f"127.0.0.1:{s.getsockname()[1]}"
        assert a.unreachable({1: addr, 2: closed}, timeout_s=1.0) == [2]
    finally:
        a.close()
        b.close()


def test_a_coordinator_bound_to_every_interface_tells_replicas_a_store_address_they_can_reach() -> None:
    """0.0.0.0 names no machine to connect to: the replicas are told --advertise-host (or this
    machine's name), and they rendezvous on the store there."""
    from recover.coord.server import advertised

    assert advertised("0.0.0.0") == advertised("::") == socket.gethostname()
    assert advertised("10.1.2.3") == "10.1.2.3" and advertised("0.0.0.0", "coord.svc") == "coord.svc"
    c = Coordinator("0.0.0.0", token=TOKEN, advertise_host="127.0.0.1", expected_replicas=1).start()
    cl = CoordinatorClient("127.0.0.1", c.port, TOKEN, 0, heartbeat_interval_s=0.05)
    try:
        m = cl.register(timeout=10)
        assert (m.store_host, m.store_port) == ("127.0.0.1", c.store_port)
    finally:
        cl.close()
        c.stop()


def reaches(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_store_binds_the_coordinators_host_unless_that_is_a_wildcard() -> None:
    """c10d alone binds every interface; 127.0.0.2 is this machine too, but not the address bound."""
    for host, elsewhere in (("127.0.0.1", False), ("0.0.0.0", True)):
        c = Coordinator(host, token=TOKEN, advertise_host="127.0.0.1", expected_replicas=1).start()
        try:
            assert reaches("127.0.0.1", c.store_port)
            assert reaches("127.0.0.2", c.store_port) is elsewhere, host
        finally:
            c.stop()


def test_an_operator_asks_the_status_and_drains_a_replica_without_being_a_member(coord: Coordinator) -> None:
    from recover.coord.operator import ask
    from recover.errors import RecoverError

    at = f"127.0.0.1:{coord.port}"
    cs = clients(coord, [0, 1, 2])
    try:
        in_threads([c.register for c in cs])
        with pytest.raises(RecoverError, match=r"refused \(unauthorized\): wrong token"):
            ask(at, "wrong", {"type": "status"})
        with pytest.raises(RecoverError, match=r"refused \(bad_replica\): replica 7 is unknown"):
            ask(at, TOKEN, {"type": "drain", "replica": 7})
        status = ask(at, TOKEN, {"type": "status"})["status"]
        assert (status["generation"], status["members"], status["committed_steps"]) == (1, [0, 1, 2], 0)
        assert [(r["replica"], r["state"]) for r in status["replicas"]] == [(0, "computing"), (1, "computing"),
                                                                           (2, "computing")]
        ids = list(range(6))
        out = in_threads([lambda: ask(at, TOKEN, {"type": "drain", "replica": 1}, timeout_s=15),
                          *(lambda c=c: (time.sleep(0.3), c.vote_commit(1, 0, ids))[1] for c in cs)])
        assert out[0]["type"] == "drained" and (out[0]["replica"], out[0]["step"], out[0]["generation"]) == (1, 0, 2)
        assert cs[1].left and not cs[0].left and coord.snapshot()["members"] == [0, 2]
        cs[1].close()  # its goodbye
        coord.wait_until(lambda s: 1 not in s["live"], 5)
        status = ask(at, TOKEN, {"type": "status"})["status"]
        assert {r["replica"]: r["state"] for r in status["replicas"]}[1] == "left" and status["faults"] == []
        kinds = [e["kind"] for e in events(coord)]
        assert "drained" in kinds and "failure_detected" not in kinds and kinds.count("register") == 3
    finally:
        for c in cs:
            c.close()


def test_recover_drain_prints_one_line_for_a_refusal(coord: Coordinator, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from recover.cli import main

    (tmp_path / "token").write_text(TOKEN)
    cs = clients(coord, [0, 1, 2])
    try:
        in_threads([c.register for c in cs])
        at = ["--coordinator", f"127.0.0.1:{coord.port}", "--token-file", str(tmp_path / "token")]
        assert main(["drain", "5", *at]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "refused (bad_replica): replica 5 is unknown" in err[0]
        assert main(["status", *at, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["members"] == [0, 1, 2]
    finally:
        for c in cs:
            c.close()


def test_a_broken_serving_loop_is_raised_by_serve_forever_and_logged_not_a_quiet_end(tmp_path: Path) -> None:
    """An unexpected exception in the coordinator's loop ends it loudly: serve_forever raises it (the command
    then prints its one internal-error line and fails), the event log names it, and it stops cleanly."""
    c = Coordinator(token=TOKEN, events_path=str(tmp_path / "events.jsonl"), expected_replicas=1,
                    heartbeat_interval_s=0.05, heartbeat_timeout_s=0.6).start()
    assert c.aggregator is not None

    def broken(now: float) -> list[Any]:
        raise KeyError("a bug in a rule")

    c.aggregator.on_tick = broken  # type: ignore[method-assign]
    with pytest.raises(KeyError, match="a bug in a rule"):
        c.serve_forever()
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert "coordinator_failed" in kinds and kinds[-1] == "coordinator_stop"
