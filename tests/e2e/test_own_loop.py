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


def test_a_launched_own_loop_saved_and_resumed_through_the_writers_death_is_bitwise_the_uninterrupted_run(
        tmp_path: Path) -> None:
    """`job.save()` in a launched job: only the lowest live replica writes (replica 1 once replica 0 is killed);
    `recover launch --resume` makes `Job`'s `resume` the run directory; model, optimizer and the LR scheduler
    given as `extra` continue bitwise."""
    script = ROOT / "tests" / "e2e" / "scripts" / "train_own_saved.py"
    ref, run = tmp_path / "ref", tmp_path / "run"

    def go(out: Path, steps: int, *extra: str) -> None:
        run_recover(["launch", "--config", "debug", "--replicas", "3", "--steps", str(steps), "--out", str(out),
                     "--no-progress", "--deterministic", "--workload.policy=even", *extra, "--",
                     sys.executable, str(script)], timeout=300)

    go(ref, 12)
    go(run, 6)
    go(run, 12, "--resume", "--fail", "0@7:backward")
    assert losses(run) == losses(ref)  # bitwise
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006", "step_000009", "step_000012"]
    logs = {r: (run / "logs" / f"replica_{r}.log").read_text() for r in range(3)}
    saved = {step: f"saved {run / 'checkpoints' / f'step_{step + 1:06d}'}" for step in (5, 8, 11)}
    assert f"step 5: {saved[5]}" in logs[0] and "step 5: saved None" in logs[1]  # replica 0 writes while it lives
    assert "resumed from" in logs[1] and f"step 8: {saved[8]}" in logs[1] and f"step 11: {saved[11]}" in logs[1]
    assert "step 11: saved None" in logs[2]
