"""End to end: checkpoints on a slow store (tests/e2e/slowstore: each save takes SLOW_STORE_S longer to write).

- asynchronous saves keep training going: at most one save in flight, a save due while the previous one
  is still being written is skipped and reported (``checkpoint_skipped``), never queued; the steps around
  a save take about as long as the others; the final save is waited for and complete;
- the checkpoint a job ends with, slower than the exit grace, is waited for (not killed: status 0 with the
  step saved); one slower than ``training.checkpoint_timeout_s`` is cut short with status 12 and a line
  naming the newest complete checkpoint.

Every run is 2 replicas of the `debug` preset, deterministic, bitwise equal to the failure-free run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import warmstart
from conftest import NO_PLOTS, ROOT, losses, subprocess_env

STEPS = 16
SLOW = ROOT / "tests" / "e2e" / "slowstore"


def launch(out: Path, corpus: Path, *extra: str, slow_s: float = 0.0, match: str = ".partial",
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env.update(PYTHONPATH=f"{SLOW}{os.pathsep}{env['PYTHONPATH']}", SLOW_STORE_S=str(slow_s), SLOW_STORE_MATCH=match)
    return warmstart.run([sys.executable, "-m", "recover", "launch", NO_PLOTS, "--config", "debug", "--replicas", "2",
                           "--steps", str(STEPS), "--out", str(out), "--no-progress", "--deterministic",
                           "--data.path", str(corpus), "--training.eval_every=0", "--device-time-s", "0.1", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("slow-ref") / "run"
    done = launch(out, corpus)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_asynchronous_saves_on_a_slow_store_keep_training_going_one_in_flight(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = launch(out, corpus, "--training.checkpoint_every=2", "--training.checkpoint_async=true", slow_s=3.0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(out) == losses(reference)
    ev = events(out)
    saved = [e["step"] for e in ev if e["kind"] == "checkpoint"]
    skipped = [e for e in ev if e["kind"] == "checkpoint_skipped"]
    assert saved[-1] == STEPS and skipped and all(e["writing"] in saved for e in skipped)
    assert "checkpoint of step" in done.stderr and "is still being written" in done.stderr
    assert (out / "checkpoints" / f"step_{STEPS:06d}" / "COMMITTED").is_file()
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows(out), rows(out)[1:], strict=False)]
    assert max(gaps) < 2.0, gaps  # a save takes 3 s more to write: none of it on the training path


def test_the_final_save_slower_than_the_exit_grace_is_waited_for(reference: Path, corpus: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "run"
    # the grace is 2 s (its default is 20): a final save 5 s long outlasts it, and the 2 s leave the leader time,
    # on a loaded machine, to begin its save (checkpoint_final) after the last commit, which a grace of 1 s did not
    done = launch(out, corpus, "--training.checkpoint_every=8", "--fault_tolerance.stop_grace_s=2", slow_s=5.0,
                  match=f"step_{STEPS:06d}.partial")
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(out) == losses(reference)
    assert (out / "checkpoints" / f"step_{STEPS:06d}" / "COMMITTED").is_file()
    assert not list((out / "checkpoints").glob("*.partial"))
    assert not [e for e in events(out) if e["kind"] in ("exit_grace_over", "checkpoint_timeout")]


def test_a_final_save_past_its_timeout_ends_the_job_with_status_12_naming_the_newest_complete_checkpoint(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = launch(out, corpus, "--training.checkpoint_every=8", "--fault_tolerance.stop_grace_s=1",
                  "--training.checkpoint_timeout_s=3", slow_s=60.0, match=f"step_{STEPS:06d}.partial")
    assert done.returncode == 12, done.stderr[-3000:]
    assert losses(out) == losses(reference)  # every step committed and recorded
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"recover: the job ended after {STEPS} committed steps without its final checkpoint: "
                           f"the checkpoint of step {STEPS} was still being written by replica 0 after "
                           "training.checkpoint_timeout_s = 3 s")
    assert f"the newest complete checkpoint is {out / 'checkpoints' / 'step_000008'} (step 8)" in last
    assert [e["step"] for e in events(out) if e["kind"] == "checkpoint_timeout"] == [STEPS]
