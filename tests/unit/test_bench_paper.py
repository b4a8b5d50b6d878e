"""``recover bench paper`` on fake run results: the statistics, the budget, the simulator check and the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from recover.bench import paperstats as st
from recover.bench.paper import QUICK, plan_from_args
from recover.bench.papereval import assemble, evaluate
from recover.bench.paperreport import write_report
from recover.bench.paperruns import Plan
from recover.errors import ConfigError

T, OVERHEAD, M, R, STEPS, TPM, LATENCY = 0.1, 0.02, 8, 4, 30, 100, 0.3
KILL_STEPS = (10, 20)


OVH = {n: OVERHEAD for n in range(1, R + 1)}
"""Step overhead by live replicas (a test may make it fall as replicas die, as on shared cores)."""
RELAUNCH = {n: 3.0 for n in range(1, R + 1)}
"""Relaunch cost by replicas relaunched."""


def step_time(n: int) -> float:
    return OVH[n] + math.ceil(M / n) * T


def fake_recover() -> dict[str, Any]:
    """recover as the simulator models it: a kill at 90% of a step's own work; the survivors start the orphans
    once their own quota is done and the loss detected (the latency), then reduce (the overhead)."""
    t, n, series, kills = 0.0, R, [], []
    for s in range(STEPS):
        dur = step_time(n)
        if s in KILL_STEPS:
            quota = math.ceil(M / n)
            own = dur - OVH[n]
            kills.append([t + 0.9 * own, n - 1])
            dur = max(own, 0.9 * own + LATENCY) + math.ceil(quota / (n - 1)) * T + OVH[n]
            n -= 1
        t += dur
        series.append([t, n, (s + 1) * M * TPM])
    return {"series": series, "kills": kills, "n_end": n}


def fake_restart() -> dict[str, Any]:
    """Checkpoint every 4 steps; a kill loses the steps since, then a 3 s relaunch on the survivors."""
    t, n, series, kills, s, done = 0.0, R, [], [], 0, set()
    while s < STEPS:
        if s in KILL_STEPS and s not in done:
            done.add(s)
            kills.append([t + step_time(n) / 2, n - 1])
            t += step_time(n) / 2 + RELAUNCH[n - 1] + step_time(n - 1)
            n -= 1
            s = s - s % 4
        t += step_time(n)
        series.append([t, n, (s + 1) * M * TPM])
        s += 1
        if s % 4 == 0:
            t += 0.05
    return {"series": series, "kills": kills}


def fake_seed(plan: Plan, seed: int, out: Path, log: Any) -> dict[str, Any]:
    base = 2.0 + 0.01 * seed
    rec, rst = fake_recover(), fake_restart()
    ff = [[(s + 1) * step_time(R), R, (s + 1) * M * TPM] for s in range(STEPS)]
    shrink = [[(s + 1) * step_time(R), R, (s + 1) * M * TPM] for s in range(STEPS)]

    def run(series: list[list[float]], kills: list[list[float]], val: float) -> dict[str, Any]:
        return {"completed": True, "final_val_loss": val, "losses": [5.0 - 0.1 * i for i in range(STEPS)],
                "train_s": series[-1][0], "tokens": series[-1][2], "series": series, "kills": kills,
                "max_rel_loss_dev": 0.0, "min_microbatches": M}

    return {"seed": seed, "load": [1.0], "wall_s": 1.0, "schedule": ["1@10:backward", "2@20:reduce"],
            "inputs": {"replicas": R, "microbatches": M, "tokens_per_microbatch": TPM, "step_time_s": step_time(R),
                       "device_time_s": T, "recovery_latency_s": LATENCY, "reconfig_s": 0.2, "restart_s": 3.0,
                       "save_s": 0.05, "checkpoint_every": 4,
                       "relaunches": [[R - 1 - i, RELAUNCH[R - 1 - i]] for i in range(len(KILL_STEPS))]},
            "systems": {"failure-free": run(ff, [], base), "recover": run(rec["series"], rec["kills"], base + 0.002),
                        "checkpoint-and-restart": run(rst["series"], rst["kills"], base + 0.001),
                        "shrink-and-drop": run(shrink, [[1.0, 1]], base + 0.5)}}


PLAN = Plan(config="debug", replicas=R, steps=STEPS, seeds=(0, 1, 2, 3, 4), device_time_s=T, label="quick")


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    seeds = [fake_seed(PLAN, s, Path("."), print) for s in PLAN.seeds]
    return assemble(PLAN, seeds, {"system": "recover", "seed": 0, "deterministic": True, "steps": STEPS,
                                  "bitwise_equal": True}, scenarios=("paper-512",))


def test_the_paired_test_compares_each_seed_with_its_own_reference() -> None:
    worse = st.paired_test([1.0, 2.0, 3.0, 4.0, 5.0], [1.1, 2.05, 3.2, 4.1, 5.07])
    assert worse["worse"] == 5 and worse["mean_diff"] == pytest.approx(0.104)
    assert worse["p_paired"] == pytest.approx(2 / 32)  # all five signs alike: the 2 extreme of 32 patterns
    same = st.paired_test([1.0, 2.0, 3.0], [1.0 - 1e-7, 2.0 + 1e-7, 3.0])
    assert same["worse"] == 1 and same["p_paired"] == pytest.approx(1.0)


def test_prediction_interval_and_permutation_test() -> None:
    m, s, low, high = st.prediction_interval([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0)
    assert high - m == pytest.approx(4.303 * math.sqrt(1 + 1 / 3))
    assert st.permutation_p([10.0, 11.0, 12.0], [0.0, 1.0, 2.0]) == pytest.approx(2 / 20)  # the 2 extreme splits
    assert st.permutation_p([1.0, 2.0], [1.0, 2.0]) == 1.0
    with pytest.raises(ValueError):
        st.prediction_interval([1.0])


def test_budget_curve_charges_live_replicas_and_undoes_rollbacks() -> None:
    gpu, tok = st.budget_curve([[1.0, 4, 10], [2.0, 4, 20], [4.0, 3, 10]])  # a rollback to 10 tokens
    assert gpu.tolist() == [0.0, 4.0, 8.0, 14.0]
    assert st.tokens_at(gpu, tok, 8.5).tolist() == 20.0
    assert st.after_failures([[1.0, 4, 10], [2.0, 4, 20], [4.0, 3, 40]], 1.5) == pytest.approx(30 / 2.5)


def test_json_lists_each_row_naming_its_system(result: dict[str, Any]) -> None:
    for key in ("trajectory", "throughput", "budget", "simulator"):
        assert result[key] and all("system" in row for row in result[key]), key
    assert {r["system"] for r in result["throughput"]} == {"failure-free", "recover", "checkpoint-and-restart",
                                                           "shrink-and-drop"}
    assert all(r["measured"] and r["simulated"] is not None for r in result["simulator"])
    json.dumps(result)  # plain data


def test_trajectory_test_places_each_system(result: dict[str, Any]) -> None:
    by = {r["system"]: r for r in result["trajectory"] if not r.get("deterministic")}
    assert by["recover"]["test"]["all_inside"] and by["checkpoint-and-restart"]["test"]["all_inside"]
    assert not by["shrink-and-drop"]["test"]["all_inside"]
    assert by["shrink-and-drop"]["test"]["p_permutation"] < 0.05
    assert len(by["recover"]["final_val_loss"]) == 5
    assert "test" not in by["failure-free"]  # the reference is not tested against itself


def test_recover_beats_restart_at_the_budget_and_after_failures(result: dict[str, Any]) -> None:
    thr = {r["system"]: r for r in result["throughput"]}
    assert thr["recover"]["vs_checkpoint_restart"] > 1.0
    bud = {r["system"]: r for r in result["budget"]}
    assert bud["recover"]["gain_vs_checkpoint_restart"][-1] > 0


def test_simulator_reproduces_runs_built_to_its_model(result: dict[str, Any]) -> None:
    rec = [r for r in result["simulator"] if r["system"] == "recover"]
    assert len(rec) == 10 and all(r["within"] for r in rec), rec
    proj = {(r["scenario"], r["costs"]) for r in result["projections"]}
    assert proj == {("paper-512", "assumed"), ("paper-512", "measured, scaled to the step time")}


def fake_calibration(plan: Plan, out: Path, log: Any) -> dict[str, Any]:
    """What failure-free runs at fewer replicas would measure under the fakes' model."""
    return {"points": [{"replicas": k, "step_time_s": step_time(k), "overhead_s": OVH[k], "start_s": RELAUNCH[k]}
                       for k in plan.calibration_counts()]}


