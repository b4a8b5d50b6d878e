"""``recover bench coordinator`` end to end on a tiny layout: a real coordinator process, one client
process, one kill per connection layout (a few seconds)."""

from __future__ import annotations

import pytest

from recover.bench.coordinator import run


@pytest.mark.parametrize("connections", ["rank", "replica"])
def test_bench_kills_a_replica_and_times_the_failure_round(connections: str) -> None:
    res = run("4x3", connections, rounds=1, steady_s=0.3, procs=2, step_s=0.2, log=lambda _: None)
    (rnd,) = res["rounds"]
    per_conn = 1 if connections == "replica" else 3
    assert res["connection_count"] == 4 * per_conn and rnd["clients"] == 3 * per_conn  # the survivors
    assert rnd["victim"] == 3 and rnd["generation"] >= 2 and res["fenced"] == 0
    assert 0 < rnd["median_ms"] <= rnd["max_ms"] < 10_000
    assert rnd["coord_round_ms"] is not None and 0 <= rnd["coord_cpu_pct"] < 200
    assert res["heartbeat_s"] == 0.1  # a job this small keeps the configured interval
