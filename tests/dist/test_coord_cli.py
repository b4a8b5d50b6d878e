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

import pytest

from recover.coord import CoordinatorClient, CoordinatorRefused
from recover.observe.events import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start_coordinator(tmp_path: Path, token: str, events: Path) -> subprocess.Popen[str]:
    """``recover coordinator`` for 2 replicas, heartbeat timeout 1 s, in its own session; its first
    stdout line is the ready record."""
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    return subprocess.Popen([sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file",
                             str(token_file), "--events", str(events), "--replicas", "2", "--heartbeat-timeout",
                             "1.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)


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
    r = subprocess.run([sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file",
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
        ts = [threading.Thread(target=c.register, kwargs={"timeout": 20}) for c in cs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
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
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
