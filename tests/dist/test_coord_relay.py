"""One coordinator connection per replica, for real: each rank is its own process, rank 0 runs the
replica's relay, and the coordinator sees one connection per replica (recover.coord.relay).

Replicas 0 and 1 of 2 ranks each; then a rank is SIGKILLed (replica 1 rank 1) or frozen with
SIGSTOP (replica 0 rank 1, whose relay is alive and well): either way its replica is fenced and the
other replica's ranks all learn the next generation. Every process is started here and killed by PID.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recover.coord import Coordinator
from recover.observe.events import read_jsonl

TOKEN = "r3lay"
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "_workers" / "relay_rank.py"
WAIT_S = 20.0


class Rank:
    """A rank process and the JSON lines it prints, read on a thread."""

    def __init__(self, *args: Any) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self) -> dict[str, Any]:
        return self.lines.get(timeout=WAIT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # also ends a SIGSTOPped process
        self.proc.wait(10)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Coordinator, dict[tuple[int, int], Rank]]]:
    coord = Coordinator(token=TOKEN, events_path=str(tmp_path / "events.jsonl"), expected_replicas=2,
                        heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, ranks_per_replica=2,
                        per_replica_connections=True).start()
    ranks: dict[tuple[int, int], Rank] = {}
    seen = coord.aggregator.on_message
    coord.votes = []  # type: ignore[attr-defined] - the vote messages the coordinator got

    def counting(conn: Any, msg: dict[str, Any], now: float) -> Any:
        if msg["type"] == "vote":
            coord.votes.append(msg)  # type: ignore[attr-defined]
        return seen(conn, msg, now)

    coord.aggregator.on_message = counting  # type: ignore[method-assign]
    try:
        for r in (0, 1):
            ranks[r, 0] = Rank(coord.port, TOKEN, r, 0, 2)
            relay_port = ranks[r, 0].next()["relay_port"]
            ranks[r, 1] = Rank(coord.port, TOKEN, r, 1, 2, relay_port)
        for rank in ranks.values():
            assert rank.next() == {"generation": 1, "members": [0, 1]}
        for rank in ranks.values():
            assert rank.next()["committed"] is True
        # every rank voted; each relay sent one vote for its replica, with its slower rank's speed
        assert sorted((v.get("rank"), v["mb_s"]) for v in coord.votes) == [(None, 0.2), (None, 0.2)]  # type: ignore[attr-defined]
        yield coord, ranks
    finally:
        for rank in ranks.values():
            rank.kill()
        coord.stop()


def test_one_connection_per_replica_and_a_killed_rank_fences_its_replica(job, tmp_path: Path) -> None:
    coord, ranks = job
    assert len(coord._conns) == 2  # 4 ranks, 2 connections
    ranks[1, 1].kill()
    assert ranks[0, 0].next() == {"generation": 2, "members": [0]}
    assert ranks[0, 1].next() == {"generation": 2, "members": [0]}
    assert "lost" in ranks[1, 0].next()  # its relay closed: the replica's other rank is told
    detected = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "failure_detected"]
    assert [(e["replica"], e["cause"]) for e in detected] == [(1, "connection_closed")]


def test_a_frozen_rank_behind_a_live_relay_fences_its_replica(job, tmp_path: Path) -> None:
    coord, ranks = job
    os.kill(ranks[0, 1].proc.pid, signal.SIGSTOP)  # its relay (in rank 0) goes on batching the others
    assert ranks[1, 0].next() == {"generation": 2, "members": [1]}
    assert ranks[1, 1].next() == {"generation": 2, "members": [1]}
    assert "lost" in ranks[0, 0].next()
    detected = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "failure_detected"]
    assert [(e["replica"], e["cause"]) for e in detected] == [(0, "heartbeat_timeout")]


def test_a_relay_refuses_a_local_peer_without_the_token_and_ends(tmp_path: Path) -> None:
    from recover.coord import CoordinatorClient, CoordinatorRefused
    from recover.coord.relay import Relay

    coord = Coordinator(token=TOKEN, expected_replicas=1, ranks_per_replica=2, per_replica_connections=True).start()
    relay = Relay("127.0.0.1", coord.port, TOKEN, 0, 2).start()
    try:
        stranger = CoordinatorClient(*relay.address, "not-the-token", 0, rank=0, ranks=2)
        with pytest.raises(CoordinatorRefused, match="unauthorized"):
            stranger.register(timeout=10)
        stranger.close()
        assert relay._thread is not None
        relay._thread.join(5)
        assert "refused: unauthorized" in (relay.closed_why or "")
        assert coord.snapshot()["live"] == []  # the coordinator never heard of replica 0
    finally:
        relay.stop()
        coord.stop()
