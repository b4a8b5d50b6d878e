"""The warm pool's bookkeeping: spares kept started, taken oldest first, devices handed on, exits replaced
(up to a limit), nothing left running once it is closed; and the supervisor's use of it for a rejoin.

Spares and replicas here are ``sleep`` processes (milliseconds to start): what is under test is the
bookkeeping, not a worker."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from recover.config import load_config
from recover.launch.job import LaunchOptions
from recover.launch.placement import parse_gpus, place
from recover.launch.processes import ReplicaProcesses, Spawned, spawn
from recover.launch.spares import MAX_EXITS, Devices, SparePool
from recover.launch.supervisor import Supervisor
from recover.observe.events import EventLog, read_jsonl


class Starter:
    """The pool's ``start``: one ``sleep`` per rank, each with a stdin pipe; remembers every process and device."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.started, self.on = tmp_path, [], []

    def __call__(self, devices: Devices) -> list[Spawned]:
        ranks = [spawn(["sleep", "60"], self.tmp_path / f"spare_{len(self.on)}_{k}.log", {}, stdin=subprocess.PIPE)
                 for k in range(len(devices))]
        self.started += [r.proc for r in ranks]
        self.on.append(devices)
        return ranks


def test_spares_are_taken_oldest_first_replaced_behind_and_all_gone_once_closed(tmp_path: Path) -> None:
    start = Starter(tmp_path)
    pool = SparePool([(None, None)] * 2, start)  # two spares of a 2-rank replica, on the CPU
    taken = None
    try:
        pool.fill()
        assert len(pool.spares) == 2 and len(start.started) == 4 and pool.free == []
        first = pool.spares[0]
        taken = pool.take(replacing=(None, None))
        assert taken is not None and taken is first and len(pool.spares) == 2 and len(start.started) == 6  # one more started behind it
        taken.order(b'{"replica": 1}\n')
        assert all(r.proc.stdin.closed for r in taken.ranks) and taken.running()  # its processes are the replica's
        os.kill(pool.spares[0].ranks[1].proc.pid, signal.SIGKILL)  # from outside
        pool.spares[0].ranks[1].proc.wait(10)
        gone = pool.reap()  # one rank lost: the whole spare is ended and replaced
        assert len(gone) == 1 and not gone[0].running() and pool.exits == 1 and len(pool.spares) == 2
        second = pool.take(replacing=(None, None))
        assert second is not None and second is not gone[0] and second.running()
        second.end()  # a spare taken is the caller's to end (the supervisor's, as a replica)
    finally:
        pool.close()
        if taken is not None:
            taken.end()
    assert pool.spares == [] and all(p.poll() is not None for p in start.started)
    pool.fill()  # closed: nothing starts any more
    assert pool.spares == [] and all(p.poll() is not None for p in start.started)


def test_a_spare_takes_the_devices_it_waited_on_and_the_next_starts_on_the_replaced_replicas(tmp_path: Path) -> None:
    start = Starter(tmp_path)
    pool = SparePool([("4",)], start)
    try:
        pool.fill()
        spare = pool.take(replacing=("1",))  # replica on GPU 1 died: the spare on GPU 4 becomes it
        assert spare is not None and spare.devices == ("4",) and start.on == [("4",), ("1",)]
        spare.end()
        for _ in range(MAX_EXITS):  # spares that keep exiting by themselves: the pool gives up
            assert pool.spares and not pool.gave_up
            pool.spares[0].ranks[0].proc.kill()
            pool.spares[0].ranks[0].proc.wait(10)
            pool.reap()
        assert pool.gave_up and pool.spares == [] and pool.take(replacing=("1",)) is None
        assert pool.free == [("1",)]
    finally:
        pool.close()
    assert all(p.poll() is not None for p in start.started)


def test_a_rejoin_takes_the_spare_and_its_gpu_a_spare_lost_is_replaced_and_nothing_outlives_the_job(
        tmp_path: Path) -> None:
    """Replicas 0 and 1 on GPUs 0 and 1, a spare on GPU 2: replica 1 SIGKILLed from outside rejoins as the
    spare (on GPU 2), the next spare starts on GPU 1; that one killed from outside is logged and replaced."""
    cfg = load_config("debug", ["--parallel.replicas=2"])
    events = EventLog(tmp_path / "events.jsonl")
    opts = LaunchOptions(config=cfg, out=tmp_path, rejoin_after_s=0.0, warm_spares=1,
                         placement=place(2, 1, parse_gpus("0,1,2")))
    sup = Supervisor(opts, events, say=print)
    sup.formed = True  # training began: a replica restarted now joins (before it, one starts as a member)
    start = sup.pool.start = Starter(tmp_path)
    (tmp_path / "logs").mkdir()
    sup.replicas = {rid: ReplicaProcesses(rid, [spawn(["sleep", "60"], tmp_path / "logs" / f"r{rid}.log", {})],
                                          time.time(), False) for rid in range(2)}
    try:
        sup.pool.fill()
        os.kill(sup.pid(1, 0), signal.SIGKILL)
        sup.replicas[1].procs[0].wait(10)
        now = time.time()
        sup.poll(now, step=3, unfinished=True)  # exit seen, rejoin due now
        sup.poll(now, step=3, unfinished=True)  # rejoined as the spare
        assert sup.replicas[1].pid == start.started[0].pid and sup.devices_of(1) == ("2",)
        assert start.on == [("2",), ("1",)] and sup.devices_of(0) == ("0",)
        start.started[1].kill()
        start.started[1].wait(10)
        sup.poll(now, step=3, unfinished=True)
        assert len(sup.pool.spares) == 1 and start.on[-1] == ("1",)
    finally:
        sup.kill_all()
    events.close()
    assert all(p.poll() is not None for p in start.started) and not any(r.running() for r in sup.replicas.values())
    got = [(e["kind"], e.get("replica"), e.get("log", "")[:6]) for e in read_jsonl(tmp_path / "events.jsonl")]
    assert got == [("kill", 1, ""), ("replica_exit", 1, ""), ("rejoin_started", 1, "spare_"), ("spare_exit", None, "spare_")]
