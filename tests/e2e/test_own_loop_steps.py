"""A script's job in the launcher's records. Its own step count is the job's: the README's example commits 12
steps (its `job.steps(12)`) under a launch whose `--steps` is left to the preset's 20; the launcher says so in a
note and the job ends with status 0 (it used to wait for steps that never came and end with status 1, without a
line saying why). Its own metrics, evaluation and LR scheduler are in the records."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import NO_PLOTS, ROOT, run_recover

EXAMPLE = ROOT / "examples" / "train_own.py"


def test_a_scripts_job_steps_is_the_jobs_step_count(tmp_path: Path) -> None:
    res = run_recover(["launch", NO_PLOTS,
                       "--config", "debug", "--replicas", "2", "--out", str(tmp_path), "--no-progress",
                       "--", sys.executable, str(EXAMPLE)], timeout=300)  # exits 0 (run_recover checks)
    assert "the script commits 12 steps (its job.steps(12)); the launch said 20: the job is 12 steps" in res.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert json.loads((tmp_path / "summary.json").read_text())["committed_steps"] == 12


def test_a_scripts_metrics_evaluation_and_lr_scheduler_are_in_the_jobs_records(tmp_path: Path) -> None:
    """`job.log(...)` lands in metrics.jsonl's `user`, `Job(evaluate=..., eval_every=4)` in `val_loss` (steps 3
    and 7), a torch LR scheduler given as `lr` is the records' `lr`, through a kill and a rejoin (the joiner
    takes the scheduler's state)."""
    script = ROOT / "tests" / "e2e" / "scripts" / "train_logged.py"
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "2", "--steps", "8", "--out", str(tmp_path),
                 "--no-progress", "--fail", "1@2:backward", "--rejoin-after", "0", "--", sys.executable,
                 str(script)], timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    assert all(r["user"]["double_loss"] == 2 * r["loss"] for r in rows[:-1])  # the last one's log comes after
    assert [s for s, r in enumerate(rows) if r.get("val_loss") is not None] == [3, 7]
    assert [r["lr"] for r in rows] == pytest.approx([0.01 / (s + 1) for s in range(8)], rel=1e-12)


def test_loss_scaling_with_an_overflow_is_bitwise_the_failure_free_run_through_a_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Job(scaler=GradScaler(...))`: step 0 overflows at the scale of 2**200 (its update skipped, the scale backs
    off, the same on every replica), a replica is killed in step 2 and the others take its microbatches: every
    step bitwise the one-replica failure-free run's."""
    script = ROOT / "tests" / "e2e" / "scripts" / "train_logged.py"
    monkeypatch.setenv("SCALER", "1")
    runs = {}
    for name, extra in (("ref", ["--replicas", "1"]),
                        ("kill", ["--replicas", "3", "--fail", "1@2:backward"])):
        out = tmp_path / name
        run_recover(["launch", NO_PLOTS, "--config", "debug", "--steps", "8", "--out", str(out), "--no-progress",
                     "--deterministic", "--workload.policy=even", *extra, "--", sys.executable, str(script)],
                    timeout=300)
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in runs["kill"]] == [r["loss"] for r in runs["ref"]]  # bitwise
    ref = runs["ref"]
    assert not math.isfinite(ref[0]["grad_norm"]) and all(math.isfinite(r["grad_norm"]) for r in ref[2:])
    assert runs["kill"][1]["live_replicas"] == 3 and runs["kill"][2]["live_replicas"] == 2
