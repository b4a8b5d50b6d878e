"""Contracts of `recover.api` that only the replicas together can check, launched: a `samples` that reads the
replica id (each replica pure on its own, so the failure-free run of one replica would not tell) and a model
built without a seed (different initial weights). Both used to train on with exit 0 (the first) or end with
"find the faulty device" (the second); now the job ends at step 0 with status 8 and a line naming the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import NO_PLOTS, ROOT, run_recover

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_contracts.py"


@pytest.mark.parametrize(("broken", "says"), [
    ("replica_samples", "batch of microbatch 0 (samples(step, 0)) at step 0 (replicas [0] hold"),
    ("unseeded", "at step 0, before any update: the replicas built different initial weights; seed the RNG"),
])
def test_a_contract_broken_across_replicas_ends_the_job_at_step_0_naming_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str, says: str) -> None:
    monkeypatch.setenv("BREAK", broken)
    res = run_recover(["launch", NO_PLOTS,
                       "--config", "debug", "--replicas", "2", "--steps", "6", "--out", str(tmp_path),
                       "--no-progress", "--", sys.executable, str(SCRIPT)], timeout=300, check=False)
    assert res.returncode == 8, res.stderr[-3000:]
    assert says in res.stderr
    if broken == "replica_samples":
        assert "samples is not one pure function of (step, id) on every replica" in res.stderr
    assert not (tmp_path / "metrics.jsonl").read_text().strip()  # no step committed
