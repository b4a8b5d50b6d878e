"""`recover bench overhead` and the torchft runner: the pure parts, on synthetic run directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recover.bench import overhead, torchft_runner
from recover.errors import ConfigError


def write_metrics(run: Path, elapsed: list[float], val_loss: float = 3.0) -> Path:
    run.mkdir(parents=True)
    rows = [{"step": s, "loss": 4.0, "microbatches": 8, "tokens": 1024, "time_s": 0.1, "elapsed_s": e,
             "live_replicas": 4, "generation": 1} for s, e in enumerate(elapsed)]
    rows[-1]["val_loss"] = val_loss
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_step_time_is_the_pooled_median_after_warmup(tmp_path: Path) -> None:
    # round 0: a 5 s warm-up step, then 1.0 s steps; round 1: 1.2 s steps
    r0 = write_metrics(tmp_path / "r0", [5.0, 10.0, 11.0, 12.0, 13.0])
    r1 = write_metrics(tmp_path / "r1", [5.0, 10.0, 11.2, 12.4, 13.6], val_loss=2.5)
    st = overhead.system_stats("recover", [r0, r1], warmup=1)
    assert st["intervals"] == 6
    assert st["step_time_s"] == pytest.approx(1.1)
    assert st["step_time_s_per_round"] == pytest.approx([1.0, 1.2])
    assert st["final_val_loss"] == 2.5
    assert overhead.system_stats("x", [r0], warmup=0)["step_time_s"] == pytest.approx(1.0)  # the 5 s gap is one


def test_the_step_in_which_a_save_began_is_timed_against_the_others(tmp_path: Path) -> None:
    # 1.0 s steps; saves of steps 4 and 8 (after steps 3 and 7 committed): steps 4 and 8 took 1.3 s, 5 and 9 1.1 s
    elapsed, t = [], 0.0
    for s in range(11):
        t += {4: 1.3, 8: 1.3, 5: 1.1, 9: 1.1}.get(s, 1.0)
        elapsed.append(t)
    run = write_metrics(tmp_path / "r0", elapsed)
    (run / "events.jsonl").write_text("".join(json.dumps({"t": 0, "kind": "checkpoint", "step": s, "replica": r}) + "\n"
                                              for s in (4, 8) for r in (0, 1)))
    st = overhead.system_stats("recover-ckpt", [run], warmup=1)
    assert st["save_step_ratio"] == pytest.approx(1.3) and st["next_step_ratio"] == pytest.approx(1.1)
    assert st["saves_timed"] == 2
    assert "save_step_ratio" not in overhead.system_stats("recover", [write_metrics(tmp_path / "r1", elapsed)], 1)


def test_own_cpu_is_the_replicas_own_and_background_cpu_and_the_coordinators_share_over_compute(
        tmp_path: Path) -> None:
    # 2 replicas x 4 steps (1 warm-up): compute 100 ms, own 0.5 ms, background 0.2 ms per replica-step; the
    # coordinator spent 0.08 s from its start to its end over the run's 8 replica-steps: 10 ms each, 6 of them timed
    runs = []
    for r, own in enumerate((0.5, 1.5)):  # round 1's replicas spent 1.5 ms of their own
        run = write_metrics(tmp_path / f"r{r}", [1.0, 2.0, 3.0, 4.0])
        (run / "replicas").mkdir()
        for rid in range(2):
            (run / "replicas" / f"replica_{rid}.jsonl").write_text("".join(json.dumps(
                {"step": s, "loss": 4.0, "cpu_ms": {"step": 200.0, "compute": 100.0, "reduce": 50.0, "update": 49.5,
                                                    "own": own, "background": 0.2}}) + "\n" for s in range(4))
                + "{torn")
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
            {"t": 0, "kind": "coordinator_start", "cpu_s": 1.5},  # its start-up is not the steps'
            {"t": 9, "kind": "coordinator_ended", "cpu_s": 1.58})))
        runs.append(run)
    one = overhead.run_own_cpu(runs[0], warmup=1)
    assert one is not None
    assert one["training_thread"] == pytest.approx(0.005) and one["client_threads"] == pytest.approx(0.002)
    assert one["coordinator"] == pytest.approx(0.1)  # 10 ms of the coordinator's per 100 ms of compute
    assert one["own_cpu_fraction"] == pytest.approx(0.107)
    st = overhead.system_stats("recover", runs, warmup=1)
    assert st["own_cpu_fraction"] == pytest.approx((0.107 + 0.117) / 2)
    assert st["own_cpu_fraction_spread"] == pytest.approx(0.01)
    assert st["own_cpu_parts"]["training_thread"] == pytest.approx(0.01)
    plain = write_metrics(tmp_path / "ddp", [1.0, 2.0, 3.0])
    assert "own_cpu_fraction" not in overhead.system_stats("ddp", [plain], warmup=1)  # not a recover launch


def test_a_steps_cpu_record_leaves_recovers_own_work_after_its_parts() -> None:
    from recover.train.processes.loop import cpu_record

    ms = cpu_record(0.2, 0.001, {"compute": 0.15, "reduce": 0.03, "update": 0.015})
    assert ms == {"step": 200.0, "compute": 150.0, "reduce": 30.0, "update": 15.0, "own": 5.0, "background": 1.0}
    assert cpu_record(0.1, 0.0, {"compute": 0.2})["own"] == 0.0  # never negative (clocks read apart)


def test_ratios_against_recover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = overhead.system_stats("recover", [write_metrics(tmp_path / "a", [0.0, 1.03, 2.06, 3.09])], 0)
    ddp = overhead.system_stats("ddp", [write_metrics(tmp_path / "b", [0.0, 1.0, 2.0, 3.0])], 0)
    tft = overhead.system_stats("torchft", [write_metrics(tmp_path / "c", [0.0, 1.5, 3.0, 4.5])], 0)
    rows = [rec, ddp, tft]
    result = overhead.assemble(rows)
    assert rec["ratio_vs_recover"] == 1.0
    assert ddp["ratio_vs_recover"] == pytest.approx(1 / 1.03, rel=1e-3)
    assert ddp["paired_ratio_vs_recover"] == pytest.approx(1 / 1.03, rel=1e-3)
    assert result == {"ddp": pytest.approx(1.03), "torchft": pytest.approx(1.03 / 1.5, rel=1e-3)}
    res = {"config": "debug", "replicas": 4, "steps": 4, "microbatches": 8, "warmup": 0, "rounds": 1,
           "systems": rows, "recover_overhead": result, "skipped": {}, "load": {"before": [1.0], "after": [1.0]},
           "bench_wall_s": 12.0}
    overhead.print_result(res)
    text = capsys.readouterr().out
    assert "1030.0" in text and "1.030" in text and "torch DistributedDataParallel" in text


def test_overhead_arguments(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    overhead.add_parser(parser.add_subparsers())
    args = parser.parse_args(["overhead", "--steps", "12", "--rounds", "1", "--json", "x.json"])
    assert (args.steps, args.rounds, args.warmup, args.json) == (12, 1, 5, "x.json")
    assert args.func is overhead.run_from_args
    with pytest.raises(ConfigError, match="must include recover"):
        overhead.run_bench(systems=["ddp"], out=tmp_path)
    with pytest.raises(ConfigError, match="warmup"):
        overhead.run_bench(config="debug", steps=5, warmup=4, out=tmp_path)


def test_torchft_runner_commands_and_merge(tmp_path: Path) -> None:
    cmd = torchft_runner._replica_cmd("py", 1, "http://lh:1", "debug", 4, 10, tmp_path,
                                      ["1@2:backward", "2@5:reduce", "1@7:idle"], ["--training.lr=0.01"])
    assert cmd[cmd.index("--replica") + 1] == "1"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--fail"] == ["1@2:backward", "1@7:idle"]
    assert cmd[-1] == "--training.lr=0.01"
    reps = tmp_path / "replicas"
    reps.mkdir()
    (reps / "replica_0.jsonl").write_text(
        json.dumps({"t": 105.0, "step": 0, "loss": 4.0, "tokens": 1, "microbatches": 8}) + "\n"
        + json.dumps({"t": 106.0, "step": 1, "loss": 3.0, "tokens": 1, "microbatches": 6, "val_loss": 2.9}) + "\n")
    (reps / "replica_3.jsonl").write_text(
        json.dumps({"t": 105.5, "step": 0, "loss": 4.0, "tokens": 1, "microbatches": 8}) + "\n")
    assert torchft_runner._merge_metrics(tmp_path, 100.0) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["elapsed_s"], r["microbatches"]) for r in rows] == [(0, 5.0, 8), (1, 6.0, 6)]
    assert rows[1]["val_loss"] == 2.9 and "t" not in rows[0]


def test_torchft_availability_names_the_reason(tmp_path: Path) -> None:
    ok, why = torchft_runner.torchft_available(str(tmp_path / "no-such-python"))
    assert not ok and "no-such-python" in why
