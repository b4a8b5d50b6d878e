"""Replicas of several ranks: every rank (process) has its own coordinator connection; the
coordinator keeps membership per replica and aggregates registers, acks and votes of its ranks.

In-process coordinator, clients as threads (no torch workers), except the last test: real processes
whose lanes (rank k of every replica) all-reduce on independent groups.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from recover.coord import Coordinator, CoordinatorClient, CoordinatorLost, CoordinatorRefused
from recover.coord.protocol import CLIENT_TYPES, FrameDecoder, ProtocolError, encode, register_ranks, rendezvous_prefix
from recover.errors import PeerFailure
from recover.observe.events import read_jsonl

TOKEN = "r4nks"
HB_TIMEOUT_S = 3.0  # "quickly" below means well under this
QUICK_S = 1.0
IDS = list(range(8))


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(token=TOKEN, events_path=str(tmp_path / "events.jsonl"), expected_replicas=2,
                    heartbeat_interval_s=0.05, heartbeat_timeout_s=HB_TIMEOUT_S).start()
    try:
        yield c
    finally:
        c.stop()


class Bg:
    """A call on a daemon thread; ``result`` returns its value or the exception it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._out: Any = None
        self.t_end = 0.0

        def run() -> None:
            try:
                self._out = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self._out = exc
            self.t_end = time.monotonic()
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float = 20.0) -> Any:
        assert self._done.wait(timeout), "a client call hung"
        return self._out


def replica(c: Coordinator, rid: int, ranks: int = 2, **kw: Any) -> list[CoordinatorClient]:
    return [CoordinatorClient("127.0.0.1", c.port, TOKEN, rid, heartbeat_interval_s=0.05, rank=k, ranks=ranks, **kw)
            for k in range(ranks)]


def register_all(cs: list[CoordinatorClient], timeout: float = 10.0) -> list[Any]:
    calls = [Bg(lambda c=c: c.register(timeout=timeout)) for c in cs]
    return [b.result() for b in calls]


def vote_all(cs: list[CoordinatorClient], generation: int, step: int, ids: list[int] = IDS) -> list[Any]:
    calls = [Bg(lambda c=c: c.vote_commit(generation, step, ids, timeout=10)) for c in cs]
    return [b.result() for b in calls]


def crash(client: CoordinatorClient) -> None:
    """What a SIGKILL does to the connection: the peer sees EOF at once."""
    assert client._sock is not None
    client._closing = True
    client._sock.shutdown(socket.SHUT_RDWR)


def events(c: Coordinator, kind: str) -> list[dict[str, Any]]:
    assert c._events is not None
    return [e for e in read_jsonl(c._events.path) if e["kind"] == kind]


def close_all(*groups: list[CoordinatorClient]) -> None:
    for g in groups:
        for c in g:
            c.close()


def test_generation_forms_after_all_ranks_and_colliding_ids_are_routed(coord: Coordinator) -> None:
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        early = [Bg(lambda c=c: c.register(timeout=10)) for c in (*a, b[0])]
        snap = coord.wait_until(lambda s: s["live"] == [0] and s["registering"] == {1: [0]}, 10)
        assert snap["generation"] == 0  # replica 1 still lacks its rank 1
        time.sleep(0.2)
        assert not any(x.done() for x in early)
        late = b[1].register(timeout=10)
        ms = [x.result() for x in early] + [late]
        assert all(m.generation == 1 and m.members == (0, 1) for m in ms), ms
        assert [c.rank for c in (*a, *b)] == [0, 1, 0, 1] and all(c.ranks == 2 for c in (*a, *b))
        assert coord.snapshot()["registering"] == {}
        # every client numbered its register 1; now skew them so that the ids of one vote differ
        for _ in range(3):
            next(a[1]._ids)
        next(b[0]._ids)
        assert vote_all([*a, *b], 1, 0) == [None] * 4
        assert coord.snapshot()["committed_step"] == 0
        assert all(not c._replies for c in (*a, *b)), "a reply reached a rank that did not ask for it"
        regs = events(coord, "register")
        assert [r["replica"] for r in regs] == [0, 1]  # the state heard of each replica once
        assert [g["members"] for g in events(coord, "generation")] == [[0, 1]]
    finally:
        close_all(a, b)


