"""`recover bench failures` over rounds: run order, medians, spread and ratios (pure parts, no run),
and how a benchmark stops a child that outlives its time limit."""

from __future__ import annotations

import pytest

from recover.bench import failures
from recover.bench.common import contended_compute_s, round_orders, spread
from recover.faults import FailureSchedule


def run_row(name: str, r: int, tps: float, **extra: object) -> dict:
    """A per-round row with the fields :func:`failures.aggregate_rounds` reads."""
    row = {"name": name, "label": name, "round": r, "load": [1.0, 1.0, 1.0], "exit_code": 0, "completed": True,
           "effective_tokens_per_s": tps, "wall_s": 10.0 + r, "startup_s": 2.0, "train_s": 1000.0 / tps,
           "time_lost_per_failure_s": None, "min_microbatches": 8, "max_rel_loss_dev": 0.0, "final_val_loss": 2.5,
           "failures": 0, "run_dir": f"out/round{r}/{name}"}
    row.update(extra)
    return row


def test_round_orders_alternate_forward_and_reversed() -> None:
    assert round_orders(["ref", "a", "b"], 3) == [["ref", "a", "b"], ["b", "a", "ref"], ["ref", "a", "b"]]
    assert round_orders(["ref", "a"], 1) == [["ref", "a"]]
    # over an even number of rounds every system's mean position is the same
    orders = round_orders(["ref", "a", "b", "c"], 4)
    positions = {s: sum(order.index(s) for order in orders) for s in orders[0]}
    assert len(set(positions.values())) == 1


