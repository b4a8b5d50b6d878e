"""Goodput on synthetic records: the effective training time ratio and the time lost by cause."""

from __future__ import annotations

import pytest

from recover.observe.goodput import CAUSES, goodput


def commits(times: dict[int, float]) -> list[dict]:
    return [{"t": t, "kind": "commit", "generation": 1, "step": s} for s, t in times.items()]


def row(step: int, **kw: object) -> dict:
    return {"step": step, "loss": 1.0, "microbatches": 8, "tokens": 100, "time_s": 1.0, "live_replicas": 4, **kw}


def run(steps: int, t0: float = 0.0, first: float = 5.0, step_s: float = 1.0) -> tuple[dict[int, float], list[dict]]:
    """Commit times of a clean run: the first step commits ``first`` s after the launch, then one every
    ``step_s``; and its launch event."""
    return ({s: t0 + first + s * step_s for s in range(steps)},
            [{"t": t0, "kind": "launch", "replicas": 4, "steps": steps}])


def check_total(g) -> None:
    assert g.useful_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)
    assert 0.0 <= g.ratio <= 1.0 and set(g.lost_s) <= set(CAUSES)


def test_a_failure_free_run_loses_only_its_startup_and_shutdown() -> None:
    times, events = run(10)
    events += commits(times) + [{"t": 14.5, "kind": "end"}]
    g = goodput([row(s) for s in range(10)], events)
    check_total(g)
    assert g.planned_step_s == pytest.approx(1.0) and g.wall_s == pytest.approx(14.5)
    assert g.useful_s == pytest.approx(10.0) and g.ratio == pytest.approx(10 / 14.5)
    assert g.lost_s == pytest.approx({"startup": 4.0, "other": 0.5})
    assert g.ratio_after_startup == pytest.approx(10 / 10.5)
    assert g.tokens == 1000 and g.committed_steps == 10
    assert g.to_dict()["lost_s"]["recovery"] == 0.0


def test_each_cause_gets_exactly_the_time_over_the_planned_step() -> None:
    """Steps 3..9 each carry one cause; the others take the planned 1 s."""
    extra = {3: 2.0, 5: 0.5, 6: 0.3, 7: 0.2, 8: 0.4, 9: 0.2, 10: 1.0}  # seconds over 1 s
    t, times = 5.0, {0: 5.0}
    for s in range(1, 15):
        t += 1.0 + extra.get(s, 0.0)
        times[s] = t
    events = [{"t": 0.0, "kind": "launch", "replicas": 4}, *commits(times),
              {"t": times[2] + 0.1, "kind": "kill", "replica": 1, "fault": "kill"},
              {"t": times[2] + 0.2, "kind": "failure_detected", "replica": 1, "cause": "connection_closed"},
              {"t": times[4] + 0.1, "kind": "grew", "replica": 0, "step": 5},
              {"t": times[5] + 0.4, "kind": "checkpoint", "replica": 0, "step": 6, "blocking_s": 0.3},
              {"t": times[9] + 0.5, "kind": "coordinator_exit", "code": -9},
              {"t": times[14] + 0.25, "kind": "end"}]
    rows = [row(s) for s in range(15)]
    rows[3]["failures"] = [[1]]
    rows[6]["eval_s"] = 0.2  # the evaluation after step 6 delays step 7
    rows[8]["stragglers"] = {"3": 2.0}
    rows[9]["live_replicas"] = 3
    g = goodput(rows, events)
    check_total(g)
    assert g.planned_step_s == pytest.approx(1.0)
    assert g.lost_s == pytest.approx({"startup": 4.0, "recovery": 2.0, "rejoin": 0.5, "checkpoint": 0.3,
                                      "evaluation": 0.2, "stragglers": 0.4, "degraded": 0.2, "restart": 1.0,
                                      "other": 0.25})
    assert g.useful_s == pytest.approx(15.0)
    assert [s.lost for s in g.steps if s.step == 3] == [pytest.approx({"recovery": 2.0})]


def test_an_injected_slow_down_counts_as_stragglers_before_the_coordinator_names_it() -> None:
    times, events = run(8)
    times = {s: t + (0.5 * min(s - 3, 3) if s > 3 else 0.0) for s, t in times.items()}  # 3 slow steps from 4
    events += [*commits(times), {"t": times[3] + 0.01, "kind": "slowed", "replica": 2, "factor": 3.0},
               {"t": times[6] + 0.01, "kind": "slowed", "replica": 2, "factor": 1.0}]
    g = goodput([row(s) for s in range(8)], events)
    check_total(g)
    assert g.lost_s["stragglers"] == pytest.approx(1.5) and "other" not in g.lost_s


def test_a_resumed_run_counts_the_redone_steps_and_both_startups_but_not_the_time_offline() -> None:
    """Launch 1 commits steps 0..6 and stops at t=13; its checkpoint is after step 4, so launch 2
    (t=100, after 87 s offline) redoes steps 5 and 6: what launch 1 did after step 4 is lost."""
    first, events = run(7)
    events += [*commits(first), {"t": 13.0, "kind": "end"}]
    second = {s: 100.0 + 6.0 + (s - 5) for s in range(5, 10)}
    events += [{"t": 100.0, "kind": "launch", "replicas": 4, "resume_step": 5}, *commits(second),
               {"t": 110.0, "kind": "end"}]
    g = goodput([row(s) for s in range(10)], events)
    check_total(g)
    assert g.wall_s == pytest.approx(23.0)
    # restart: launch 1 after step 4 (4 s: steps 5 and 6 done for nothing, and the stop), launch 2
    # until step 5 commits (6 s, 1 s of it the step itself)
    assert g.lost_s == pytest.approx({"startup": 4.0, "restart": 4.0 + 5.0})
    assert g.useful_s == pytest.approx(10.0)


def test_ratio_bounds_and_edge_cases() -> None:
    assert goodput([], []).ratio == 0.0 and goodput([], []).wall_s == 0.0
    times, events = run(5)
    events += commits(times)
    g = goodput([row(s) for s in range(5)], events, planned_step_s=10.0)  # a plan slower than the run: capped
    check_total(g)
    assert g.ratio == pytest.approx(1.0) and g.lost_s == {}  # no end event: the launch ends at its last commit
    # no events at all (recover train): from the first step's start to the last record
    rows = [row(s, t=50.0 + s, time_s=1.0) for s in range(4)]
    g = goodput(rows, [])
    check_total(g)
    assert g.wall_s == pytest.approx(4.0) and g.ratio == pytest.approx(1.0)