def test_calibration_by_live_count_follows_a_host_whose_costs_change_with_the_replicas(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Overhead falling as replicas die and relaunches cheaper with fewer replicas (as on 2 shared cores):
    one step overhead and one relaunch cost miss; the overhead per live count from failure-free runs and
    the relaunch cost per replicas relaunched (from the other seeds) do not."""
    monkeypatch.setattr(f"{__name__}.OVH", {1: 0.0, 2: 0.005, 3: 0.05, 4: 0.1})
    monkeypatch.setattr(f"{__name__}.RELAUNCH", {1: 1.0, 2: 1.0, 3: 6.0, 4: 8.0})
    seeds = [fake_seed(PLAN, s, Path("."), print) for s in PLAN.seeds]
    assert PLAN.calibration_counts() == [2, 3]
    flat_seeds = [{**s, "inputs": {k: v for k, v in s["inputs"].items() if k != "relaunches"}} for s in seeds]
    flat = assemble(PLAN, flat_seeds, None, scenarios=())
    cal = assemble(PLAN, seeds, None, scenarios=(), calibration=fake_calibration(PLAN, Path("."), print))

    def errors(res: dict[str, Any], system: str) -> list[float]:
        return [abs(r["error"]) for r in res["simulator"]
                if r["system"] == system and r["measure"] == "effective_tokens_per_s"]

    assert max(errors(cal, "recover")) <= 0.02 < 0.05 < max(errors(flat, "recover"))
    assert max(errors(cal, "checkpoint-and-restart")) <= 0.05  # one step of the fake in 30
    from recover.bench.papersim import job_spec

    spec = job_spec("checkpoint-and-restart", seeds[0]["inputs"], [], 10.0)
    assert spec.restart_by_replicas == ((2, 1.0), (3, 6.0)) and spec.restart_for(3) == 6.0
    assert all(r["calibrated"] and r["replicas"] == R and r["costs_from"] == "other seeds" for r in cal["simulator"])
    assert [p["replicas"] for p in cal["calibration"]] == [2, 3]


def test_scale_plans_add_simulator_rows_at_their_replica_count() -> None:
    seeds = [fake_seed(PLAN, s, Path("."), print) for s in PLAN.seeds[:2]]
    other = dataclasses.replace(PLAN, seeds=(0, 1), label="scale")
    res = assemble(PLAN, seeds, None, scenarios=(), scale=[(other, seeds, fake_calibration(other, Path("."), print))])
    assert len(res["scale"]) == 1 and res["scale"][0]["replicas"] == R
    assert {r["calibrated"] for r in res["simulator"]} == {False, True}
    assert len(res["simulator"]) == 2 * 2 * 3 * 2  # two parts x two seeds x three systems x two measures


def test_evaluate_with_an_injected_runner_writes_the_report(tmp_path: Path) -> None:
    res = evaluate(PLAN, tmp_path, runner=fake_seed,
                   bitwise_runner=lambda p, o, log: {"system": "recover", "seed": 0, "deterministic": True,
                                                     "steps": STEPS, "bitwise_equal": True},
                   show_progress=False, scenarios=(), calibration_runner=fake_calibration)
    paths = write_report(res, tmp_path)
    assert {p.name for p in paths} == {"trajectory.png", "budget.png", "simulator.png", "PAPER.md"}
    text = (tmp_path / "PAPER.md").read_text()
    assert "bitwise equal" in text and "within 10%" in text and "Wall time" in text
    assert res["wall_s"] >= 0


def test_resume_reads_back_the_seeds_of_the_same_plan(tmp_path: Path) -> None:
    calls: list[int] = []

    def runner(plan: Plan, seed: int, out: Path, log: Any) -> dict[str, Any]:
        calls.append(seed)
        return fake_seed(plan, seed, out, log)

    def bitwise(p: Plan, o: Path, log: Any) -> dict[str, Any]:
        calls.append(-1)
        return {"system": "recover", "seed": 0, "deterministic": True, "steps": STEPS, "bitwise_equal": True}

    first = evaluate(PLAN, tmp_path, runner=runner, bitwise_runner=bitwise, show_progress=False, scenarios=(),
                     calibration_runner=fake_calibration)
    assert calls == [*PLAN.seeds, -1]
    again = evaluate(PLAN, tmp_path, runner=runner, bitwise_runner=bitwise, show_progress=False, scenarios=(),
                     resume=True, calibration_runner=fake_calibration)
    assert calls == [*PLAN.seeds, -1]  # nothing ran again
    assert again["trajectory"] == first["trajectory"] and again["simulator"] == first["simulator"]
    other = dataclasses.replace(PLAN, steps=PLAN.steps + 1)
    evaluate(other, tmp_path, runner=runner, bitwise_runner=bitwise, show_progress=False, scenarios=(), resume=True,
             calibration_runner=fake_calibration)
    assert calls == [*PLAN.seeds, -1] * 2  # another plan's stages are not reused


def test_problems_fail_the_command(result: dict[str, Any]) -> None:
    from recover.bench.paper import problems_of

    assert problems_of(result) == []
    bad = {**result, "bitwise": {**result["bitwise"], "bitwise_equal": False},
           "trajectory": [{**result["trajectory"][1], "completed": False}]}
    assert problems_of(bad) == ["recover did not complete every run",
                                "deterministic mode: recover's losses are not bitwise equal to its failure-free run's"]


def test_plan_flags() -> None:
    assert plan_from_args(argparse.Namespace(quick=True, seeds=None, steps=None, replicas=None)) == QUICK
    assert plan_from_args(argparse.Namespace(quick=True, seeds=5, steps=None, replicas=8)).seeds == (0, 1, 2, 3, 4)
    with pytest.raises(ConfigError, match="--seeds 1"):
        plan_from_args(argparse.Namespace(quick=False, seeds=1, steps=None, replicas=None))
    with pytest.raises(ConfigError, match="--steps 8 is too short to lose 8 of 16"):
        plan_from_args(argparse.Namespace(quick=True, seeds=None, steps=8, replicas=16))
    with pytest.raises(ConfigError, match="--replicas 1"):
        plan_from_args(argparse.Namespace(quick=False, seeds=None, steps=None, replicas=1))
    flags = {"quick": False, "seeds": None, "steps": None, "replicas": None}
    assert [p.replicas for p in plan_from_args(argparse.Namespace(**flags, scale=None)).scale] == [8, 16]
    assert [p.replicas for p in plan_from_args(argparse.Namespace(**flags, scale="12")).scale] == [12]
    assert plan_from_args(argparse.Namespace(**flags, scale="none")).scale == ()
    with pytest.raises(ConfigError, match="--scale 8,x"):
        plan_from_args(argparse.Namespace(**flags, scale="8,x"))


def write_run(run_dir: Path) -> None:
    """A checkpoint-and-restart run: steps 0-2, replica 1 killed, relaunched from step 1 on 3 replicas."""
    run_dir.mkdir()
    events = [{"t": 1000.0, "kind": "launch"}, {"t": 1002.0, "kind": "generation", "generation": 1},
              {"t": 1005.5, "kind": "kill", "replica": 1, "step": 3},
              {"t": 1005.6, "kind": "job_restart", "resume_step": 1, "lost_steps": 2}]
    rows = [(0, 3.0, 4), (1, 4.0, 4), (2, 5.0, 4), (1, 12.0, 3), (2, 13.0, 3), (3, 14.0, 3), (4, 15.0, 3)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1.0, "elapsed_s": e, "live_replicas": n, "tokens": 1024, "time_s": 1.0}) + "\n"
        for s, e, n in rows))


def test_a_run_directory_is_read_back_with_its_rollback_and_relaunch(tmp_path: Path) -> None:
    from recover.bench.paperruns import _reconfig_s, _relaunch_s, read_run

    run = tmp_path / "restart"
    write_run(run)
    row = {"run_dir": str(run), "train_s": 13.0, "completed": True, "committed_tokens": 5 * 1024,
           "final_val_loss": 1.0}
    got = read_run(row)
    assert got["kills"] == [[3.5, 1]]
    assert [s[2] for s in got["series"]] == [1024, 2048, 3072, 2048, 3072, 4096, 5120]  # the rollback undone
    assert [s[1] for s in got["series"]] == [4, 4, 4, 3, 3, 3, 3]
    assert got["losses"] == [1.0] * 5
    assert _relaunch_s(row) == pytest.approx(1012.0 - 1005.5 - 1.0)  # kill -> first commit after, minus a step
    assert _reconfig_s(row) == pytest.approx(1012.0 - 1005.0 - 2.0)
