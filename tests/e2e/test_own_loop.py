"""A user's own model and loop (`recover.api`) run as the replicas of `recover launch -- python SCRIPT`, through
a crash, a hang and a corrupted replica: every step holds M microbatches and, in deterministic mode, the run
is bitwise equal to the failure-free run of the same script. The README's example script is what runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_PLOTS, ROOT, losses, run_recover

EXAMPLE = ROOT / "examples" / "train_own.py"
STEPS, M = 12, 6  # the example's


def launch(out: Path, *extra: str, replicas: int = 5) -> list[dict]:
    run_recover(["launch", NO_PLOTS,
                 "--config", "debug", "--replicas", str(replicas), "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--deterministic", "--fault_tolerance.hang_timeout_s=3",
                 "--workload.policy=even",  # every replica computes in every step, so each fault lands in its step
                 *extra, "--",
                 sys.executable, str(EXAMPLE)], timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The failure-free run, of one replica: deterministic steps do not depend on how many replicas share them
    (what keeps a run through kills bitwise), so it is every test's reference here."""
    out = tmp_path_factory.mktemp("own-ref")
    assert all(r["live_replicas"] == 1 for r in launch(out, replicas=1))
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


FSDP_SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_fsdp.py"


def test_a_users_fsdp2_inside_each_replica_survives_the_loss_of_a_rank(tmp_path: Path) -> None:
    """2 replicas x 2 ranks, the user's own `fully_shard` on `rt.mesh`; rank 0 of replica 1 (its relay's
    holder) is killed mid-backward: the replica is fenced, its other rank reaped, the survivor's two ranks
    take its 4 microbatches in the same step. Losses match the script run alone (one process, no FSDP)
    within float32 rounding: the user's FSDP2 sums a shard's gradient over the ranks in float32, in pairs
    that change when the survivor takes the orphans (the built-in trainer's FSDP replicas reduce-scatter in
    float64 in deterministic mode: bitwise, tests/e2e/test_launch_parallel.py)."""
    alone = subprocess.run([sys.executable, str(FSDP_SCRIPT)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert alone.returncode == 0, alone.stderr[-2000:]
    expected = [float(line.split()[-1]) for line in alone.stdout.splitlines() if line.startswith("loss")]
    out = tmp_path / "fsdp"
    run_recover(["launch", NO_PLOTS,
                 "--config", "debug", "--replicas", "2", "--fsdp", "2", "--steps", "8", "--out", str(out),
                 "--no-progress", "--deterministic", "--workload.policy=even", "--training.threads=1",
                 "--fail", "1@3:backward", "--fail-rank", "0", "--", sys.executable, str(FSDP_SCRIPT)], timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["microbatches"] for r in rows] == [8] * 8
    assert [r["live_replicas"] for r in rows] == [2, 2, 2, 1, 1, 1, 1, 1]
    assert len(expected) == 8
    assert max(abs(r["loss"] - e) / e for r, e in zip(rows, expected, strict=True)) < 1e-6
    exits = [e for e in (json.loads(line) for line in (out / "events.jsonl").read_text().splitlines())
             if e["kind"] == "replica_exit"]
    assert {e["replica"]: e["code"] for e in exits}[1] != 0 and {e["replica"]: e["code"] for e in exits}[0] == 0


def test_a_launched_own_loop_saved_and_resumed_through_the_writers_death_is_bitwise_the_uninterrupted_run(
        reference: Path, tmp_path: Path) -> None:
    """`job.save()` in a launched job: only the lowest live replica writes (replica 1 once replica 0 is killed);
    `recover launch --resume` makes `Job`'s `resume` the run directory; model, optimizer and the LR scheduler
    given as `extra` continue bitwise. The script is the example's, with the example's LR as a scheduler: the
    uninterrupted run is the example's reference."""
    script = ROOT / "tests" / "e2e" / "scripts" / "train_own_saved.py"
    run = tmp_path / "run"

    def go(out: Path, steps: int, *extra: str) -> None:
        run_recover(["launch", NO_PLOTS,
                     "--config", "debug", "--replicas", "3", "--steps", str(steps), "--out", str(out),
                     "--no-progress", "--deterministic", "--workload.policy=even", *extra, "--",
                     sys.executable, str(script)], timeout=300)

    go(run, 6)
    go(run, STEPS, "--resume", "--fail", "0@7:backward")
    assert losses(run) == losses(reference)  # bitwise
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006", "step_000009", "step_000012"]
    logs = {r: (run / "logs" / f"replica_{r}.log").read_text() for r in range(3)}
    saved = {step: f"saved {run / 'checkpoints' / f'step_{step + 1:06d}'}" for step in (5, 8, 11)}
    assert f"step 5: {saved[5]}" in logs[0] and "step 5: saved None" in logs[1]  # replica 0 writes while it lives
    assert "resumed from" in logs[1] and f"step 8: {saved[8]}" in logs[1] and f"step 11: {saved[11]}" in logs[1]
    assert "step 11: saved None" in logs[2]
