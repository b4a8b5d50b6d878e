"""A teardown that never returns cannot hang a process (:func:`recover.train.replicas.dist.shutdown`), and a run is
done at its last step (:func:`recover.bench.common.committed`); the lingering run itself:
tests/e2e/test_bench_lingering_run.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from recover.bench import common
from recover.bench.common import committed, descendants


def test_the_last_step_says_a_run_is_done_not_a_count_of_records(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1}}\n' for s in (0, 1, 2, 1, 2)))
    assert not committed(tmp_path, 4)()  # five records, a rollback among them: step 3 is not there
    assert committed(tmp_path, 3)() and not committed(tmp_path / "none", 1)()
    assert descendants(os.getpid()) == [] or all(isinstance(p, int) for p in descendants(os.getpid()))


def test_a_teardown_that_never_returns_is_abandoned_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from recover.train.replicas import dist as train_dist

    monkeypatch.setattr(train_dist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train_dist.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(train_dist.dist, "destroy_process_group", lambda: threading.Event().wait())
    monkeypatch.setattr(train_dist, "abandoned", None)
    t0 = time.monotonic()
    train_dist.shutdown(timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert train_dist.abandoned is not None and "test_bench_linger" in train_dist.abandoned
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 3: tearing down the process group did not finish in 0.3 s" in err
    monkeypatch.setattr(train_dist.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(train_dist, "abandoned", None)
    train_dist.shutdown(timeout_s=5)
    assert train_dist.abandoned is None
    assert common.LINGER_S >= 30  # the default leaves a slow final save its time
