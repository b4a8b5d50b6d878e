"""An exception nobody foresaw ends a command in one line (exit 1); `--debug` lets its traceback through."""

from __future__ import annotations

import argparse

import pytest

from recover import cli
from recover.launch import collect


def _broken(args: argparse.Namespace) -> int:
    return {}["no such key"]  # a bug


def test_an_unexpected_error_is_one_line_naming_its_type_and_place(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(collect, "run_collect", _broken)
    assert cli.main(["collect", "somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    # the place: the innermost frame in recover's own code (here the call into the broken command)
    assert err.startswith("recover: internal error: KeyError: 'no such key' (at cli.py:") and \
        err.rstrip().endswith("run `recover --debug collect ...` for the traceback"), err


def test_debug_lets_the_traceback_through_and_the_processes_it_starts_inherit_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(collect, "run_collect", _broken)
    with pytest.raises(KeyError):
        cli.main(["--debug", "collect", "somewhere"])
    import os

    assert os.environ[cli.DEBUG_ENV] == "1"
