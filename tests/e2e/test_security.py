"""End to end: a job over TLS with mutual authentication on the coordinator wire (``--tls-*``, certificates of
a CA made by ``openssl`` here: the ``pki`` fixture), its replicas of 2 ranks each behind their relays, through a
killed and replaced replica. (The stranger on the store, the extra replica id and the token are tried in
test_launch.py, in the run whose replicas are all killed at once: it shares that file's reference.)
"""

from __future__ import annotations

from pathlib import Path

from test_launch import M, events, rows

from conftest import run_recover


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
