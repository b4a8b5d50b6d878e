"""How a launched replica's session ends a job it cannot go on in
(:meth:`recover.train.processes.session.Session.status`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recover.config import load_config
from recover.errors import StateLost
from recover.train.processes.exits import EXIT_STATE_LOST
from recover.train.processes.session import Session


def test_nobody_holding_the_state_and_no_checkpoint_ends_with_one_line_and_status_11(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = Session(load_config("debug"), tmp_path, 3, "127.0.0.1", 1, "t")
    saves: list[Path | None] = []
    exc = StateLost("every replica that held the training state was lost before step 6 was committed, and there "
                    "is no intact checkpoint to fall back to")
    assert s.status(exc, saves.append) == EXIT_STATE_LOST and saves == []  # nothing to save: no state here
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recover: replica 3: every replica that held")
    assert "training.checkpoint_every" in lines[0]
