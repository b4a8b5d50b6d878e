"""Run directories: refusing an --out that holds another run, and clearing one on request."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from recover.errors import ConfigError
from recover.observe.rundir import check_out, clear_run, run_contents, write_private


def test_a_fresh_or_foreign_directory_is_accepted(tmp_path: Path) -> None:
    check_out(tmp_path / "new", False, False)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints").mkdir()  # empty: nothing of a run
    check_out(tmp_path, False, False)
    assert run_contents(tmp_path) == []


def test_another_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step":0}\n')
    (tmp_path / "checkpoints" / "step_000005").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds another run \(metrics.jsonl, checkpoints/\); continue it with "
                                          r"--resume, replace it with --overwrite"):
        check_out(tmp_path, False, False)
    check_out(tmp_path, True, False)
    check_out(tmp_path, False, True)
    with pytest.raises(ConfigError, match="give one of them"):
        check_out(tmp_path, True, True)
    (tmp_path / "loss.png").write_bytes(b"png")
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # only what a run wrote is gone


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot write: a 0500 one unless root bypasses modes, then a read-only one."""
    if os.geteuid() != 0:
        d = tmp_path / "locked"
        d.mkdir(mode=0o500)
        return d
    for candidate in (Path("/proc/sys"), Path("/sys/fs/cgroup")):
        if candidate.is_dir() and not os.access(candidate, os.W_OK):
            return candidate
    pytest.skip("running as root with no read-only directory to try")


def test_an_out_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file; choose another --out") as exc:
        check_out(tmp_path / "a_file" / "run", False, False)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"is not writable .*read-only or no permission"):
        check_out(unwritable_directory(tmp_path) / "run", False, False)
    check_out(tmp_path / "not" / "yet" / "there", False, False)  # created later, under a writable ancestor


def test_a_secret_is_private_from_its_creation(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old")
    token.chmod(0o644)
    write_private(token, "s3cret")
    assert token.read_text() == "s3cret" and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert not list(tmp_path.glob("*.tmp"))
