"""A user's script that raises, launched as the replicas: the launcher shows the replica, the exception's last
lines and the log at once; the first time the replica is lost and rejoins like a killed one (the job goes on,
M microbatches in every step); the same exception raised again (here by the replica that took the orphaned
microbatch) stops the job with status 13 after saving the last committed state. It used to be absorbed as a
fault ("kills 0", exit 0) or end in "0 steps committed", exit 1, the traceback only in the replica's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import warmstart
from conftest import NO_PLOTS, ROOT, subprocess_env
from recover.bench.common import STOP_GRACE_S, kill_group

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_raises.py"
STEPS, M = 12, 6


def launch(out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recover", "launch", NO_PLOTS,
           "--config", "debug", "--replicas", "3", "--steps", str(STEPS),
           "--out", str(out), "--no-progress", "--deterministic", "--workload.policy=even", *extra, "--",
           sys.executable, str(SCRIPT)]
    proc = warmstart.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**subprocess_env(), **env}, start_new_session=True)
    try:
        text, err = proc.communicate(timeout=300)
    finally:
        kill_group(proc, STOP_GRACE_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, text, err)


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_an_exception_met_once_is_shown_and_the_job_goes_on_with_the_replica_rejoined(tmp_path: Path) -> None:
    # 0.1 s a microbatch: the 7 steps after the exception outlast the rejoin's 1 s (a finished job restarts nobody)
    res = launch(tmp_path, {"RAISE": "4:2", "RAISE_ONCE": str(tmp_path / "raised"), "MB_S": "0.1"},
                 "--rejoin-after", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    raised = [e for e in events(tmp_path) if e["kind"] == "script_error"]
    assert len(raised) == 1 and raised[0]["step"] == 4 and not raised[0]["recurring"]
    rid = raised[0]["replica"]
    line = next(x for x in res.stderr.splitlines() if x.startswith(f"recover: replica {rid} raised ValueError"))
    assert "in step 4 at " in line and "train_raises.py:" in line and "rejoins in 1 s" in line
    assert f"log: {tmp_path / 'logs' / f'replica_{rid}.log'}" in line
    assert "ValueError: bad microbatch 2 of step 4" in res.stderr  # the exception's last lines
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    assert any(e["kind"] == "rejoin_started" and e["replica"] == rid for e in events(tmp_path))


def test_the_same_exception_raised_again_stops_the_job_with_13_and_the_committed_state_saved(
        tmp_path: Path) -> None:
    res = launch(tmp_path, {"RAISE": "4:2"}, "--rejoin-after", "1")
    assert res.returncode == 13, res.stderr[-3000:]
    raised = [e for e in events(tmp_path) if e["kind"] == "script_error"]
    assert len(raised) >= 2 and not raised[0]["recurring"] and raised[1]["recurring"]
    assert {(e["type"], e["place"]) for e in raised} == {(raised[0]["type"], raised[0]["place"])}
    again = raised[1]["replica"]
    assert f"recover: replica {again} raised ValueError again in step 4" in res.stderr
    assert "the job stopped after 4 committed steps: the script raised ValueError at " in res.stderr
    assert (tmp_path / "checkpoints" / "step_000004" / "COMMITTED").is_file()
    assert len([x for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]) == 4
    assert os.path.getsize(tmp_path / "logs" / f"replica_{again}.log") > 0
