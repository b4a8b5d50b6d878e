"""``recover bench gpu``'s CPU smoke run (the debug preset, 4 steps, 1 round): the plain loop, ``recover
train`` and ``recover launch --replicas 1`` each report a step time and their ratio to the plain loop,
and the kill run ends with both replicas live and every step M microbatches. Numbers are not checked
(the CPU is shared); the pure parts are unit-tested in tests/unit/test_bench_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_recover


def test_the_cpu_smoke_run_measures_three_systems_and_a_kill_with_a_rejoin(tmp_path: Path, corpus: Path) -> None:
    result = tmp_path / "bench.json"
    run_recover(["bench", "gpu", "--device", "cpu", "--presets", "debug", "--no-compile", "--dtype", "float32",
                 "--steps", "4", "--warmup", "1", "--rounds", "1", "--out", str(tmp_path / "runs"), "--json",
                 str(result), f"--data.path={corpus}"], timeout=400)
    res = json.loads(result.read_text())
    entry = res["presets"]["debug"]
    assert list(entry["systems"]) == ["plain", "train", "launch"]
    assert all(s["step_s"] > 0 and s["mfu"] is None for s in entry["systems"].values())
    assert entry["train_over_plain"] > 0 and entry["launch_over_plain"] > 0
    kill = res["kill"]
    assert kill["ok"], kill
    assert kill["steps"] == kill["expected_steps"] and kill["microbatches"] == [8]
    assert kill["live_min"] == 1 and kill["live_after"] == 2 and kill["rejoined_at"] > kill["kill_step"]
