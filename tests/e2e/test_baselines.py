"""`recover launch --baseline shrink` drops exactly the steps torchft drops (see recover.baselines.steps).

One launch of 4 replicas of the `debug` preset (M = 8, shares of 2 microbatches) with three real
SIGKILLs: replica 1 after its step-2 all-reduce (``commit``), replica 2 in the backward of step 4,
replica 3 between steps 6 and 7 (``idle``). The backward kill drops its step. The commit kill keeps its
step when every survivor's all-reduce had completed before it learnt of the death, and drops it when one
had not (the rule: commit only what every survivor reduced): which one depends on how soon the death is
seen, now about a millisecond after the kill (the launcher's death watch), so both are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import NO_PLOTS, run_recover

STEPS = 10


def test_shrink_drops_only_a_step_whose_all_reduce_broke(corpus: Path, tmp_path: Path) -> None:
    run_recover(["launch", NO_PLOTS,
                 "--config", "debug", "--replicas", "4", "--steps", str(STEPS), "--out", str(tmp_path),
                 "--no-progress", "--data.path", str(corpus), "--training.eval_every=100", "--baseline", "shrink",
                 "--fail", "1@2:commit", "--fail", "2@4:backward", "--fail", "3@6:idle"], timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    kept = {e["step"] for e in events if e["kind"] == "step_kept"}
    dropped = {e["step"] for e in events if e["kind"] == "step_dropped"}
    if kept:  # step 2 commits all 4 shares although replica 1 died before voting; step 4 is dropped once and
        # redone on the next data with 2 replicas; the idle kill after step 6 drops nothing
        assert kept == {2} and dropped == {4}
        assert [r["microbatches"] for r in rows] == [8, 8, 8, 6, 4, 4, 4, 2, 2, 2]
        assert [r["data_step"] - r["step"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    else:  # a survivor had not completed step 2's all-reduce: step 2 is dropped, redone with 3 replicas on the
        # next data (dropped again by the backward kill), then with 2; the idle kill drops nothing
        assert dropped == {2, 3}
        assert [r["microbatches"] for r in rows] == [8, 8, 6, 4, 4, 4, 4, 2, 2, 2]
        assert [r["data_step"] - r["step"] for r in rows] == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert {e["step"] for e in events if e["kind"] == "quorum_reformed"} == {7}
