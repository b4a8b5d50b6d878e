"""The script's own step count is the job's: the README's example commits 12 steps (its `job.steps(12)`) under a
launch whose `--steps` is left to the preset's 20; the launcher says so in a note and the job ends with status 0
(it used to wait for steps that never came and end with status 1, without a line saying why)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import ROOT, run_recover

EXAMPLE = ROOT / "examples" / "train_own.py"


def test_a_scripts_job_steps_is_the_jobs_step_count(tmp_path: Path) -> None:
    res = run_recover(["launch", "--config", "debug", "--replicas", "2", "--out", str(tmp_path), "--no-progress",
                       "--", sys.executable, str(EXAMPLE)], timeout=300)  # exits 0 (run_recover checks)
    assert "the script commits 12 steps (its job.steps(12)); the launch said 20: the job is 12 steps" in res.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert json.loads((tmp_path / "summary.json").read_text())["committed_steps"] == 12
