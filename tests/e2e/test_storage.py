"""End to end: storage errors are not replica faults. The checkpoint directory is a 2.5 MB tmpfs, room for
one checkpoint of the debug model (1.8 MB) but not two: the first save commits, the later ones fail with
ENOSPC mid-write and are abandoned (their partial files removed, the older checkpoint kept), each with
one line, and the job trains on to its last step, bitwise equal to the run on an ample disk (which
saves when ``checkpoint_every = "auto"`` says); the final save refused, it exits with status 12.
Needs root (it mounts the tmpfs); skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import warmstart
from conftest import NO_PLOTS, ROOT, losses, run_recover, subprocess_env
from recover.observe.events import read_jsonl

STEPS = 6


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "run" / "checkpoints"
    mount.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def launch(out: Path, corpus: Path, every: str = "2") -> subprocess.CompletedProcess[str]:
    return run_recover(["launch", NO_PLOTS,
                        "--config", "debug", "--replicas", "2", "--steps", str(STEPS), "--out", str(out),
                        "--no-progress", "--data.path", str(corpus), "--deterministic", "--overwrite",
                        f"--training.checkpoint_every={every}", "--training.checkpoint_async=false"], timeout=300,
                       check=False)


def test_a_full_checkpoint_disk_abandons_saves_and_training_goes_on_bitwise(small_disk: Path, corpus: Path,
                                                                           tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert launch(reference, corpus, every="auto").returncode == 0
    saved = [e for e in read_jsonl(reference / "events.jsonl") if e["kind"] in ("checkpoint", "checkpoint_interval")]
    assert [(e["kind"], e["step"]) for e in saved] == [("checkpoint", 1), ("checkpoint_interval", 1),
                                                       ("checkpoint", STEPS)]  # measured, then past the end
    assert saved[1]["every"] > STEPS and saved[1]["save_cost_s"] > 0 and saved[1]["failures"] == 0
    run = small_disk.parent
    res = launch(run, corpus)
    assert res.returncode == 12, res.stderr[-2000:]
    rows = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(STEPS)) and losses(run) == losses(reference)
    events = list(read_jsonl(run / "events.jsonl"))
    abandoned = [e for e in events if e["kind"] in ("checkpoint_abandoned", "checkpoint_unsaved")]
    assert [(e["kind"], e["step"]) for e in abandoned] == [("checkpoint_abandoned", 4), ("checkpoint_unsaved", 6)]
    assert all("MiB free" in e["message"] for e in abandoned)
    assert not [e for e in events if e["kind"] in ("failure_detected", "kill")]  # no replica paid for it
    assert sorted(p.name for p in small_disk.iterdir()) == ["step_000002"]  # the older one kept, no partials
    logs = (run / "logs" / "replica_0.log").read_text() + (run / "logs" / "replica_1.log").read_text()
    assert logs.count("abandoned: could not write") == 2 and "Traceback" not in logs + res.stderr
    assert "without its final checkpoint: checkpoint of step 6 abandoned: could not write" in res.stderr


FULL_AT_SUMMARY = """
import errno, pathlib, sys
write_text = pathlib.Path.write_text
def full(self, *args, **kwargs):
    if self.name == "summary.json":  # the disk fills as the job ends: the launcher's own write is refused
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_text(self, *args, **kwargs)
pathlib.Path.write_text = full
from recover.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_launchers_own_records_refused_by_the_storage_end_with_status_12_and_its_line(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: the launcher died with an OSError traceback writing summary.json, status 1 and no line

    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", FULL_AT_SUMMARY, "launch", NO_PLOTS,
                          "--config", "debug", "--replicas", "2",
                          "--steps", "3", "--out", str(run), "--no-progress", "--data.path", str(corpus)],
                         capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=ROOT)
    assert res.returncode == 12, res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("recover: ")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("recover: the storage refused the launcher's records with 3 committed steps recorded: "
                               f"could not write {run / 'summary.json'} (")
    assert "MiB free; OSError: [Errno 28] No space left on device); free some space and run `recover collect " \
           f"{run}` to write them" in lines[0]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2] and not (run / "summary.json").exists()


@pytest.fixture
def small_run_disk(tmp_path: Path) -> Iterator[Path]:
    """The whole run directory on a 12 MB tmpfs (its logs, records and checkpoints)."""
    run = tmp_path / "run"
    run.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(run)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield run
    finally:
        subprocess.run(["umount", "-l", str(run)], check=False)


def test_the_runs_whole_disk_filling_under_the_job_ends_it_with_status_12_and_its_lines(
        small_run_disk: Path, corpus: Path) -> None:
    # issue 41: the replicas' logs on the full disk: their prints failed and they died with status 1 and no
    # line; with the logs elsewhere, the launcher died with an OSError traceback writing summary.json
    import time

    run = small_run_disk
    proc = warmstart.popen([sys.executable, "-m", "recover", "launch", NO_PLOTS,
                             "--config", "debug", "--replicas", "2",
                             "--steps", "40", "--out", str(run), "--no-progress", "--data.path", str(corpus),
                             "--device-time-s", "0.05", "--training.checkpoint_every=5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT,
                            start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.monotonic() < end and proc.poll() is None, "the job did not reach step 3"
            time.sleep(0.1)
        with open(run / "filler", "wb") as f:  # the disk fills under the running job
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 12, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("recover: ") and "warning" not in line]
    assert len(lines) == 2 and "without its final checkpoint" in lines[0], err[-3000:]
    assert lines[1].startswith("recover: the storage refused the launcher's records with ") and \
        "No space left on device" in lines[1], err[-3000:]