def test_spread_is_median_min_max_and_relative_range() -> None:
    assert spread([90.0, 110.0, 100.0]) == {"median": 100.0, "min": 90.0, "max": 110.0,
                                            "rel_spread": pytest.approx(0.2)}
    assert spread([4.0, 2.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "rel_spread": pytest.approx(2 / 3)}
    assert spread([5.0])["rel_spread"] == 0.0
    assert spread([]) == {"median": None, "min": None, "max": None, "rel_spread": None}
    assert spread([0.0, 0.0])["rel_spread"] is None


def test_median_round_is_the_lower_middle() -> None:
    rows = [run_row("x", 0, 300.0), run_row("x", 1, 100.0), run_row("x", 2, 200.0)]
    assert failures.median_round(rows)["round"] == 2
    assert failures.median_round(rows[:2])["round"] == 1  # even count: the lower of the two middle ones
    assert failures.median_round([run_row("x", 1, 5.0), run_row("x", 0, 5.0)])["round"] == 0  # ties by round
    with pytest.raises(ValueError):
        failures.median_round([])


def test_aggregate_rounds_medians_spread_and_extremes() -> None:
    rows = [run_row("shrink", 0, 900.0, min_microbatches=4, max_rel_loss_dev=0.1, time_lost_per_failure_s=2.0),
            run_row("shrink", 1, 1100.0, min_microbatches=6, max_rel_loss_dev=0.3, time_lost_per_failure_s=1.0),
            run_row("shrink", 2, 1000.0, min_microbatches=6, max_rel_loss_dev=0.2, time_lost_per_failure_s=4.0,
                    final_val_loss=2.6)]
    agg = failures.aggregate_rounds(rows)
    assert agg["effective_tokens_per_s"] == 1000.0
    assert (agg["tokens_per_s_min"], agg["tokens_per_s_max"]) == (900.0, 1100.0)
    assert agg["rel_spread"] == pytest.approx(0.2)
    assert agg["min_microbatches"] == 4 and agg["max_rel_loss_dev"] == 0.3
    assert agg["time_lost_per_failure_s"] == 2.0 and agg["wall_s"] == 11.0  # medians
    assert agg["median_round"] == 2 and agg["final_val_loss"] == 2.6 and agg["run_dir"] == "out/round2/shrink"
    assert agg["completed"] and agg["exit_codes"] == [0, 0, 0] and agg["rounds"] == rows
    assert not set(failures.RUN_KEYS) & set(agg)  # per-run fields stay in the rounds


def test_aggregate_rounds_keeps_incomplete_rounds_out_of_the_medians() -> None:
    rows = [run_row("restart", 0, 500.0),
            {"name": "restart", "round": 1, "completed": False, "exit_code": 124, "error": "no committed step"},
            run_row("restart", 2, 700.0, completed=False, exit_code=1)]
    agg = failures.aggregate_rounds(rows)
    assert agg["effective_tokens_per_s"] == 600.0 and agg["median_round"] == 0
    assert not agg["completed"] and agg["exit_codes"] == [0, 124, 1]
    with pytest.raises(ValueError, match="no round"):
        failures.aggregate_rounds(rows[1:2])


def test_assemble_ratios_of_medians_and_paired_rounds() -> None:
    ref = failures.aggregate_rounds([run_row("reference", r, tps) for r, tps in enumerate((1000.0, 1200.0, 800.0))])
    rec = failures.aggregate_rounds([run_row("recover", r, tps) for r, tps in enumerate((900.0, 1000.0, 600.0))])
    restart = failures.aggregate_rounds([run_row("restart", r, tps) for r, tps in enumerate((450.0, 400.0, 350.0))])
    rows = [ref, rec, restart]
    sched = FailureSchedule(["1@2:backward"])  # 4 steps: live 4, 4, 3, 3
    ideal = failures.assemble(rows, sched, 4, 4)
    expected = failures.ideal_tokens_per_s(1000.0, [4, 4, 3, 3], 4)  # of the reference's median
    assert expected == pytest.approx(1000.0 * 4 / (1 + 1 + 4 / 3 + 4 / 3))
    assert ideal["tokens_per_s"] == pytest.approx(expected, abs=0.01)
    assert ideal["reference_tokens_per_s"] == 1000.0
    assert rec["vs_ideal"] == pytest.approx(900.0 / expected, abs=1e-4) == ideal["recover_fraction"]
    assert rec["vs_failure_free"] == 0.9 and ideal["recover_vs_failure_free"] == 0.9
    assert restart["ratio_vs_recover"] == round(400 / 900, 4) and restart["vs_failure_free"] == 0.4
    assert ref["vs_ideal"] == pytest.approx(1000.0 / expected, abs=1e-4)
    # paired per round: against that round's reference and recover
    per_round = [failures.ideal_tokens_per_s(t, [4, 4, 3, 3], 4) for t in (1000.0, 1200.0, 800.0)]
    assert [x["vs_ideal"] for x in rec["rounds"]] == pytest.approx(
        [t / i for t, i in zip((900.0, 1000.0, 600.0), per_round, strict=True)], abs=1e-4)
    assert ideal["recover_fraction_per_round"] == [x["vs_ideal"] for x in rec["rounds"]]
    assert [x["ratio_vs_recover"] for x in restart["rounds"]] == [0.5, 0.4, pytest.approx(0.5833, abs=1e-4)]


def test_assemble_without_reference_or_recover_gives_no_ratio() -> None:
    shrink = failures.aggregate_rounds([run_row("shrink", 0, 500.0)])
    ideal = failures.assemble([shrink], FailureSchedule(["1@2:backward"]), 4, 4)
    assert ideal == {"tokens_per_s": None, "reference_tokens_per_s": None, "recover_fraction": None,
                     "recover_fraction_per_round": None, "recover_vs_failure_free": None}
    assert shrink["vs_ideal"] is None and shrink["ratio_vs_recover"] is None and shrink["vs_failure_free"] is None
    assert shrink["rounds"][0]["vs_ideal"] is None


def test_device_time_dominates_contended_compute() -> None:
    # 4 one-thread replicas on 2 cores: each microbatch's compute takes twice as long
    assert contended_compute_s(0.065, 4, 1, 2) == pytest.approx(0.13)
    assert contended_compute_s(0.065, 2, 1, 4) == pytest.approx(0.065)  # never faster than alone
    assert failures.device_dominates(0.25, 0.13)
    assert not failures.device_dominates(0.15, 0.13)
    assert not failures.device_dominates(0.0, 0.0)  # real compute only


def test_table_shows_spread_only_over_several_rounds() -> None:
    one = failures.aggregate_rounds([run_row("recover", 0, 1000.0)])
    three = failures.aggregate_rounds([run_row("recover", r, t) for r, t in enumerate((900.0, 1000.0, 1100.0))])
    failures.assemble([one], FailureSchedule([]), 4, 4)
    failures.assemble([three], FailureSchedule([]), 4, 4)
    cells = failures.table_rows([one, three])
    spread_col = failures.COLUMNS.index("spread")
    assert [row[spread_col] for row in cells] == ["-", "20.0%"]
    assert [row[failures.COLUMNS.index("eff. tok/s")] for row in cells] == ["1,000", "1,000"]
