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


def test_each_fault_is_timed_from_injection_to_detection_to_recovery_and_rejoin() -> None:
    """A crash, a hang, a straggler and a corruption, each found by its own check."""
    from recover.launch.report import incidents

    ev = [
        kill(10.0, 1, fault="kill"),
        {"t": 10.03, "kind": "failure_detected", "replica": 1, "cause": "connection_closed"},
        recovered(10.05, 0, [1]), recovered(10.06, 2, [1]),
        {"t": 12.0, "kind": "state_received", "replica": 1, "step": 9},
        kill(20.0, 2, fault="hang"),
        {"t": 23.0, "kind": "failure_detected", "replica": 2, "cause": "hung"},
        recovered(23.01, 0, [2]),
        {"t": 30.0, "kind": "slowed", "replica": 3, "step": 30, "factor": 4.0},
        {"t": 30.5, "kind": "rebalanced", "step": 33, "speeds": {}},
        {"t": 30.5, "kind": "straggler", "replica": 3, "step": 33, "slowdown": 4.0},
        {"t": 40.0, "kind": "injected", "replica": 0, "fault": "corrupt", "step": 40},
        {"t": 40.1, "kind": "divergent", "replicas": [0], "majority": [1, 2, 3], "step": 40},
        {"t": 40.11, "kind": "failure_detected", "replica": 0, "cause": "fenced"},
        recovered(40.13, 1, [0]),
    ]
    got = [(f["fault"], f["replica"], f["detected_by"], f["detection_ms"], f["recovery_ms"], f["rejoin_s"])
           for f in incidents(ev)]
    assert got == [("crash", 1, "connection_closed", 30.0, 30.0, 2.0), ("hang", 2, "hung", 3000.0, 10.0, None),
                   ("straggler", 3, "straggler", 500.0, 0.0, None), ("corruption", 0, "divergent", 110.0, 20.0, None)]


def test_a_loss_nobody_injected_is_timed_from_its_detection_and_counted_by_cause() -> None:
    """A cluster recipe's job has no launcher to write ``kill``: a node's death is known only from the
    coordinator's detection, and it still counts as a recovery (a launcher's kill is not counted twice)."""
    from recover.launch.report import failures_detected

    ev = [kill(5.0, 3, source="external", at=5.0),
          {"t": 5.01, "kind": "failure_detected", "replica": 3, "cause": "connection_closed"},
          recovered(5.03, 0, [3]),
          {"t": 9.0, "kind": "failure_detected", "replica": 1, "cause": "connection_closed"},
          {"t": 9.002, "kind": "generation", "members": [0, 2], "dead": [1], "step": 14},
          recovered(9.006, 0, [1]), recovered(9.011, 2, [1]),
          {"t": 12.0, "kind": "failure_detected", "replica": 2, "cause": "hung"}, recovered(12.004, 0, [2])]
    lat = recovery_latencies(ev)
    assert [(x["replica"], x["step"], x["latency_ms"], x["survivors"]) for x in lat] == [
        (3, 0, 30.0, [0]), (1, 14, 11.0, [0, 2]), (2, None, 4.0, [0])]
    assert failures_detected(ev) == {"connection_closed": 2, "hung": 1}


def test_a_coordinator_start_is_a_restart_only_while_its_job_runs() -> None:
    """The first start, and the first start of a requeued or resumed job, are not restarts; a start after
    the coordinator died mid-run is, whoever started it (a launcher, a cluster recipe's script)."""
    from recover.launch.report import coordinator_restarts

    start, launch = {"kind": "coordinator_start"}, {"kind": "launch"}
    stopped, finished = {"kind": "stopped", "replica": 0}, {"kind": "finished", "replica": 0}
    assert coordinator_restarts([start, {"kind": "generation"}, stopped, start, start, finished]) == 1
    assert coordinator_restarts([launch, start, start, {"kind": "coordinator_exit"}, start]) == 2
    assert coordinator_restarts([launch, start, stopped, launch, start, finished]) == 0
