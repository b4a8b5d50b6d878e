"""A user's own model and loop (`recover.api`) run as the replicas of `recover launch -- python SCRIPT`, through
a crash, a hang and a corrupted replica: every step holds M microbatches and, in deterministic mode, the run
is bitwise equal to the failure-free run of the same script. The README's example script is what runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, losses, run_recover

EXAMPLE = ROOT / "examples" / "train_own.py"
STEPS, M = 12, 6  # the example's


def launch(out: Path, *extra: str) -> list[dict]:
    run_recover(["launch", "--config", "debug", "--replicas", "5", "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--deterministic", "--fault_tolerance.hang_timeout_s=3",
                 "--workload.policy=even",  # every replica computes in every step, so each fault lands in its step
                 *extra, "--",
                 sys.executable, str(EXAMPLE)], timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("own-ref")
    assert all(r["live_replicas"] == 5 for r in launch(out))
    return out


def test_the_example_script_keeps_every_microbatch_through_a_kill_a_hang_and_a_corruption(
        reference: Path, tmp_path: Path) -> None:
    rows = launch(tmp_path, "--fail", "1@3:backward", "--hang", "2@5:forward", "--corrupt", "0@8")
    assert losses(tmp_path) == losses(reference)  # bitwise
    live = [r["live_replicas"] for r in rows]
    assert live[2] == 5 and live[3] == 4 and live[5] == 3 and live[-1] == 2  # killed, hung, corrupted: fenced
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted(e["fault"] for e in events if e["kind"] == "kill") == ["hang", "kill"]
    assert {e["replica"] for e in events if e["kind"] == "fenced"} >= {0, 2}  # the hung one, the corrupted one
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["committed_steps"] == STEPS and summary["min_microbatches"] == M
