"""`recover coordinator` as its own process: ready line, bad peers, membership, clean errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import warmstart

from recover.coord import CoordinatorClient, CoordinatorRefused
from recover.coord.client import CoordinatorLost
from recover.observe.events import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start_coordinator(tmp_path: Path, token: str, events: Path, port: int = 0,
                      store_port: int = 0) -> subprocess.Popen[str]:
    """``recover coordinator`` for 2 replicas, heartbeat timeout 1 s, in its own session; its first
    stdout line is the ready record."""
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    return warmstart.popen([sys.executable, "-m", "recover", "coordinator", "--port", str(port), "--store-port",
                             str(store_port), "--token-file", str(token_file), "--events", str(events), "--replicas",
                             "2", "--heartbeat-timeout", "1.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), start_new_session=True)


def in_parallel(cs: list[CoordinatorClient], call: Any) -> None:
    """``call(client)`` for every client at once (each blocks until all arrived); joins them."""
    ts = [threading.Thread(target=call, args=(c,)) for c in cs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)


def register_all(cs: list[CoordinatorClient]) -> None:
    in_parallel(cs, lambda c: c.register(timeout=20))
    assert all(c.membership is not None for c in cs)


def vote_all(cs: list[CoordinatorClient], step: int) -> None:
    in_parallel(cs, lambda c: c.vote_commit(c.membership.generation, step, [0, 1], timeout=20))


def stop(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_coordinator_command_serves_and_survives_bad_peers(tmp_path: Path) -> None:
    ev = tmp_path / "run" / "events.jsonl"
    proc = start_coordinator(tmp_path, "tok-123", ev)
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["host"] == "127.0.0.1" and ready["store_port"] > 0
        bad = CoordinatorClient("127.0.0.1", ready["port"], "not-the-token", 0)
        with pytest.raises(CoordinatorRefused, match="unauthorized"):
            bad.register(timeout=10)
        bad.close()
        cs = [CoordinatorClient("127.0.0.1", ready["port"], "tok-123", r) for r in (0, 1)]
        out: dict[int, object] = {}
        ts = [threading.Thread(target=lambda c=c: out.__setitem__(c.replica_id, c.register(timeout=20)))
              for c in cs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert {m.members for m in out.values()} == {(0, 1)}  # type: ignore[attr-defined]
        cs[1].close()  # replica 1 leaves: replica 0 is told
        m = cs[0].wait_for_generation(1, 10)
        assert m.members == (0,) and m.dead == (1,)
        assert proc.poll() is None  # still serving
        kinds = [e["kind"] for e in read_jsonl(ev)]
        assert {"coordinator_start", "refused", "register", "generation"} <= set(kinds)
    finally:
        for c in cs:
            c.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_coordinator_command_rejects_a_missing_token_file(tmp_path: Path) -> None:
    r = warmstart.run([sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file",
                        str(tmp_path / "nope")], capture_output=True, text=True, env=env(), timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("recover: error: --token-file") and "\n" not in r.stderr.strip()


def test_a_coordinator_paused_for_twice_the_heartbeat_timeout_fences_nobody(tmp_path: Path) -> None:
    """SIGSTOP of the coordinator for 2 s (heartbeat timeout 1 s), then SIGCONT: the clients'
    heartbeats queued on its sockets are read first, nobody is fenced, the pause is logged."""
    ev = tmp_path / "events.jsonl"
    proc = start_coordinator(tmp_path, "tok", ev)
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        cs = [CoordinatorClient("127.0.0.1", port, "tok", r) for r in (0, 1)]
        register_all(cs)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.5)
        assert [c.lost for c in cs] == [None, None]
        kinds = [e["kind"] for e in read_jsonl(ev)]
        assert "coordinator_stalled" in kinds and "fenced" not in kinds and "failure_detected" not in kinds
    finally:
        for c in cs:
            c.close()
        stop(proc)


def test_clients_survive_a_coordinator_sigkill_and_restart_on_the_same_ports(tmp_path: Path) -> None:
    """SIGKILL of the coordinator process: its clients keep their state and retry; a coordinator started
    again with the same flags takes them back (they register with what they hold) and forms the next
    generation with both, with the committed step they reported."""
    ev = tmp_path / "events.jsonl"
    procs = [start_coordinator(tmp_path, "tok", ev)]
    cs: list[CoordinatorClient] = []
    try:
        assert procs[0].stdout is not None
        ready = json.loads(procs[0].stdout.readline())
        cs = [CoordinatorClient("127.0.0.1", ready["port"], "tok", r, reconnect_s=30) for r in (0, 1)]
        register_all(cs)
        vote_all(cs, 0)  # a step committed before the crash
        assert [c.committed_step for c in cs] == [0, 0]
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        time.sleep(0.5)
        assert [c.lost for c in cs] == [None, None] and not cs[0].failure_notice(1)  # waiting, not lost
        procs.append(start_coordinator(tmp_path, "tok", ev, ready["port"], ready["store_port"]))
        m = cs[0].wait_for_generation(1, 20)
        assert (m.generation, m.members, m.reason, m.step, m.joined) == (2, (0, 1), "restart", 1, ())
        assert cs[1].wait_for_generation(1, 10) == m and [c.lost for c in cs] == [None, None]
        rebuilt = [e for e in read_jsonl(ev) if e["kind"] == "rebuilt"]
        assert rebuilt and rebuilt[0]["committed_step"] == 0 and rebuilt[0]["back"] == [0, 1]
    finally:
        for c in cs:
            c.close()
        for proc in procs:
            stop(proc)


def test_a_coordinator_that_does_not_come_back_in_time_is_lost_for_good(tmp_path: Path) -> None:
    proc = start_coordinator(tmp_path, "tok", tmp_path / "events.jsonl")
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        cs = [CoordinatorClient("127.0.0.1", port, "tok", r, reconnect_s=1.0) for r in (0, 1)]
        register_all(cs)
        os.killpg(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorLost, match="did not come back within 1 s"):
            cs[0].wait_for_generation(1, 20)
        assert 0.9 < time.monotonic() - t0 < 5 and cs[0].gone
    finally:
        for c in cs:
            c.close()
        stop(proc)


def test_a_coordinator_paused_beyond_the_reconnect_window_is_lost_for_good_not_a_timeout(tmp_path: Path) -> None:
    """SIGSTOP for longer than ``reconnect_s``: a vote waiting on it (its own timeout shorter) ends as
    CoordinatorLost with ``gone`` (the replicas then save and stop, exit 7), never as TimeoutError."""
    proc = start_coordinator(tmp_path, "tok", tmp_path / "events.jsonl")
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        cs = [CoordinatorClient("127.0.0.1", port, "tok", r, reconnect_s=2.0) for r in (0, 1)]
        register_all(cs)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorLost, match=r"silent for \d\.\d s \(paused\?\), more than 2 s"):
            cs[0].vote_commit(1, 0, [0, 1], timeout=1.0)
        assert 2.0 < time.monotonic() - t0 < 6 and cs[0].gone and cs[0].cut_off is None
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        for c in cs:
            c.close()
        stop(proc)


def test_sigterm_to_the_coordinator_makes_the_next_commit_a_stop_then_it_exits(tmp_path: Path) -> None:
    """Two SIGTERMs at once (a Slurm time limit signals the coordinator and the batch script, which passes
    its own on) are one graceful stop, not the second signal that stops it at once."""
    proc = start_coordinator(tmp_path, "tok", tmp_path / "events.jsonl")
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        cs = [CoordinatorClient("127.0.0.1", port, "tok", r) for r in (0, 1)]
        register_all(cs)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.2)  # handled apart (two signals sent at once would merge into one)
        os.kill(proc.pid, signal.SIGTERM)  # a Slurm time limit's, and the batch script's: one request
        time.sleep(0.3)
        assert proc.poll() is None  # a job runs: it waits for the stop to commit
        vote_all(cs, 0)
        assert [c.stopping for c in cs] == [True, True]
        for c in cs:
            c.close()
        assert proc.wait(10) == 0  # every replica gone after the stop: it exits by itself
    finally:
        for c in cs:
            c.close()
        stop(proc)
