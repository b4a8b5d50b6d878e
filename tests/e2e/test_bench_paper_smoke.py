"""`recover bench paper` end to end, at its smallest: the whole pipeline through real launches.

2 replicas (one lost), 2 seeds, 8 steps of the debug preset on emulated devices, no further replica
counts: the four systems of each seed, the failure-free calibration run at 1 replica, the
deterministic pair, the report with its plots and the JSON with its four lists. The statistics and
the simulator's check are unit-tested on fakes in tests/unit/test_bench_paper.py; this test proves
that the command drives real runs into them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.cli import main


@pytest.mark.slow
@pytest.mark.long
def test_bench_paper_runs_the_whole_pipeline(tmp_path: Path, corpus: Path) -> None:
    out, js = tmp_path / "out", tmp_path / "paper.json"
    code = main(["bench", "paper", "--quick", "--seeds", "2", "--steps", "8", "--replicas", "2", "--scale", "none",
                 "--out", str(out), "--json", str(js), "--data.path", str(corpus)])
    assert code == 0, (out / "PAPER.md").read_text() if (out / "PAPER.md").exists() else "no report"
    res = json.loads(js.read_text())
    traj = {r["system"]: r for r in res["trajectory"] if not r.get("deterministic")}
    assert set(traj) == {"failure-free", "recover", "checkpoint-and-restart", "shrink-and-drop"}
    assert all(len(r["final_val_loss"]) == 2 and r["completed"] for r in traj.values())
    assert traj["recover"]["min_microbatches"] == 8 and traj["shrink-and-drop"]["min_microbatches"] < 8
    assert res["bitwise"]["bitwise_equal"] and res["bitwise"]["steps"] == 8
    assert {r["system"] for r in res["throughput"]} >= {"recover", "checkpoint-and-restart"}
    assert {r["system"] for r in res["budget"]} == {"recover", "checkpoint-and-restart", "shrink-and-drop"}
    assert [p["replicas"] for p in res["calibration"]] == [1] and res["calibration"][0]["start_s"] > 0
    sim = res["simulator"]
    assert {r["system"] for r in sim} == {"recover", "checkpoint-and-restart", "shrink-and-drop"}
    assert all(r["measured"] > 0 and r["simulated"] is not None and r["calibrated"] for r in sim)
    for name in ("PAPER.md", "trajectory.png", "budget.png", "simulator.png", "results.json"):
        assert (out / name).is_file(), name
    again = main(["bench", "paper", "--quick", "--seeds", "2", "--steps", "8", "--replicas", "2", "--scale", "none",
                  "--out", str(out), "--json", str(js), "--resume", "--data.path", str(corpus)])
    assert again == 0 and json.loads(js.read_text())["trajectory"] == res["trajectory"]  # read back, not rerun
