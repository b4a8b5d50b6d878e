"""`recover bench failures`, the pure parts: Young/Daly's interval, the successive schedule, the live timeline,
windows and step intervals, and the system rows, ratios, table and JSON built from synthetic run directories as
`recover launch` writes them; arguments refused before any run. The end-to-end run is
tests/e2e/test_bench_failures.py; the statistics over rounds are tests/unit/test_bench_failures_stats.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recover.bench import failures
from recover.bench.common import step_intervals, windows
from recover.errors import ConfigError
from recover.faults import FailureSchedule

T0 = 1_000_000.0
TOKENS = 1024  # per full step (M = 8 microbatches of 128 tokens)


def write_run(run: Path, step_s: float, losses: list[float], microbatches: list[int] | None = None,
              kills: tuple[tuple[int, float], ...] = (), startup_s: float = 5.0,
              gap_after: dict[int, float] | None = None, val_loss: float = 3.0) -> Path:
    """A run directory as `recover launch` writes it: steps of ``step_s``, optional pauses and kills."""
    run.mkdir(parents=True)
    microbatches = microbatches or [8] * len(losses)
    events = [{"t": T0, "kind": "launch"}, {"t": T0 + startup_s, "kind": "generation", "generation": 1}]
    rows, t = [], startup_s
    for step, (loss, mb) in enumerate(zip(losses, microbatches, strict=True)):
        t += step_s + (gap_after or {}).get(step - 1, 0.0)
        rec = {"step": step, "loss": loss, "microbatches": mb, "tokens": TOKENS * mb // 8, "time_s": step_s,
               "elapsed_s": round(t, 6), "live_replicas": 4, "generation": 1}
        if step == len(losses) - 1:
            rec["val_loss"] = val_loss
        rows.append(rec)
    for step, at in kills:
        events.append({"t": T0 + at, "kind": "kill", "replica": 1, "step": step})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"wall_s": t + 1.0, "recovery_latency_ms_median": 50.0}))
    return run



def test_young_daly_interval_in_steps() -> None:
    # sqrt(2 * 0.05 s * 90 s) = 3 s = 6 steps of 0.5 s
    assert failures.young_daly_steps(0.05, 90.0, 0.5) == 6
    assert failures.young_daly_steps(0.0, 90.0, 0.5) == 1  # free checkpoints: every step, never 0
    assert failures.young_daly_steps(2.0, 10_000.0, 1.0) == round(math.sqrt(40_000.0))
    for bad in ((-1.0, 90.0, 0.5), (0.05, 0.0, 0.5), (0.05, 90.0, math.inf)):
        with pytest.raises(ConfigError):
            failures.young_daly_steps(*bad)


def test_successive_schedule_loses_half_the_replicas_at_spaced_steps() -> None:
    assert [str(s) for s in failures.successive_schedule(4, 60)] == ["1@20:backward", "2@40:reduce"]
    assert [str(s) for s in failures.successive_schedule(2, 10)] == ["1@5:backward"]
    assert len(failures.successive_schedule(8, 90, min_replicas=6)) == 2  # capped by min_replicas
    with pytest.raises(ConfigError, match="too short"):
        failures.successive_schedule(4, 3)


def test_live_timeline_and_ideal_throughput() -> None:
    sched = FailureSchedule(["1@2:backward", "2@3:reduce"])
    live = failures.live_timeline(sched, 4, 5)
    assert live == [4, 4, 3, 2, 2]
    # step times relative to failure-free: 1, 1, 4/3, 2, 2 -> 5 steps in 22/3 units
    assert failures.ideal_tokens_per_s(1200.0, live, 4) == pytest.approx(1200.0 * 5 / (22 / 3))
    assert failures.ideal_tokens_per_s(1200.0, [4, 4], 4) == pytest.approx(1200.0)
    assert failures.ideal_tokens_per_s(0.0, live, 4) == 0.0


def test_windows_and_step_intervals(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", 0.5, [5.0, 4.0, 3.0, 2.0], startup_s=7.0, gap_after={1: 3.0})
    w = windows(run)
    assert w["startup_s"] == pytest.approx(7.0)
    assert w["train_s"] == pytest.approx(4 * 0.5 + 3.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert step_intervals(rows) == pytest.approx([0.5, 3.5, 0.5])
    assert step_intervals(rows, skip=1) == pytest.approx([3.5, 0.5])


@pytest.fixture
def synthetic(tmp_path: Path) -> list[dict]:
    """Reference, recover, restart and shrink rows from synthetic run directories (10 steps, 2 kills)."""
    losses = [5.0 - 0.2 * s for s in range(10)]
    ref = failures.system_row("reference", write_run(tmp_path / "reference", 1.0, losses), None)
    kills = ((3, 8.5), (6, 11.5))
    rec = failures.system_row("recover", write_run(tmp_path / "recover", 1.0, [x * (1 + 1e-7) for x in losses],
                                                   kills=kills, gap_after={3: 0.5, 6: 0.5}), ref)
    restart = failures.system_row("restart", write_run(tmp_path / "restart", 1.0, losses, kills=kills,
                                                       gap_after={3: 20.0, 6: 20.0}), ref)
    shrink_losses = losses[:3] + [x * 1.1 for x in losses[3:]]
    shrink = failures.system_row("shrink", write_run(tmp_path / "shrink", 1.0, shrink_losses,
                                                     microbatches=[8, 8, 8, 6, 6, 6, 4, 4, 4, 4], kills=kills), ref)
    return [ref, rec, restart, shrink]


def test_system_rows_measure_throughput_loss_and_lost_time(synthetic: list[dict]) -> None:
    ref, rec, restart, shrink = synthetic
    assert ref["train_s"] == pytest.approx(10.0) and ref["effective_tokens_per_s"] == pytest.approx(1024.0)
    assert rec["train_s"] == pytest.approx(11.0)
    assert rec["time_lost_per_failure_s"] == pytest.approx(0.5)  # (11 s - 10 s of failure-free work) / 2
    assert rec["max_rel_loss_dev"] == pytest.approx(1e-7, rel=1e-3)
    assert rec["min_microbatches"] == 8 and rec["failures"] == 2 and rec["completed"]
    assert restart["time_lost_per_failure_s"] == pytest.approx(20.0)
    assert restart["vs_failure_free"] == pytest.approx(10 / 50, rel=1e-3)
    assert shrink["min_microbatches"] == 4
    assert shrink["committed_tokens"] == 1024 * 3 + 768 * 3 + 512 * 4
    assert shrink["max_rel_loss_dev"] == pytest.approx(0.1)
    # shrink's 10 s hold 7.25 failure-free steps' worth of tokens: 2.75 s lost, 1.375 s per failure
    assert shrink["time_lost_per_failure_s"] == pytest.approx(1.375)
    assert shrink["final_val_loss"] == 3.0


def test_assemble_ratios_ideal_table_and_json(synthetic: list[dict], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rows = [failures.aggregate_rounds([row | {"round": 0, "load": [1.0]}]) for row in synthetic]
    ref, rec, restart, shrink = rows
    sched = FailureSchedule(["1@3:backward", "2@6:reduce"])
    ideal = failures.assemble(rows, sched, 4, 10)
    assert rec["ratio_vs_recover"] == 1.0
    assert restart["ratio_vs_recover"] == pytest.approx(11 / 50, rel=1e-3)
    live = [4, 4, 4, 3, 3, 3, 2, 2, 2, 2]
    assert ideal["tokens_per_s"] == pytest.approx(failures.ideal_tokens_per_s(1024.0, live, 4), rel=1e-4)
    assert ideal["recover_fraction"] == pytest.approx(rec["effective_tokens_per_s"] / ideal["tokens_per_s"], rel=1e-3)
    device = {"time_s": 0.25, "compute_s": 0.065, "threads": 1, "replicas": 4, "cores": 2, "contended_s": 0.13,
              "dominates": True}
    res = {"config": "debug", "replicas": 4, "steps": 10, "microbatches": 8, "rounds": 1, "device": device,
           "systems": rows, "ideal": ideal,
           "schedule": {"kind": "successive", "fails": [str(s) for s in sched], "mtbf_s": 5.0},
           "young_daly": {"save_cost_s": 0.05, "save_total_s": 0.05, "mtbf_s": 5.0, "step_time_s": 1.0,
                          "checkpoint_every": 1, "async": {"save_cost_s": 0.004, "save_total_s": 0.06,
                                                           "checkpoint_every": 1}},
           "skipped": {"torchft": "torchft does not import"}, "load": {"before": [1.0], "after": [1.5]},
           "bench_wall_s": 99.0, "out": str(tmp_path)}
    failures.print_result(res)
    text = capsys.readouterr().out
    for expected in ("reference", "recover", "ckpt-restart", "shrink-and-drop", "1@3:backward 2@6:reduce",
                     "torchft: not run (torchft does not import)", "Young/Daly K = 1",
                     "checkpoint-and-restart (sync): save blocks C = 50 ms",
                     "checkpoint-and-restart (async): save blocks C = 4 ms (whole save 60 ms)",
                     "emulated devices: every microbatch takes >= 250 ms", "one round (--rounds 1)",
                     "1 round(s), device time 0.25 s"):
        assert expected in text
    cells = failures.table_rows(rows)
    assert [r[failures.COLUMNS.index("min mb/step")] for r in cells] == ["8", "8", "8", "4"]
    assert [r[failures.COLUMNS.index("x recover")] for r in cells][1] == "1.000"
    res["device"], res["rounds"] = device | {"time_s": 0.1, "dominates": False}, 3
    failures.print_result(res)
    text = capsys.readouterr().out
    assert "WARNING: below 1.5 x the contended compute" in text and "medians over 3 rounds" in text
    res["device"] = device | {"time_s": 0.0, "dominates": False}
    failures.print_result(res)
    assert "real compute only (--device-time-s 0)" in capsys.readouterr().out
    paths = failures.plot_results(tmp_path, rows, "median round of 3")
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_bad_arguments_are_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--systems"):
        failures.run_bench(config="debug", systems=["recover", "nope"], out=tmp_path)
    with pytest.raises(ConfigError, match="--schedule"):
        failures.run_bench(config="debug", schedule_kind="weekly", out=tmp_path)
    with pytest.raises(ConfigError, match="too short"):
        failures.run_bench(config="debug", steps=3, out=tmp_path)
    with pytest.raises(ConfigError, match=r"^--rounds 0: at least 1"):
        failures.run_bench(config="debug", rounds=0, out=tmp_path)
    with pytest.raises(ConfigError, match="--device-time-s"):
        failures.run_bench(config="debug", device_time_s=-0.1, out=tmp_path)
    with pytest.raises(ConfigError, match="with --device-time-s instead"):
        failures.run_bench(config="debug", overrides=["--training.device_time_s", "0.1"], out=tmp_path)
    assert not any(tmp_path.iterdir())