def test_commit_needs_every_rank_of_every_member(coord: Coordinator) -> None:
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        register_all([*a, *b])
        first = [Bg(lambda c=c: c.vote_commit(1, 0, IDS, timeout=10)) for c in (*a, b[0])]
        time.sleep(0.5)
        assert not any(x.done() for x in first)
        assert coord.snapshot()["committed_step"] == -1
        assert b[1].vote_commit(1, 0, IDS, timeout=10) is None
        assert [x.result() for x in first] == [None] * 3
        assert coord.snapshot()["committed_step"] == 0 and coord.snapshot()["generation"] == 1
        assert len(events(coord, "commit")) == 1
    finally:
        close_all(a, b)


def test_one_rank_closing_fences_its_replica_at_once(coord: Coordinator) -> None:
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        register_all([*a, *b])
        waiting = Bg(lambda: b[0].wait_for_generation(1, 10))
        survivors = [Bg(lambda c=c: c.wait_for_generation(1, 10)) for c in a]
        time.sleep(0.1)
        t0 = time.monotonic()
        crash(b[1])
        lost = waiting.result()
        assert isinstance(lost, CoordinatorLost), lost
        assert "fenced" in str(lost) and "rank 1" in str(lost)
        assert waiting.t_end - t0 < QUICK_S, f"the peer rank learnt it {waiting.t_end - t0:.2f} s later"
        for m in (x.result() for x in survivors):
            assert m.generation == 2 and m.members == (0,) and m.dead == (1,), m
            assert max(x.t_end for x in survivors) - t0 < QUICK_S
        dead = events(coord, "failure_detected")
        assert [(e["replica"], e["cause"]) for e in dead] == [(1, "connection_closed")]  # exactly once
        assert coord.snapshot()["live"] == [0]
    finally:
        close_all(a, b)


def test_silent_rank_fences_its_whole_replica() -> None:
    c = Coordinator(token=TOKEN, expected_replicas=2, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.6).start()
    a, b = replica(c, 0), replica(c, 1)
    try:
        register_all([*a, *b])
        b[1]._stop.set()  # its heartbeats stop (a frozen process); its connection stays open
        waiting = Bg(lambda: b[0].wait_for_generation(1, 10))
        m = a[0].wait_for_generation(1, 10)
        assert m.members == (0,) and m.dead == (1,)
        lost = waiting.result()
        assert isinstance(lost, CoordinatorLost) and "heartbeat" in str(lost), lost
        assert a[1].wait_for_generation(1, 10) == m
    finally:
        close_all(a, b)
        c.stop()


def test_buffered_rank_vote_is_aborted_when_another_replica_dies(coord: Coordinator) -> None:
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        register_all([*a, *b])
        pending = Bg(lambda: a[0].vote_commit(1, 0, IDS, timeout=10))
        deadline = time.monotonic() + 10
        while True:  # a[0]'s vote waits for a[1]'s in the coordinator
            with coord._cond:
                if list(coord.aggregator.slots[0].member.held) == [0]:
                    break
            assert time.monotonic() < deadline, "the vote never reached the coordinator"
            time.sleep(0.01)
        assert not pending.done()
        crash(b[0])
        failure = pending.result()
        assert isinstance(failure, PeerFailure) and failure.generation == 1 and failure.dead == (1,), failure
        # a[1] never voted on generation 1; voting there now fails the same way
        late = Bg(lambda: a[1].vote_commit(1, 0, IDS, timeout=10)).result()
        assert isinstance(late, PeerFailure) and late.dead == (1,), late
        assert isinstance(Bg(lambda: b[1].wait_for_generation(1, 10)).result(), CoordinatorLost)
        # the same step commits on the next generation
        assert a[0].membership is not None and a[0].membership.generation == 2
        assert vote_all(a, 2, 0) == [None, None]
        assert coord.snapshot()["committed_step"] == 0
    finally:
        close_all(a, b)


