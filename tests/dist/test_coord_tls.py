"""The coordinator wire over TLS with mutual authentication (recover.coord.tls), over real sockets.

A CA, a certificate it signs for the job's processes and one from another CA are made here with the
``openssl`` command (skipped where there is none). With a certificate of the job's CA a client (and a
replica's relay with its ranks) registers, heartbeats and commits over TLS; a client without TLS, one
presenting no certificate and one whose certificate another CA signed are refused at the handshake,
each logged, and the coordinator serves on.
"""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path

import pytest

from recover.coord import Coordinator, CoordinatorClient, CoordinatorLost
from recover.coord.relay import Relay
from recover.coord.tls import Tls
from recover.errors import ConfigError
from recover.observe.events import read_jsonl

TOKEN = "tl5"
@pytest.fixture()
def coord(pki: dict[str, Tls], tmp_path: Path):
    c = Coordinator(token=TOKEN, events_path=str(tmp_path / "events.jsonl"), expected_replicas=2,
                    heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, tls=pki["job"]).start()
    try:
        yield c
    finally:
        c.stop()


def registered(clients: list[CoordinatorClient]) -> list:
    out: list = [None] * len(clients)

    def run(i: int) -> None:
        try:
            out[i] = clients[i].register(timeout=15)
        except Exception as exc:  # noqa: BLE001 - handed to the assertion
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_members_with_the_jobs_certificates_register_heartbeat_and_commit_over_tls(
        coord: Coordinator, pki: dict[str, Tls]) -> None:
    clients = [CoordinatorClient("127.0.0.1", coord.port, TOKEN, r, heartbeat_interval_s=0.05, tls=pki["job"])
               for r in (0, 1)]
    try:
        ms = registered(clients)
        assert [m.members for m in ms] == [(0, 1), (0, 1)] and ms[0].secret == ms[1].secret != ""
        time.sleep(1.5)  # longer than the heartbeat timeout: the heartbeats get through
        assert coord.snapshot()["live"] == [0, 1]
        votes = [threading.Thread(target=c.vote_commit, args=(1, 0, [0, 1])) for c in clients]
        for t in votes:
            t.start()
        for t in votes:
            t.join(10)
        assert coord.snapshot()["committed_step"] == 0
    finally:
        for c in clients:
            c.close()


def plain(coord: Coordinator) -> CoordinatorClient:
    return CoordinatorClient("127.0.0.1", coord.port, TOKEN, 0, connect_timeout_s=5)


@pytest.mark.parametrize("who", ["plain", "no certificate", "another CA"])
def test_a_client_without_a_certificate_of_the_jobs_ca_is_refused_at_the_handshake(
        coord: Coordinator, pki: dict[str, Tls], tmp_path: Path, who: str) -> None:
    if who == "plain":
        c = plain(coord)
    elif who == "another CA":
        theirs = pki["stranger"]
        c = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 0, connect_timeout_s=5,
                              tls=Tls(theirs.cert, theirs.key, pki["job"].ca))  # it trusts our CA, we not theirs
    else:
        ctx = ssl.create_default_context(cafile=pki["job"].ca)
        ctx.check_hostname = False
        c = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 0, connect_timeout_s=5)
        c.tls = _Context(ctx)
    try:
        with pytest.raises((CoordinatorLost, TimeoutError)):
            c.register(timeout=5)
    finally:
        c.close()
    deadline = time.monotonic() + 5
    while not [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "refused" and e["code"] == "tls"]:
        assert time.monotonic() < deadline, "no refusal logged"
        time.sleep(0.05)
    assert coord.snapshot()["live"] == []
    ok = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 0, heartbeat_interval_s=0.05, tls=pki["job"])
    other = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 1, heartbeat_interval_s=0.05, tls=pki["job"])
    try:  # the coordinator serves on
        assert [m.members for m in registered([ok, other])] == [(0, 1), (0, 1)]
    finally:
        ok.close()
        other.close()


class _Context:
    """A client TLS setting that presents no certificate."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx

    def client(self) -> ssl.SSLContext:
        return self.ctx


def test_a_replicas_relay_speaks_tls_both_ways(coord: Coordinator, pki: dict[str, Tls]) -> None:
    relay = Relay("127.0.0.1", coord.port, TOKEN, 0, 2, 0.05, tls=pki["job"]).start()
    ranks = [CoordinatorClient(*relay.address, TOKEN, 0, heartbeat_interval_s=0.05, rank=k, ranks=2, tls=pki["job"])
             for k in (0, 1)]
    other = CoordinatorClient("127.0.0.1", coord.port, TOKEN, 1, heartbeat_interval_s=0.05, tls=pki["job"])
    try:
        ms = registered([*ranks, other])
        assert [m.members for m in ms] == [(0, 1)] * 3, ms
        time.sleep(1.5)
        assert coord.snapshot()["live"] == [0, 1]
    finally:
        for c in (*ranks, other):
            c.close()
        relay.stop()


def test_the_tls_flags_go_together_and_must_load(pki: dict[str, Tls], tmp_path: Path) -> None:
    job = pki["job"]
    assert Tls.from_flags(None, None, None) is None
    assert Tls.from_flags(job.cert, job.key, job.ca) == job
    with pytest.raises(ConfigError, match="go together"):
        Tls.from_flags(job.cert, None, job.ca)
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        Tls.from_flags(str(tmp_path / "bad.pem"), job.key, job.ca)


def test_an_operators_status_and_drain_speak_tls_and_a_plain_one_is_refused(
        coord: Coordinator, pki: dict[str, Tls], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from recover.cli import main

    (tmp_path / "token").write_text(TOKEN)
    clients = [CoordinatorClient("127.0.0.1", coord.port, TOKEN, r, heartbeat_interval_s=0.05, tls=pki["job"])
               for r in (0, 1)]
    at = ["--coordinator", f"127.0.0.1:{coord.port}", "--token-file", str(tmp_path / "token")]
    try:
        registered(clients)
        assert main(["status", *at, "--json", *pki["job"].flags()]) == 0
        assert json.loads(capsys.readouterr().out)["members"] == [0, 1]
        assert main(["drain", "5", *at, *pki["job"].flags()]) == 2  # answered over TLS: refused in one line
        assert "refused (bad_replica): replica 5 is unknown" in capsys.readouterr().err
        assert main(["status", *at]) == 2  # plain TCP to a TLS coordinator: no handshake, no reply
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"the coordinator at 127.0.0.1:{coord.port}" in err[0], err
    finally:
        for c in clients:
            c.close()
