"""`recover coordinator --metrics-port`: its Prometheus endpoint read over HTTP by the official parser.

A real coordinator process with two clients: three committed steps, then replica 1's connection cut
(a crash). Each scrape is parsed by ``prometheus_client.parser.text_string_to_metric_families`` (the
dev extra installs it) and must show what the coordinator's own events say.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import warmstart
from prometheus_client.parser import text_string_to_metric_families

from recover.coord import CoordinatorClient
from recover.observe.events import read_jsonl
from test_coord_cli import env, register_all, stop, vote_all
from test_coord_ranks import crash


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tmp_path: Path, metrics_port: int) -> subprocess.Popen[str]:
    (tmp_path / "token").write_text("tok\n")
    return warmstart.popen([sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file",
                             str(tmp_path / "token"), "--events", str(tmp_path / "events.jsonl"), "--replicas", "2",
                             "--metrics-port", str(metrics_port), "--tensorboard", str(tmp_path / "tb" / "job")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)


def scrape(port: int) -> dict[str, list]:
    """name -> samples, as the official parser reads them (counters lose their ``_total``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def value(metrics: dict[str, list], name: str) -> float:
    ((labels, v),) = metrics[name]
    assert labels == {}
    return v


def test_the_endpoint_follows_the_job_and_a_taken_port_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    proc = start(tmp_path, port)
    cs: list[CoordinatorClient] = []
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["metrics_port"] == port
        first = scrape(port)
        assert value(first, "recover_committed_step") == -1 and value(first, "recover_generation") == 0
        assert first["recover_failures"] == []  # a counter family with no cause yet
        cs = [CoordinatorClient("127.0.0.1", ready["port"], "tok", r) for r in (0, 1)]
        register_all(cs)
        for step in range(3):
            time.sleep(0.05)
            vote_all(cs, step)
        m = scrape(port)
        assert (value(m, "recover_generation"), value(m, "recover_members"), value(m, "recover_committed_step"),
                value(m, "recover_live_replicas")) == (1, 2, 2, 2)
        assert 0.04 < value(m, "recover_step_seconds") < 5 and 0 < value(m, "recover_goodput") <= 1
        crash(cs[1])
        cs[0].wait_for_generation(1, 10)
        m = scrape(port)
        causes = [e["cause"] for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "failure_detected"]
        assert causes == ["connection_closed"] and m["recover_failures"] == [({"cause": "connection_closed"}, 1.0)]
        assert (value(m, "recover_generation"), value(m, "recover_members"), value(m, "recover_live_replicas")) == (
            2, 1, 1)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert any((tmp_path / "tb" / "job").glob("events.out.tfevents.*"))
        taken = warmstart.run([sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file",
                                str(tmp_path / "token"), "--metrics-port", str(port)],
                               capture_output=True, text=True, env=env(), timeout=60)
        assert taken.returncode == 2 and taken.stdout == ""
        assert taken.stderr.strip().startswith(f"recover: error: --metrics-port {port}: cannot listen")
        assert "\n" not in taken.stderr.strip()
    finally:
        for c in cs:
            c.close()
        stop(proc)
