"""Run directories: refusing an --out that holds another run, and clearing one on request."""

from __future__ import annotations

from pathlib import Path

import pytest

from recover.errors import ConfigError
from recover.observe.rundir import check_out, clear_run, run_contents


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
