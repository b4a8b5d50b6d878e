"""`recover launch --baseline shrink` drops exactly the steps torchft drops (see recover.baselines.steps).

One launch of 4 replicas of the `debug` preset (M = 8, shares of 2 microbatches) with three real
SIGKILLs: replica 1 after its step-2 all-reduce (``commit``), replica 2 in the backward of step 4,
replica 3 between steps 6 and 7 (``idle``). Only the backward kill drops a step.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_recover

STEPS = 10


def test_shrink_drops_only_a_step_whose_all_reduce_broke(corpus: Path, tmp_path: Path) -> None:
    run_recover(["launch", "--config", "debug", "--replicas", "4", "--steps", str(STEPS), "--out", str(tmp_path),
                 "--no-progress", "--data.path", str(corpus), "--training.eval_every=100", "--baseline", "shrink",
                 "--fail", "1@2:commit", "--fail", "2@4:backward", "--fail", "3@6:idle"], timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    # step 2 commits all 4 shares although replica 1 died before voting; step 4 is dropped once and
    # redone on the next data with 2 replicas; the idle kill after step 6 drops nothing
    assert [r["microbatches"] for r in rows] == [8, 8, 8, 6, 4, 4, 4, 2, 2, 2]
    assert [r["data_step"] - r["step"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    dropped = {e["step"] for e in events if e["kind"] == "step_dropped"}
    assert dropped == {4}
    assert {e["step"] for e in events if e["kind"] == "step_kept"} == {2}
    assert {e["step"] for e in events if e["kind"] == "quorum_reformed"} == {7}
