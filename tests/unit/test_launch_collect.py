"""`recover collect`: the run records of a job started without the launcher (the files it writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.errors import RecoverError
from recover.launch.collect import collect


def rec(step: int, t: float, loss: float, **extra: object) -> dict[str, object]:
    return {"t": t, "step": step, "loss": loss, "microbatches": 8, "tokens": 64, "time_s": 0.5,
            "live_replicas": 2, "generation": 1, **extra}


def test_collect_writes_metrics_summary_and_refuses_a_directory_without_records(tmp_path: Path) -> None:
    with pytest.raises(RecoverError, match="no step records"):
        collect(tmp_path)
    (tmp_path / "replicas").mkdir()
    for r in (0, 1):
        lines = [json.dumps(rec(s, 100.0 + s + r / 10, 5.0 - s, replica=r)) for s in (1, 0, 2)]
        (tmp_path / "replicas" / f"replica_{r}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "events.jsonl").write_text(json.dumps({"t": 99.0, "kind": "coordinator_start"}) + "\n"
                                           + json.dumps({"t": 103.0, "kind": "finished", "replica": 0}) + "\n")
    summary = collect(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["elapsed_s"] for r in rows] == [1.1, 2.1, 3.1]
    assert summary["committed_steps"] == 3 and summary["wall_s"] == pytest.approx(3.1) and not summary["stopped"]
    assert json.loads((tmp_path / "summary.json").read_text())["committed_tokens"] == 3 * 64