def test_ranks_voting_differently_fence_their_replica(coord: Coordinator) -> None:
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        register_all([*a, *b])
        calls = [Bg(lambda: a[0].vote_commit(1, 0, IDS, timeout=10)),
                 Bg(lambda: a[1].vote_commit(1, 0, IDS[:-1], timeout=10))]
        calls += [Bg(lambda c=c: c.vote_commit(1, 0, IDS, timeout=10)) for c in b]
        out = [x.result() for x in calls]
        assert all(isinstance(o, CoordinatorLost) and "voted differently" in str(o) for o in out[:2]), out
        assert all(isinstance(o, PeerFailure) and o.dead == (0,) for o in out[2:]), out
        snap = coord.snapshot()
        assert snap["members"] == [1] and snap["committed_step"] == -1
        assert [e["replica"] for e in events(coord, "rank_vote_disagreement")] == [0]
        assert [(e["replica"], e["cause"]) for e in events(coord, "failure_detected")] == [(0, "rank_disagreement")]
        assert vote_all(b, 2, 0) == [None, None]  # the survivor carries on
    finally:
        close_all(a, b)


def test_bad_rank_declarations_are_refused(coord: Coordinator) -> None:
    def refused(client: CoordinatorClient, **kw: Any) -> str:
        try:
            client.register(timeout=5, **kw)
        except CoordinatorRefused as exc:
            return exc.code
        finally:
            client.close()
        raise AssertionError("registered")

    for rank, ranks in [(2, 2), (-1, 2), (0, 0), (1, 1)]:
        c = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 0, rank=rank, ranks=ranks)
        assert refused(c) == "bad_rank"
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        first = Bg(lambda: a[0].register(timeout=10))
        coord.wait_until(lambda s: s["registering"] == {0: [0]}, 10)
        assert refused(replica(coord, 0, ranks=3)[1]) == "rank_mismatch"
        assert refused(replica(coord, 0)[1], join=True) == "rank_mismatch"
        assert refused(replica(coord, 0)[0]) == "duplicate_rank"
        assert coord.snapshot()["registering"] == {0: [0]}  # the refusals left replica 0 waiting
        ms = register_all([a[1], *b]) + [first.result()]
        assert all(m.generation == 1 and m.members == (0, 1) for m in ms), ms
        assert refused(replica(coord, 1)[0]) == "duplicate_replica"
        assert refused(CoordinatorClient("127.0.0.1", coord.port, TOKEN, 1)) == "duplicate_replica"
        codes = [e["code"] for e in events(coord, "refused")]
        assert codes.count("bad_rank") == 4 and "rank_mismatch" in codes and "duplicate_rank" in codes
        assert vote_all([*a, *b], 1, 0) == [None] * 4  # nothing of that disturbed the service
    finally:
        close_all(a, b)


def test_register_fields_are_checked() -> None:
    def reg(**extra: Any) -> dict[str, Any]:
        return {"v": 1, "type": "register", "id": 1, "token": "t", "replica": 0, "join": False, **extra}

    assert register_ranks(reg()) == (0, 1)  # old clients: absent fields mean one rank
    assert register_ranks(reg(rank=3, ranks=4)) == (3, 4)
    with pytest.raises(ProtocolError, match="bad_rank"):
        register_ranks(reg(rank=4, ranks=4))
    dec = FrameDecoder(CLIENT_TYPES)
    for bad in (reg(rank=None), reg(ranks=True), reg(rank="1")):
        (item,) = dec.feed(encode({k: v for k, v in bad.items() if k != "v"}))
        assert isinstance(item, ProtocolError) and item.code == "malformed", item
    assert rendezvous_prefix(3) == "gen3" and rendezvous_prefix(3, 0, 1) == "gen3"
    assert rendezvous_prefix(3, 1, 2) == "gen3/lane1" and rendezvous_prefix(3, 0, 2) == "gen3/lane0"


