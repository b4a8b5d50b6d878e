"""The supervisor's watch over replica processes: fences reaped, kills accounted for, rejoins, the end.

Replicas here are ``sleep`` processes (milliseconds to start): what is under test is the supervisor's
bookkeeping, not a worker.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from recover.config import load_config
from recover.launch.job import LaunchOptions
from recover.launch.processes import LOST, ReplicaProcesses, spawn
from recover.launch.supervisor import Supervisor
from recover.observe.events import EventLog, read_jsonl


def sleeper(tmp_path: Path, rid: int) -> ReplicaProcesses:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return ReplicaProcesses(rid, [spawn(["sleep", "60"], tmp_path / "logs" / f"r{rid}.log", {})], time.time(), False)


def test_fenced_replicas_are_reaped_kills_are_told_apart_and_everything_ends(tmp_path: Path) -> None:
    cfg = load_config("debug", ["--parallel.replicas=3", "--fault_tolerance.min_replicas=1"])
    events = EventLog(tmp_path / "events.jsonl")
    sup = Supervisor(LaunchOptions(config=cfg, out=tmp_path, rejoin_after_s=30.0, rejoin_replicas=frozenset({2})),
                     events, say=print)
    sup.replicas = {rid: sleeper(tmp_path, rid) for rid in range(3)}
    try:
        now, grace = time.time(), cfg.fault_tolerance.fence_exit_s + 1.0
        sup.on_event({"t": now, "kind": "failure_detected", "replica": 0, "cause": "hang"}, now)
        sup.on_event({"t": now, "kind": "failure_detected", "replica": 1, "cause": "left"}, now)  # not a fence
        sup.reap_fenced(now + grace / 2)
        assert sup.replicas[0].running() and sup.fenced_at == {0: now}
        sup.reap_fenced(now + grace)
        assert not sup.replicas[0].running() and not sup.fenced_at
        os.kill(sup.pid(2, 0), signal.SIGKILL)  # from outside: no fault and no reap names it
        sup.replicas[2].procs[0].wait(10)
        assert sup.poll(now + grace, step=4, unfinished=True) is False
        assert sup.exit_codes() == {0: LOST, 1: None, 2: LOST}
        assert sup.rejoin_at == {2: now + grace + 30.0}  # only replica 2 rejoins (--rejoin-replicas 2)
        assert list(sup.unstruck()) == [1] and sup.busy()
        sup.strike(1, 0, signal.SIGSTOP)  # a random freeze: replica 1 is no target of another fault
        assert sup.unstruck() == {} and sup.replicas[1].running()
    finally:
        sup.kill_all()
    assert not sup.replicas[1].running()
    events.close()
    kinds = [(e["kind"], e.get("replica"), e.get("source")) for e in read_jsonl(tmp_path / "events.jsonl")]
    assert kinds == [("reaped", 0, None), ("replica_exit", 0, None), ("kill", 2, "external"), ("replica_exit", 2, None)]


def test_rejoins_go_on_with_every_replica_lost_but_not_once_one_ended_the_job(tmp_path: Path) -> None:
    """Both replicas SIGKILLed: nobody is live, yet both are due to rejoin (they will restore a checkpoint).
    A replica that exits with a status that ends the job (3: quorum lost) cancels every rejoin."""
    cfg = load_config("debug", ["--parallel.replicas=2"])
    events = EventLog(tmp_path / "events.jsonl")
    sup = Supervisor(LaunchOptions(config=cfg, out=tmp_path, rejoin_after_s=30.0), events, say=print)
    sup.replicas = {rid: sleeper(tmp_path, rid) for rid in range(2)}
    try:
        now = time.time()
        for rid in (0, 1):
            sup.replicas[rid].kill()
        assert sup.poll(now, step=4, unfinished=True) is False
        assert sup.live() == [] and sup.rejoin_at == {0: now + 30.0, 1: now + 30.0} and sup.busy()
        sup.poll(now + 1.0, step=4, unfinished=True)
        assert sorted(sup.rejoin_at) == [0, 1]
        sup.replicas = {0: sleeper(tmp_path, 0),
                        1: ReplicaProcesses(1, [spawn(["sh", "-c", "exit 3"], tmp_path / "logs" / "q.log", {})],
                                            time.time(), False)}
        sup.rejoin_at.clear()
        sup.replicas[0].kill()
        sup.replicas[1].procs[0].wait(10)
        sup.poll(now + 2.0, step=4, unfinished=True)
        assert sup.exit_codes() == {0: LOST, 1: 3} and sup.rejoin_at == {} and not sup.busy()
    finally:
        sup.kill_all()
    events.close()


def test_a_fence_of_a_replaced_process_never_reaps_its_replacement(tmp_path: Path) -> None:
    """Replica 0 is fenced while its process runs; the process exits and a new one takes replica 0 before the
    next reap: the old fence is not the new process's (it was SIGKILLed fence_exit_s + 1 s after its start)."""
    cfg = load_config("debug", ["--parallel.replicas=2"])
    events = EventLog(tmp_path / "events.jsonl")
    sup = Supervisor(LaunchOptions(config=cfg, out=tmp_path, rejoin_after_s=0.0, script=("sleep", "60")), events,
                     say=print)
    sup.replicas = {rid: sleeper(tmp_path, rid) for rid in range(2)}
    try:
        now, grace = time.time(), cfg.fault_tolerance.fence_exit_s + 1.0
        sup.on_event({"t": now, "kind": "failure_detected", "replica": 0, "cause": "hang"}, now)
        old = sup.replicas[0]
        old.kill()
        sup._start_replica(0, join=True)  # what poll does at once with --rejoin-after 0
        assert sup.replicas[0] is not old and sup.replicas[0].running()
        sup.reap_fenced(now + grace)
        assert sup.replicas[0].running(), "the replacement was reaped for its predecessor's fence"
    finally:
        sup.kill_all()
    events.close()
    assert "reaped" not in [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
