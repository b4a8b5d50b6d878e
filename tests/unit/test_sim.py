"""The cluster simulator: analytic checks, the constant-M invariant, determinism, inputs and outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from recover.cli import main
from recover.errors import ConfigError
from recover.sim import JobSpec, StepModel, calibrate, preset, read_trace, sample_failures, simulate
from recover.sim.model import HOUR, young_daly_interval_s
from recover.sim.track import CAUSES

# 8 replicas of 8 GPUs, M = 64 (8 each), 2 s steps: t_mb = 0.25 s
SMALL = dict(gpus=64, tp=8, microbatches=64, tokens_per_microbatch=256, step_time_s=2.0, duration_s=1000.0)


def small(**changes: object) -> JobSpec:
    return JobSpec(**{**SMALL, **changes})


def one_failure(t_f: float, gpu: int = 24, **changes: object) -> JobSpec:
    return small(failures="trace", trace=((t_f, gpu),), **changes)


def test_no_failures_every_strategy_gives_the_failure_free_throughput_exactly() -> None:
    for spec in (small(failures="none"), small(failures="none", budget_gpu_h=64 * 500 / HOUR)):
        result = simulate(spec)
        run_s = min(spec.duration_s, spec.budget_gpu_s / spec.gpus)
        for name, r in result.strategies.items():
            assert r.effective_throughput == spec.failure_free_throughput, name
            assert r.elapsed_s == run_s and r.tokens == run_s / 2.0 * spec.tokens_per_step
            assert sum(r.time_lost_s.values()) == 0.0, (name, r.time_lost_s)
            assert dict(r.track.microbatches) == {64: run_s / 2.0}


def test_one_failure_checkpoint_restart_loses_exactly_the_closed_form_work() -> None:
    # checkpoint every 10 steps (20 s) + 3 s save: period P = 23 s; failure at 100.5 s
    spec = one_failure(100.5, save_s=3.0, checkpoint_interval_s=20.0, restart_s=50.0, load_s=7.0,
                       repair_s=10.0, restart_mode="replace")
    r = simulate(spec, ["checkpoint-restart"]).strategies["checkpoint-restart"]
    period, t_f = 23.0, 100.5
    last_ckpt = math.floor(t_f / period) * period  # 92.0
    resume = t_f + spec.restart_s + spec.load_s  # 157.5: full speed again (replaced within the relaunch)
    periods, rest = divmod(spec.duration_s - resume, period)
    steps = 10 * math.floor(t_f / period) + 10 * int(periods) + math.floor(rest / 2.0)
    lost = r.time_lost_s
    assert lost["lost_work"] == pytest.approx(t_f - last_ckpt, abs=1e-9) == pytest.approx(8.5)
    assert lost["restart"] == 50.0 and lost["load"] == 7.0 and lost["waiting"] == 0.0
    assert lost["checkpoint"] == pytest.approx(3.0 * (math.floor(t_f / period) + periods))
    assert r.track.steps_done == steps == 407
    assert r.tokens == steps * spec.tokens_per_step
    assert r.elapsed_s == pytest.approx(r.tokens / spec.failure_free_throughput + sum(lost.values()))


@pytest.mark.parametrize(("t_f", "hidden"), [(100.5, 1.0), (101.8, 0.2)])
def test_one_failure_recover_and_shrink_drop_closed_forms(t_f: float, hidden: float) -> None:
    spec = one_failure(t_f, recovery_latency_s=1.0, reconfig_s=4.0, rejoin=False)
    result = simulate(spec)
    rec, drop = result.strategies["recover"], result.strategies["shrink-drop"]
    # recover: step 50 (100..102) loses replica 3 (8 ids); the survivors finish their own quotas at 102, the
    # orphans start at max(102, t_f + 1 s latency) and take ceil(8/7) x 0.25 s; then 7 replicas carry
    # ceil(64/7) = 10 microbatches: 2.5 s steps. A loss at 100.5 hides all of its latency behind the
    # survivors' own work, one at 101.8 only 0.2 s of it.
    end = max(102.0, t_f + 1.0) + 0.5
    after = math.floor((1000.0 - end) / 2.5)
    assert rec.track.steps_done == 51 + after
    assert rec.time_lost_s["recovery"] == pytest.approx(1.0 - hidden) and rec.time_lost_s["recompute"] == 0.5
    assert rec.time_lost_s["fewer_replicas"] == pytest.approx(0.5 * after)
    assert rec.time_lost_s["unfinished"] == pytest.approx(1000.0 - end - 2.5 * after)
    # shrink-drop: step 50 discarded, 4 s reconfiguration, then 2 s steps of 56 microbatches
    assert drop.time_lost_s["lost_work"] == 2.0 and drop.time_lost_s["reconfig"] == 4.0
    assert dict(drop.track.microbatches) == {64: 50, 56: math.floor((1000.0 - 106.0) / 2.0)}


def test_recover_steps_always_carry_M_microbatches() -> None:
    # M = 100 over 16 replicas (quotas 7 and 6), a failure every ~20 s, replacements after 60 s
    spec = JobSpec(gpus=128, tp=8, microbatches=100, step_time_s=2.0, duration_s=3 * HOUR,
                   gpu_mttf_h=128 * 20 / HOUR, repair_s=60.0, recovery_latency_s=0.5, rejoin_cost_s=1.0, seed=3)
    result = simulate(spec)
    rec, drop = result.strategies["recover"], result.strategies["shrink-drop"]
    assert rec.failures_hit > 300
    assert set(rec.track.microbatches) == {100}
    assert rec.tokens == rec.track.steps_done * spec.tokens_per_step
    assert min(drop.track.microbatches) < 100  # the baseline that drops does shrink
    sm = StepModel(spec)
    for n in range(2, 17):
        for dead in ([0], [n - 1], [0, 1][: n - 1], [n - 1, 0, 1][: n - 1]):
            rounds = sm.failed_step(n, dead)  # raises unless the merged plan holds all 100 ids
            assert len(rounds) == len(dead) and all(x > 0 for x in rounds)
    assert sm.checked_steps > 0


def test_time_is_conserved_and_the_budget_ends_the_run() -> None:
    spec = preset("paper-512")
    result = simulate(spec)
    for name, r in result.strategies.items():
        ideal = r.tokens / spec.failure_free_throughput
        assert r.elapsed_s == pytest.approx(ideal + sum(r.time_lost_s.values()), rel=1e-9), name
        assert r.gpu_hours == pytest.approx(234.0, rel=1e-6)
        assert r.failures_hit == 8
    assert result.ratio("recover", "checkpoint-restart", "tokens_at_budget") > 1.5


def test_same_seed_same_result_and_a_new_seed_new_failures() -> None:
    spec = JobSpec(gpus=1024, tp=8, microbatches=256, step_time_s=5.0, duration_s=2 * 86400.0,
                   gpu_mttf_h=20_000.0, failures="weibull", weibull_shape=0.7, seed=11)
    a, b = simulate(spec).to_json(), simulate(spec).to_json()
    a.pop("simulation_wall_s"), b.pop("simulation_wall_s")
    assert a == b and a["failures"] > 0
    other = simulate(spec.replace(seed=12))
    assert other.to_json()["strategies"] != a["strategies"]


def test_sampled_failure_rates_match_the_mean_time_to_failure() -> None:
    gpus, mttf, horizon = 50_000, 10_000.0, 400.0  # expect 2,000 failures
    for shape in (1.0, 2.0):
        t, g = sample_failures(gpus, mttf, horizon, repair_s=0.0, seed=1, shape=shape)
        assert np.all(np.diff(t) >= 0) and t.max() < horizon and g.max() < gpus
        if shape == 1.0:
            assert abs(len(t) - 2000) < 5 * math.sqrt(2000)
        else:  # wear-out: far fewer early failures than the exponential
            assert len(t) < 200


def test_young_daly_interval_is_the_default() -> None:
    spec = small(gpu_mttf_h=64 * 2.0, save_s=10.0)  # job MTBF 2 h
    every = StepModel(spec).checkpoint_every()
    assert every == round(young_daly_interval_s(10.0, 2 * HOUR) / 2.0) == round(math.sqrt(2 * 10 * 7200) / 2)
    assert StepModel(small(failures="none")).checkpoint_every() == math.inf


def test_trace_files_parse_and_bad_lines_name_their_line(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("# time_s gpu\n\n30.5 17\n10 3  # a comment\n")
    assert read_trace(good, gpus=64) == ((10.0, 3), (30.5, 17))
    spec = small(failures="trace", trace=read_trace(good, gpus=64))
    assert simulate(spec, ["recover"]).strategies["recover"].failures_hit == 2
    for text, needle in (("12.5\n", "has 1 fields"), ("1 2\nabc 3\n", "not a number"), ("-1 2\n", ">= 0"),
                         ("5 99\n", "out of range"), ("5 x\n", "not an integer"), ("1 2 3\n", "has 3 fields")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle) as err:
            read_trace(bad, gpus=64)
        assert f"bad.txt:{text.count(chr(10))}" in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        read_trace(tmp_path / "missing.txt")


def test_bad_job_fields_are_named() -> None:
    for changes, needle in (({"gpus": 60}, "multiple of the replica size"), ({"microbatches": 4}, "microbatches"),
                            ({"failures": "poisson"}, "failures = 'poisson'"), ({"save_s": -1.0}, "save_s"),
                            ({"restart_mode": "replace", "rejoin": False}, "restart_mode")):
        with pytest.raises(ConfigError, match=needle):
            small(**changes)
    with pytest.raises(ConfigError, match="preset = 'nope'"):
        preset("nope")


def _write_run(run_dir: Path, events: bool = True) -> None:
    run_dir.mkdir()
    rows = [(0, 5.0, 4, 0)] + [(s, 1.0 + 0.1 * (s % 3), 4, 0) for s in range(1, 8)] + [(8, 3.0, 3, 1), (9, 1.3, 3, 1)]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, t, live, gen in rows:
            f.write(json.dumps({"t": 0, "step": step, "loss": 3.0, "microbatches": 8, "live_replicas": live,
                                "generation": gen, "tokens": 8 * 512, "time_s": t}) + "\n")
        f.write('{"step": 10, "time_s": 1.')  # torn last line of a killed writer
    if events:
        with open(run_dir / "events.jsonl", "w") as f:
            for rec in ({"kind": "failure", "replica": 3}, {"kind": "recovery", "latency_ms": 200.0},
                        {"kind": "recovery", "latency_ms": 400.0}, {"kind": "join"}):
                f.write(json.dumps(rec) + "\n")


def test_calibrate_from_a_synthetic_run_dir(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    cal = calibrate(tmp_path / "run")
    # full-size steps 1..7 (step 0 is warm-up; steps 8-9 ran on 3 replicas)
    assert cal.step_time_s == pytest.approx(1.1) and cal.steps_used == 7
    assert cal.recovery_latency_s == pytest.approx(0.3) and cal.recoveries == 2
    assert (cal.replicas, cal.microbatches, cal.tokens_per_step) == (4, 8, 4096)
    spec = cal.apply(small())
    assert spec.step_time_s == pytest.approx(1.1) and spec.recovery_latency_s == pytest.approx(0.3)
    _write_run(tmp_path / "no-events", events=False)
    cal = calibrate(tmp_path / "no-events")
    assert cal.recovery_latency_s is None and "events.jsonl missing" in cal.notes[0]
    assert cal.apply(small()).recovery_latency_s == small().recovery_latency_s


def test_calibrate_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        calibrate(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="metrics.jsonl is missing"):
        calibrate(tmp_path / "empty")
    (tmp_path / "no-time").mkdir()
    (tmp_path / "no-time" / "metrics.jsonl").write_text('{"step": 0, "loss": 3.0}\n')
    with pytest.raises(ConfigError, match="'time_s'"):
        calibrate(tmp_path / "no-time")


def test_cli_paper_512_writes_the_json_fields_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    assert main(["simulate", "--preset", "paper-512", "--json", str(out), "--out", str(plots)]) == 0
    text = capsys.readouterr().out
    assert "2.23x" in text and "+74.9%" in text and "after successive failures" in text and "Simulated" in text
    data = json.loads(out.read_text())
    for name in ("recover", "checkpoint-restart", "shrink-drop"):
        s = data["strategies"][name]
        assert s["effective_throughput"] > 0 and s["tokens_at_budget"] > 0
        assert set(s["time_lost_by_cause"]) == set(CAUSES)
    ratios = data["ratios"]["recover/checkpoint-restart"]
    assert ratios["effective_throughput"] > 1 and ratios["tokens_at_budget"] > 1
    assert data["paper"]["paper_throughput_ratio"] == 2.23 and data["paper"]["throughput_ratio_after_failures"] > 1
    assert sorted(p.name for p in plots.iterdir()) == ["throughput.png", "time_lost.png", "tokens.png"]


def test_cli_overrides_trace_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.txt"
    trace.write_text("100 0\n200 40\n")
    out = tmp_path / "r.json"
    argv = ["simulate", "--gpus", "64", "--tp", "8", "--microbatches", "64", "--step-time", "2", "--hours", "1",
            "--trace", str(trace), "--strategies", "recover,checkpoint-restart", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == 2 and set(data["strategies"]) == {"recover", "checkpoint-restart"}
    assert data["strategies"]["recover"]["failures_hit"] == 2
    trace.write_text("100 0\n200 640\n")
    assert main(argv) == 2
    assert "t.txt:2: gpu 640 is out of range" in capsys.readouterr().err
    assert main(["simulate", "--preset", "paper-512", "--strategies", "magic"]) == 2
    _write_run(tmp_path / "run")  # calibrated latency, but the explicit --step-time wins
    assert main([*argv[:-2], "--calibrate", str(tmp_path / "run"), "--json", str(out)]) == 2  # trace still bad
    trace.write_text("100 0\n")
    assert main([*argv[:-2], "--calibrate", str(tmp_path / "run"), "--json", str(out)]) == 0
    job = json.loads(out.read_text())["job"]
    assert job["step_time_s"] == 2.0 and job["recovery_latency_s"] == pytest.approx(0.3)
