"""End to end: storage errors are not replica faults. The checkpoint directory is a 2.5 MB tmpfs, room for
one checkpoint of the debug model (1.8 MB) but not two: the first save commits, the later ones fail with
ENOSPC mid-write and are abandoned (their partial files removed, the older checkpoint kept), each with
one warning line, and the job trains on to its last step, bitwise equal to the run on an ample disk.
Needs root (it mounts the tmpfs); skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import losses, run_recover

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


def launch(out: Path, corpus: Path) -> subprocess.CompletedProcess[str]:
    return run_recover(["launch", "--config", "debug", "--replicas", "2", "--steps", str(STEPS), "--out", str(out),
                        "--no-progress", "--data.path", str(corpus), "--deterministic", "--overwrite",
                        "--training.checkpoint_every=2", "--training.checkpoint_async=false"], timeout=300)


def test_a_full_checkpoint_disk_abandons_saves_and_training_goes_on_bitwise(small_disk: Path, corpus: Path,
                                                                           tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    launch(reference, corpus)
    run = small_disk.parent
    launch(run, corpus)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and losses(run) == losses(reference)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    abandoned = [e for e in events if e["kind"] == "checkpoint_abandoned"]
    assert [e["step"] for e in abandoned] == [4, 6] and all("MiB free" in e["message"] for e in abandoned)
    assert not [e for e in events if e["kind"] in ("failure_detected", "kill")]  # no replica paid for it
    assert sorted(p.name for p in small_disk.iterdir()) == ["step_000002"]  # the older one kept, no partials
    warnings = (run / "logs" / "replica_0.log").read_text() + (run / "logs" / "replica_1.log").read_text()
    assert warnings.count("abandoned: could not write") == 2
