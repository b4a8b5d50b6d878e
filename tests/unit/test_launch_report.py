"""What a run directory says: recovery latencies per kill."""

from __future__ import annotations

from recover.launch.report import recovery_latencies


def kill(t: float, replica: int, **kw: object) -> dict:
    return {"t": t, "kind": "kill", "replica": replica, "step": 0, "phase": "forward", **kw}


def recovered(t: float, replica: int, dead: list[int]) -> dict:
    return {"t": t, "kind": "recovered", "replica": replica, "dead": dead}


def test_a_replica_killed_twice_has_two_latencies_each_its_own() -> None:
    """Replica 2 killed at t=10, rejoins, killed again at t=30; replica 3 joined in between and only
    recovers from the second kill: the first kill's latency must not stretch to the second."""
    events = [kill(10.0, 2), recovered(10.05, 0, [2]), recovered(10.08, 1, [2]),
              kill(30.0, 2), recovered(30.02, 0, [2]), recovered(30.03, 1, [2]), recovered(30.04, 3, [2])]
    lat = recovery_latencies(events)
    assert [(x["replica"], x["latency_ms"], x["survivors"]) for x in lat] == [(2, 80.0, [0, 1]), (2, 40.0, [0, 1, 3])]


def test_an_external_kill_is_timed_from_when_the_coordinator_saw_it() -> None:
    events = [recovered(5.03, 0, [1]), kill(5.5, 1, source="external", at=5.0)]  # logged after its exit
    assert [x["latency_ms"] for x in recovery_latencies(events)] == [30.0]
