"""`recover bench failures`: one small end-to-end run.

It uses the debug preset, 2 replicas, 6 steps and 1 round on emulated devices of
20 ms per microbatch, with the successive schedule (replica 1 dies at step 3) for the reference,
recover, checkpoint-and-restart with synchronous and with asynchronous saves, and shrink-and-drop
(2 replicas rather than 4 keep it short: each system's start-up dominates), and checks what the
benchmark is for: recover keeps M microbatches in every step and the reference's losses,
shrink-and-drop drops below M, restarting costs wall time, an asynchronous save blocks training
for less than a synchronous one, the reference ran first, and the emulated device time held every
step. The pure parts are tested in tests/unit/test_bench_failures_runs.py, the statistics over rounds in
tests/unit/test_bench_failures_stats.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recover.bench import failures
from recover.bench.common import windows
from recover.observe.plots import load_metrics


@pytest.mark.slow
@pytest.mark.long
def test_bench_failures_end_to_end(tmp_path: Path, corpus: Path) -> None:
    parser = argparse.ArgumentParser()
    failures.add_parser(parser.add_subparsers())
    json_path = tmp_path / "bench.json"
    device_s = 0.02
    args, extra = parser.parse_known_args(
        ["failures", "--config", "debug", "--replicas", "2", "--steps", "6", "--rounds", "1", "--device-time-s",
         str(device_s), "--systems", "recover,restart-async,shrink",
         "--out", str(tmp_path / "out"), "--json", str(json_path), "--timeout", "240",
         "--data.path", str(corpus), "--training.eval_every=3"])
    args.overrides = extra
    assert args.func(args) == 0
    res = json.loads(json_path.read_text())
    by = {s["name"]: s for s in res["systems"]}
    assert set(by) == {"reference", "recover", "restart-async", "shrink"}  # restart: the same path, synchronous saves
    for s in by.values():
        for key in ("name", "wall_s", "effective_tokens_per_s", "max_rel_loss_dev", "min_microbatches",
                    "ratio_vs_recover", "vs_ideal", "rel_spread", "final_val_loss"):
            assert s[key] is not None, (s["name"], key)
        assert s["completed"] and s["committed_steps"] == 6
        assert [x["round"] for x in s["rounds"]] == [0] and s["exit_codes"] == [0]
        tps = [x["effective_tokens_per_s"] for x in s["rounds"]]
        assert s["effective_tokens_per_s"] == pytest.approx(tps[0], abs=0.01)
        assert s["tokens_per_s_min"] == s["tokens_per_s_max"] == tps[0]
        assert s["run_dir"] == str(tmp_path / "out" / f"round{s['median_round']}" / s["name"])
        for x in s["rounds"]:  # the busiest replica of every step computed >= 2 emulated microbatches
            assert min(r["time_s"] for r in load_metrics(x["run_dir"])) >= 2 * device_s
    start = {s["name"]: windows(Path(s["rounds"][0]["run_dir"]))["launch_t"] for s in by.values()}
    assert min(start, key=start.__getitem__) == "reference"  # round 0 runs the reference first
    assert res["rounds"] == 1 and res["device"]["time_s"] == device_s and res["device"]["compute_s"] > 0
    assert res["schedule"]["fails"] == ["1@3:backward"]
    assert all(x["failures"] == 0 and x["committed_steps"] == 6 for x in by["reference"]["rounds"])
    assert by["recover"]["failures"] == 1 and by["recover"]["min_microbatches"] == 8
    assert by["recover"]["max_rel_loss_dev"] < 1e-5
    assert by["shrink"]["min_microbatches"] < 8 and by["shrink"]["dropped_steps"] >= 1
    restart = by["restart-async"]
    assert restart["min_microbatches"] == 8 and restart["restarts"] == 1
    assert restart["max_rel_loss_dev"] < 1e-5  # resumed from a complete checkpoint
    assert restart["effective_tokens_per_s"] < by["recover"]["effective_tokens_per_s"]
    # restarting costs time: its failure loses more than recover's (the whole runs' wall times include each
    # system's start-up, which a loaded machine stretched past the restart's loss once: not compared)
    assert restart["time_lost_per_failure_s"] > by["recover"]["time_lost_per_failure_s"] and restart["checkpoint_async"]
    yd = res["young_daly"]  # Young/Daly of the asynchronous saves (no synchronous restart system ran)
    assert yd["async"]["save_cost_s"] > 0 and yd["async"]["checkpoint_every"] >= 1
    ideal = res["ideal"]
    assert ideal["tokens_per_s"] > 0 and ideal["recover_fraction"] == by["recover"]["vs_ideal"] > 0
    assert len(ideal["recover_fraction_per_round"]) == 1
    assert (tmp_path / "out" / "loss.png").is_file() and (tmp_path / "out" / "throughput.png").is_file()
