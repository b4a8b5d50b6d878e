"""End to end: nobody gets in who does not belong, and the job does not notice the attempts.

A deterministic `recover launch` of test_launch's job (a replica killed in step 10 and replaced) meets,
while it trains: a stranger without the token who lists the coordinator's store, writes every key a
generation's group used to read in the clear (``gen{g}/0/{rank}``, ``gen{g}/probe/{replica}``) for the
generations to come, overwrites every entry it lists, and tries to register; and a holder of the token
who starts ``recover worker`` with a replica id beyond ``--max-replicas``. The stranger is refused,
its writes are never read, the extra worker is refused in one line (exit 2), and the run is bitwise
equal to the failure-free reference. Nothing the coordinator logs holds a generation's secret.

Then a job of replicas of 2 ranks (each behind its relay) runs over TLS with mutual authentication
(``--tls-*``, certificates of a CA made by ``openssl`` here), through a killed and replaced replica.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from test_launch import (  # noqa: F401 - fixtures: the failure-free reference, test_launch's second source
    STEPS,
    M,
    _await_step,
    _reap,
    _start_launch,
    events,
    reference_det,
    rows,
    second_source,
)

from conftest import losses, run_recover, subprocess_env
from recover.coord.protocol import FrameDecoder, encode
from recover.observe.events import read_jsonl

SECRET_LIKE = re.compile(r"\b[0-9a-f]{32}\b")


def stranger_writes(host: str, store_port: int) -> int:
    """What a stranger on the store port does: every old name of the next generations forged, every entry it
    lists overwritten. Returns how many entries it listed."""
    store = dist.TCPStore(host, store_port, None, False, timedelta(seconds=5))
    listed = store.list_keys()
    for name in listed:
        store.set(name, "127.0.0.1:1")
    for g in range(1, 8):
        for r in range(4):
            store.set(f"gen{g}/0/{r}", "127.0.0.1:1")
            store.set(f"gen{g}/probe/{r}", "127.0.0.1:1")
    return len(listed)


def coordinator_start(run: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> dict:
    """The coordinator's ``coordinator_start`` event, once it is in ``events.jsonl``."""
    deadline = time.monotonic() + timeout
    while True:
        path = run / "events.jsonl"
        found = [e for e in read_jsonl(path) if e["kind"] == "coordinator_start"] if path.exists() else []
        if found:
            return found[0]
        assert time.monotonic() < deadline and proc.poll() is None, "the coordinator never started"
        time.sleep(0.05)


def stranger_registers(host: str, port: int) -> dict:
    """A register without the token: the coordinator's answer."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(encode({"type": "register", "id": 1, "token": "guessed", "replica": 0, "join": True}))
        decoder = FrameDecoder()
        while True:
            got = decoder.feed(sock.recv(1 << 16))
            if got:
                return got[0]


def test_a_stranger_and_an_extra_replica_id_are_refused_and_the_job_is_bitwise_unaffected(
        reference_det: Path, corpus: Path, tmp_path: Path) -> None:  # noqa: F811 - the imported fixture
    run = tmp_path / "run"
    proc = _start_launch(run, corpus, "--fail", "1@10:backward", "--rejoin-after", "0", "--device-time-s", "0.2")
    extra = None
    try:
        start = coordinator_start(run, proc)
        assert start["max_replicas"] == 4
        extra = subprocess.Popen([sys.executable, "-m", "recover", "worker", "--config", str(run / "config.json"),
                                  "--out", str(tmp_path / "extra"), "--coordinator", f"127.0.0.1:{start['port']}",
                                  "--token-file", str(run / "token"), "--replica", "4", "--join"],
                                 env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _await_step(run, 2, proc)
        assert stranger_writes("127.0.0.1", start["store_port"]) > 0
        reply = stranger_registers("127.0.0.1", start["port"])
        assert reply["type"] == "error" and reply["code"] == "unauthorized", reply
        _, said = extra.communicate(timeout=120)
        assert extra.returncode == 2, said
        assert said.strip().splitlines() == [
            "recover: error: coordinator refused the request: bad_replica: replica id 4 is outside this job's "
            "0..3 (--max-replicas lets it grow)"]
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
            extra.wait(10)
        _reap(run, proc)
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    assert losses(run) == losses(reference_det)
    ev = events(run)
    assert {e["code"] for e in ev if e["kind"] == "refused"} == {"unauthorized", "bad_replica"}
    assert [e["replica"] for e in ev if e["kind"] == "failure_detected"] == [1]  # the injected kill, nobody else
    assert max(e["generation"] for e in ev if e["kind"] == "generation") >= 3  # formed after the stranger wrote
    for text in [(run / "events.jsonl").read_text(), *(p.read_text() for p in (run / "logs").glob("*.log"))]:
        assert not SECRET_LIKE.search(text), SECRET_LIKE.search(text)


def test_a_launch_over_tls_trains_through_a_kill_and_a_rejoin(corpus: Path, tmp_path: Path, pki: dict) -> None:
    run = tmp_path / "tls"
    steps = 8
    run_recover(["launch", "--config", "debug", "--replicas", "2", "--fsdp", "2", "--steps", str(steps), "--out",
                 str(run), "--no-progress", "--data.path", str(corpus), "--training.eval_every=0",
                 "--fail", "1@3:backward", "--rejoin-after", "0", *pki["job"].flags()], timeout=300)
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(steps)) and all(r["microbatches"] == M for r in recs)
    ev = events(run)
    assert next(e for e in ev if e["kind"] == "coordinator_start")["tls"] is True
    assert not [e for e in ev if e["kind"] == "refused"]
    assert sorted(e["rank"] for e in ev if e["kind"] == "state_received" and e["replica"] == 1) == [0, 1]
