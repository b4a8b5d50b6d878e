"""A fenced replica's line names the way back that exists: the launcher's --rejoin-after only under a launcher."""

from __future__ import annotations

import pytest

from recover.lifeline import ENV
from recover.train.processes.session import restart_hint


def test_a_worker_started_by_hand_is_not_told_about_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert "launcher" not in restart_hint() and "--join" in restart_hint()


def test_a_worker_the_launcher_started_is_told_about_rejoin_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "4242")
    assert "--rejoin-after" in restart_hint()
