"""End to end: ``recover launch --mute R@STEP``, a replica whose heartbeats stop while it computes on.

Three replicas of the ``debug`` preset, deterministic, each microbatch an emulated 0.6 s device pass, so a
replica's messages to the coordinator (its votes) are further apart than the heartbeat timeout (1 s):
only its heartbeats showed it alive. The coordinator must find it by its missed heartbeats and go on
without it, every committed step holding all M microbatches and bitwise equal to the failure-free run
(which runs without the emulated device time: it changes no number, tests/unit/test_parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import NO_PLOTS, losses, run_recover

STEPS, M, MUTED, AT = 4, 8, 1, 2


def launch(out: Path, corpus: Path, *extra: str) -> None:
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "3", "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--data.path", str(corpus), "--deterministic", "--training.eval_every=0", *extra],
                timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("mute-ref")
    launch(out, corpus)
    return out


def test_a_muted_replica_is_found_by_its_missed_heartbeats_and_the_job_goes_on_bitwise(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    launch(tmp_path, corpus, "--mute", f"{MUTED}@{AT}", "--device-time-s", "0.6")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    assert losses(tmp_path) == losses(reference)  # bitwise
    assert rows[AT - 1]["live_replicas"] == 3 and rows[-1]["live_replicas"] == 2
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    muted = next(e for e in events if e["kind"] == "injected" and e["fault"] == "mute")
    found = next(e for e in events if e["kind"] == "failure_detected" and e["replica"] == MUTED)
    assert (muted["replica"], muted["step"], found["cause"]) == (MUTED, AT, "heartbeat_timeout")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(f["fault"], f["replica"], f["step"], f["detected_by"]) for f in summary["faults"]] == \
        [("muted heartbeats", MUTED, AT, "heartbeat_timeout")]
