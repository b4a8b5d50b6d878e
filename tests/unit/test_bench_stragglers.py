"""`recover bench stragglers`: the pure parts (optimal model, steady-state selection, aggregation,
ratios, run order, argument checks), on synthetic run directories; nothing is launched."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recover.bench import stragglers as st
from recover.errors import ConfigError


def write_run(run: Path, times: list[float], quotas: dict[int, dict[str, int]] | None = None,
              rebalanced: tuple[int, ...] = ()) -> Path:
    run.mkdir(parents=True)
    rows = []
    for s, t in enumerate(times):
        row = {"step": s, "loss": 4.0, "microbatches": 16, "tokens": 2048, "time_s": t, "elapsed_s": 10.0 + s}
        if quotas and s in quotas:
            row["quotas"] = quotas[s]
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [{"t": 1.0, "kind": "launch"}] + [{"t": 2.0, "kind": "rebalanced", "step": s} for s in rebalanced]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


# ---- the makespan-optimal model ----------------------------------------------------------------

def test_optimal_model_m8_and_m16() -> None:
    m8 = st.optimal_model(0.13, 8, 4, 4.0, 0.05)
    assert m8["quotas"] == {0: 3, 1: 3, 2: 2, 3: 0}
    assert m8["compute_s"] == pytest.approx(0.15)
    assert m8["failure_free_compute_s"] == pytest.approx(0.10)
    assert m8["even_compute_s"] == pytest.approx(0.40)  # 2 microbatches at 4 x T
    assert m8["step_s"] == pytest.approx(0.13 + 0.15 - 0.10)
    assert m8["even_model_s"] == pytest.approx(0.13 + 0.40 - 0.10)
    m16 = st.optimal_model(0.23, 16, 4, 4.0, 0.05)
    assert m16["quotas"] == {0: 5, 1: 5, 2: 5, 3: 1}
    assert m16["step_s"] == pytest.approx(0.23 + 0.25 - 0.20)
    assert m16["fluid_compute_s"] == pytest.approx(16 / (3 / 0.05 + 1 / 0.2))


def test_optimal_model_has_no_room_at_1_5x_with_m8() -> None:
    m8 = st.optimal_model(0.13, 8, 4, 1.5, 0.05)
    assert m8["compute_s"] == pytest.approx(m8["even_compute_s"])  # 3 T either way
    m16 = st.optimal_model(0.23, 16, 4, 1.5, 0.05)
    assert m16["quotas"] == {0: 5, 1: 4, 2: 4, 3: 3}
    assert m16["compute_s"] < m16["even_compute_s"]


def test_optimal_model_without_reference_and_other_slow_replica() -> None:
    m = st.optimal_model(None, 8, 4, 2.0, 0.1, slow_replica=0)
    assert m["step_s"] is None and m["even_model_s"] is None
    assert m["quotas"][0] == min(m["quotas"].values())
    assert sum(m["quotas"].values()) == 8


# ---- steady state and aggregation --------------------------------------------------------------

def test_settled_times_takes_steps_from_first_step_in_order() -> None:
    rows = [{"step": 3, "time_s": 0.3}, {"step": 0, "time_s": 9.0}, {"step": 2, "time_s": 0.2},
            {"step": 1, "time_s": 5.0}]
    assert st.settled_times(rows, 2) == [0.2, 0.3]
    assert st.settled_times(rows, 10) == []


def test_steady_quotas_most_common_with_even_default() -> None:
    q = {"0": 5, "1": 5, "2": 5, "3": 1}
    rows = [{"step": s} for s in range(10)]
    for s in range(4, 10):
        rows[s]["quotas"] = dict(q)
    rows[8]["quotas"] = {"0": 5, "1": 4, "2": 5, "3": 2}  # a probe
    assert st.steady_quotas(rows, 4, 16, 4) == {0: 5, 1: 5, 2: 5, 3: 1}
    assert st.steady_quotas(rows, 0, 16, 4) == {0: 5, 1: 5, 2: 5, 3: 1}  # 5 of 10 against 4 even steps
    assert st.steady_quotas(rows[:4], 0, 16, 4) == {0: 4, 1: 4, 2: 4, 3: 4}  # no quotas: the even split
    assert st.steady_quotas(rows, 20, 16, 4) == {}


def test_run_stats_from_a_run_directory(tmp_path: Path) -> None:
    times = [0.2, 0.2, 0.8, 0.8, 0.5, 0.3, 0.3, 0.3, 0.31, 0.29, 0.6]
    run = write_run(tmp_path / "w", times, {s: {"0": 5, "1": 5, "2": 5, "3": 1} for s in range(5, 11)},
                    rebalanced=(4, 5))
    r = st.run_stats(run, 5, 11, 16, 4)
    assert r["settled_steps"] == 6
    assert r["step_s"] == pytest.approx(0.3)
    assert r["mean_s"] == pytest.approx(sum(times[5:]) / 6)
    assert r["completed"] and r["quotas"] == {"0": 5, "1": 5, "2": 5, "3": 1}
    assert r["rebalanced_steps"] == [4, 5]
    assert not st.run_stats(run, 5, 12, 16, 4)["completed"]  # a step short
    assert not st.run_stats(run, 5, 11, 16, 4, exit_code=1)["completed"]
    empty = st.run_stats(tmp_path / "missing", 5, 11, 16, 4)
    assert empty["step_s"] is None and not empty["completed"]


def test_aggregate_medians_spread_and_median_round() -> None:
    runs = [{"round": r, "step_s": x, "mean_s": x + 0.01, "completed": True, "quotas": {"0": r}}
            for r, x in enumerate([0.30, 0.27, 0.33])]
    a = st.aggregate(runs)
    assert a["step_s"] == pytest.approx(0.30)
    assert (a["min_s"], a["max_s"]) == (0.27, 0.33)
    assert a["rel_spread"] == pytest.approx(0.2)
    assert a["median_round"] == 0 and a["quotas"] == {"0": 0}
    assert a["mean_s"] == pytest.approx(0.31)
    assert a["completed"] and a["rounds"] == runs
    broken = st.aggregate([*runs, {"round": 3, "step_s": None, "mean_s": None, "completed": False, "quotas": {}}])
    assert broken["step_s"] == pytest.approx(0.30) and not broken["completed"]
    nothing = st.aggregate([{"round": 0, "step_s": None, "mean_s": None, "completed": False, "quotas": {}}])
    assert nothing["step_s"] is None and nothing["median_round"] is None


def _agg(values: list[float]) -> dict[str, object]:
    return st.aggregate([{"round": r, "step_s": x, "mean_s": x, "completed": True, "quotas": {}}
                         for r, x in enumerate(values)])


def test_assemble_ratios_and_acceptance() -> None:
    reference = _agg([0.23, 0.22, 0.24])
    systems = {4.0: {"weighted": _agg([0.28, 0.29, 0.30]), "even": _agg([0.82, 0.83, 0.84]),
                     "wait-for-slowest": _agg([0.84, 0.85, 0.86])}}
    by_factor = st.assemble(reference, systems, 16, 4, 0.05)
    entry = by_factor[0]
    opt = entry["optimal"]
    assert opt["step_s"] == pytest.approx(0.23 + 0.25 - 0.20)
    w = entry["systems"]["weighted"]
    assert w["vs_optimal"] == pytest.approx(0.29 / 0.28, rel=1e-3)
    assert w["vs_even"] == pytest.approx(0.29 / 0.83, rel=1e-3)
    assert entry["systems"]["even"]["vs_even"] == 1.0
    # paired per round: round 1's reference is 0.22, so its optimum is 0.27
    assert w["rounds"][1]["vs_optimal"] == pytest.approx(0.29 / 0.27, rel=1e-3)
    assert w["rounds"][1]["vs_even"] == pytest.approx(0.29 / 0.83, rel=1e-3)
    acc = st.acceptance(by_factor)
    assert acc is not None and acc["met"] and acc["meets_vs_optimal"] and acc["meets_vs_even"]
    systems[4.0]["weighted"] = _agg([0.45, 0.45, 0.45])
    acc = st.acceptance(st.assemble(reference, systems, 16, 4, 0.05))
    assert acc is not None and not acc["met"] and not acc["meets_vs_optimal"] and acc["meets_vs_even"]
    assert st.acceptance(st.assemble(reference, {2.0: systems[4.0]}, 16, 4, 0.05)) is None
    no_even = st.assemble(reference, {4.0: {"weighted": _agg([0.28])}}, 16, 4, 0.05)
    assert no_even[0]["systems"]["weighted"]["vs_even"] is None
    assert st.acceptance(no_even)["meets_vs_even"] is None  # type: ignore[index]


def test_ratio() -> None:
    assert st.ratio(1.0, 4.0) == 0.25
    assert st.ratio(None, 1.0) is None and st.ratio(1.0, None) is None and st.ratio(1.0, 0.0) is None


def test_factor_load_first_and_last_by_sequence() -> None:
    rows = [{"seq": 5, "load_start": [3.0, 2.0, 1.0], "load_end": [3.5, 2.0, 1.0]},
            {"seq": 1, "load_start": [1.0, 1.0, 1.0], "load_end": [1.5, 1.0, 1.0]},
            {"seq": 9, "load_start": [2.0, 2.0, 1.0], "load_end": [2.5, 2.0, 1.0]}]
    assert st.factor_load(rows) == {"before": [1.0, 1.0, 1.0], "after": [2.5, 2.0, 1.0], "min_1m": 1.0,
                                    "max_1m": 3.0}
    assert st.factor_load([])["before"] == []


# ---- run order, systems --------------------------------------------------------------------------

def test_config_names_and_system_args() -> None:
    assert st.config_name("weighted", None) == "reference"
    assert st.config_name("wait-for-slowest", 1.5) == "wait-for-slowest-x1.5"
    assert st.config_name("even", 4.0) == "even-x4"
    assert st.system_args("weighted", 4.0, 2, 4) == (None, ["--slow", "3@2:4", "--workload.policy=weighted"])
    assert st.system_args("even", 1.5, 3, 2) == (None, ["--slow", "1@3:1.5", "--workload.policy=even"])
    assert st.system_args("wait-for-slowest", 2.0, 2, 4) == ("shrink", ["--slow", "3@2:2"])
    assert st.system_args("weighted", None, 2, 4) == (None, ["--workload.policy=weighted"])


# ---- argument checks ------------------------------------------------------------------------------

def test_parse_factors() -> None:
    assert st.parse_factors("1.5, 2,4,2") == [1.5, 2.0, 4.0]
    for bad in ("", "1", "0.5", "x", "2,inf", "nan"):
        with pytest.raises(ConfigError, match="--factors"):
            st.parse_factors(bad)


def test_parse_policies() -> None:
    assert st.parse_policies("even,weighted,even") == ["even", "weighted"]
    with pytest.raises(ConfigError, match="unknown fastest"):
        st.parse_policies("weighted,fastest")
    with pytest.raises(ConfigError, match="empty"):
        st.parse_policies(" , ")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"replicas": 1}, "--replicas"),
    ({"microbatches": 3}, "--microbatches"),
    ({"rounds": 0}, "--rounds"),
    ({"device_time_s": 0.0}, "--device-time-s"),
    ({"device_time_s": float("nan")}, "--device-time-s"),
    ({"slow_step": -1}, "--slow-step"),
    ({"steps": 12}, "at least 13"),
])
def test_check_sizes_refuses(kwargs: dict[str, float], match: str) -> None:
    args = {"replicas": 4, "steps": 30, "microbatches": 16, "rounds": 3, "device_time_s": 0.05, "slow_step": 2,
            "settle_steps": 6, **kwargs}
    with pytest.raises(ConfigError, match=match):
        st.check_sizes(**args)  # type: ignore[arg-type]


def test_check_sizes_accepts_defaults() -> None:
    st.check_sizes(st.REPLICAS, st.STEPS, st.MICROBATCHES, st.ROUNDS, st.DEVICE_TIME_S, st.SLOW_STEP,
                   st.SETTLE_STEPS)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    st.add_parser(parser.add_subparsers(dest="benchmark"))
    args, extra = parser.parse_known_args(["stragglers", *argv])
    args.overrides = extra
    return args


def test_cli_defaults_and_bad_input_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parse(["--out", str(tmp_path / "out")])
    assert (args.config, args.replicas, args.steps, args.rounds) == ("debug", 4, 30, 3)
    assert st.parse_factors(args.factors) == [1.5, 2.0, 4.0]
    assert st.parse_policies(args.policies) == list(st.DEFAULT_POLICIES)

    def never(*a: object, **k: object) -> int:
        raise AssertionError("nothing may run on bad input")

    monkeypatch.setattr(st, "launch_run", never)
    monkeypatch.setattr(st, "measure_compute_s", never)
    for argv, match in ((["--factors", "1,2"], "--factors"), (["--policies", "fast"], "--policies"),
                        (["--steps", "5"], "--steps"), (["--device-time-s", "-1"], "--device-time-s"),
                        (["--training.device_time_s=0.1"], "--device-time-s"),
                        (["--workload.policy=even"], "--policies"),
                        (["--model.dim=-3"], "model.dim")):
        with pytest.raises(ConfigError, match=match):
            st.run_from_args(_parse([*argv, "--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()


def test_registered_in_bench_cli() -> None:
    from recover.bench.cli import BENCH_MODULES

    assert "recover.bench.stragglers" in BENCH_MODULES


# ---- output ---------------------------------------------------------------------------------------

def test_print_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = _agg([0.23, 0.22, 0.24])
    systems = {f: {"weighted": _agg([0.28, 0.29, 0.30]), "even": _agg([0.82, 0.83, 0.84]),
                   "wait-for-slowest": _agg([0.84, 0.85, 0.86])} for f in (2.0, 4.0)}
    by_factor = st.assemble(reference, systems, 16, 4, 0.05)
    for e in by_factor:
        e["load"] = {"before": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0], "min_1m": 1.0, "max_1m": 2.0}
    res = {"config": "debug", "replicas": 4, "steps": 30, "microbatches": 16, "rounds": 3, "slow_step": 2,
           "first_measured_step": 8, "policies": list(st.DEFAULT_POLICIES), "factors": [2.0, 4.0],
           "device": {"time_s": 0.05, "compute_s": 0.005, "compute_median_s": 0.006, "threads": 1, "cores": 2,
                      "replicas": 4, "contended_s": 0.01, "dominates": True, "reference_overhead_s": 0.03},
           "reference": reference, "by_factor": by_factor, "acceptance": st.acceptance(by_factor),
           "skipped": {"torchft": "not installed"}, "load": {"before": [1.0], "after": [2.0]},
           "bench_wall_s": 600.0, "out": str(tmp_path)}
    st.print_result(res)
    text = capsys.readouterr().out
    assert "4x slower" in text and "2x slower" in text and "optimal (model)" in text
    assert "[5,5,5,1]" in text and "met" in text and "torchft: not run (not installed)" in text
    assert "1.00/1.07/1.03" in text  # weighted against each round's own optimum (0.28, 0.27, 0.29)
    png = st.plot_results(tmp_path / "stragglers.png", res)
    assert png.is_file() and png.stat().st_size > 1000


def test_run_configs_put_the_reference_in_the_middle() -> None:
    configs = st.run_configs([1.5, 4.0], ["weighted", "even"])
    assert configs == [("weighted", 1.5), ("even", 1.5), ("weighted", None), ("weighted", 4.0), ("even", 4.0)]
    assert st.run_configs([2.0], ["even"]) == [("weighted", None), ("even", 2.0)]
    names = [st.config_name(p, f) for p, f in st.run_configs(st.FACTORS, st.DEFAULT_POLICIES)]
    assert len(names) == 10 and names[4] == "reference" and len(set(names)) == 10