def test_replica_dying_before_all_its_ranks_registered(coord: Coordinator) -> None:
    a = replica(coord, 0, ranks=3)
    b = replica(coord, 1, ranks=1)
    try:
        early = [Bg(lambda c=c: c.register(timeout=10)) for c in a[:2]]
        coord.wait_until(lambda s: s["registering"] == {0: [0, 1]}, 10)
        crash(a[0])
        lost = early[1].result()
        assert isinstance(lost, CoordinatorLost), lost
        snap = coord.wait_until(lambda s: s["registering"] == {}, 5)
        assert snap["live"] == [] and snap["generation"] == 0  # the state never heard of replica 0
        assert [e["replica"] for e in events(coord, "register_abandoned")] == [0]
        assert events(coord, "failure_detected") == []
        # it can come back whole; a replica of one rank registers with it as before
        a = replica(coord, 0, ranks=3)
        ms = register_all([*a, *b])
        assert all(m.generation == 1 and m.members == (0, 1) for m in ms), ms
        assert vote_all([*a, *b], 1, 0) == [None] * 4
        crash(b[0])  # the single-rank replica dies: the three ranks of replica 0 go on
        for c in a:
            m = c.wait_for_generation(1, 10)
            assert m.members == (0,) and m.dead == (1,)
    finally:
        close_all(a, b)


# ----------------------------------------------------------------- processes

LANE_WORKER = """
import json, os, sys
import torch
from recover.comm import FaultTolerantGroup
from recover.coord import CoordinatorClient
port, token, replica, rank = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = CoordinatorClient("127.0.0.1", port, token, replica, heartbeat_interval_s=0.1, rank=rank, ranks=2)
group = FaultTolerantGroup.create(client, client.register(timeout=60), backend="gloo", timeout_s=30)
x = torch.full((5,), float((replica + 1) * 10 ** rank))
out = group.allreduce([x])[0]
print(json.dumps({"replica": replica, "rank": rank, "sum": out.tolist(), "group_rank": group.rank,
                  "size": group.size, "generation": group.generation}), flush=True)
sys.stdin.readline()  # held until the test has every lane's result: a rank leaving fences its replica
os._exit(0)
"""


def test_lanes_are_independent_process_groups(tmp_path: Path) -> None:
    from _workers.harness import env

    c = Coordinator(token=TOKEN, expected_replicas=2, heartbeat_timeout_s=5.0).start()
    procs: list[subprocess.Popen[str]] = []
    lines: queue.Queue[str] = queue.Queue()
    try:
        for rid in (0, 1):
            for rank in (0, 1):
                p = subprocess.Popen([sys.executable, "-c", LANE_WORKER, str(c.port), TOKEN, str(rid), str(rank)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env(), start_new_session=True)
                procs.append(p)
                threading.Thread(target=lambda p=p: [lines.put(ln) for ln in p.stdout], daemon=True).start()
        results, junk = [], []
        deadline = time.monotonic() + 120
        while len(results) < 4:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"lanes did not all report: {results} {junk[-20:]}") from None
            if line.startswith("{"):
                results.append(json.loads(line))
            else:
                junk.append(line)
        for r in results:
            expected = 1 * 10 ** r["rank"] + 2 * 10 ** r["rank"]  # lane k sums (replica + 1) * 10**k
            assert r["sum"] == [float(expected)] * 5, r
            assert r["size"] == 2 and r["group_rank"] == r["replica"] and r["generation"] == 1, r
        assert sorted((r["replica"], r["rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        c.stop()


def test_one_rank_asked_to_leave_makes_its_whole_replica_leave_at_that_commit(coord: Coordinator) -> None:
    """A notice that reached one rank of a 2-rank replica (SIGTERM to one process): its vote carries the
    leave for the replica, so at that commit every rank of it is told it left, the other replica goes
    on alone in a generation formed without it, and the leavers' goodbyes are no failure."""
    a, b = replica(coord, 0), replica(coord, 1)
    try:
        register_all([*a, *b])
        b[1].leave_requested = True
        replies = vote_all([*a, *b], 1, 0)
        assert replies[2:] == [None, None] and [c.left for c in b] == [True, True]
        assert [(m.generation, m.members, m.step) for m in replies[:2]] == [(2, (0,), 1)] * 2
        assert not any(c.left for c in a)
        close_all(b)
        assert vote_all(a, 2, 1) == [None, None]  # the survivor commits its next step alone
        assert [(e["replicas"], e["step"]) for e in events(coord, "leave")] == [([1], 0)]
        assert not events(coord, "failure_detected") and coord.snapshot()["live"] == [0]
    finally:
        close_all(a, b)
