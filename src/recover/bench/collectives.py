"""``recover bench collectives``: failure latency and failure-free overhead of layer 1.

Contract: a driver (this process: the coordinator and the bookkeeping, never a replica) starts
``replicas`` worker processes (``python -m recover.bench.collectives``, driven by JSON lines) and
  1. overhead: each worker times, interleaved in rotating order after a barrier, the
     fault-tolerant ``allreduce`` (copy + async + watched wait), a plain c10d all-reduce (what
     ``torch.distributed.all_reduce`` issues, in place) and a copy followed by a plain all-reduce
     (the floor of any reduce-a-copy scheme) of the same ``floats`` on the same gloo group;
  2. kills: ``kills`` times, while every replica loops all-reduces of ``kill_floats``, SIGKILLs a
     random replica at a random moment and records, from the kill: the coordinator's detection,
     the last survivor's notice, the last survivor's ``PeerFailure`` and the last survivor's new
     group being ready; a hot spare (registered beforehand with ``join=True``) is then admitted at
     a commit vote, receives the state, and the replica count is back to ``replicas``.
All clocks are ``time.monotonic()`` (system-wide on Linux) except the coordinator's event times.
Invariant: every process started is killed by PID before returning.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from recover.names import Event

_SRC = str(Path(__file__).resolve().parents[2])
_TOKEN_ENV = "RECOVER_BENCH_TOKEN"


# ---------------------------------------------------------------- worker side

def _emit(**rec: Any) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def _worker(port: int, token: str, replica: int, join: bool, bucket_mb: float) -> None:
    from recover import deathwatch

    deathwatch.hold()  # as a launched worker does (recover.train.processes.process.prepare)
    import torch

    from recover.comm import FaultTolerantGroup, receive_state, send_state, source_rank
    from recover.coord import CoordinatorClient
    from recover.errors import PeerFailure

    torch.manual_seed(0)
    state = {"w": torch.randn(1 << 16), "step": torch.tensor(0)}
    client = CoordinatorClient("127.0.0.1", port, token, replica)
    group = FaultTolerantGroup.create(client, client.register(join=join, timeout=600), backend="gloo",
                                      timeout_s=60, bucket_bytes=int(bucket_mb * (1 << 20)))
    if join:
        state = dict(receive_state(group, source_rank(group)))
    _emit(event="ready", replica=replica)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "overhead":
            x = torch.randn(cmd["n"])
            y, z = torch.empty_like(x), torch.empty_like(x)
            times: dict[str, list[float]] = {"ft": [], "plain": [], "copy": []}
            kinds = list(times)
            for i in range(cmd["iters"]):
                for kind in kinds[i % 3:] + kinds[:i % 3]:  # rotate the order: no kind always goes first
                    y.copy_(x)
                    group.barrier()
                    t0 = time.perf_counter()
                    if kind == "ft":
                        group.release(group.allreduce([x]))
                    elif kind == "plain":
                        group.process_group.allreduce([y]).wait()
                    else:  # the copy any copy-based scheme pays, then a plain all-reduce
                        z.copy_(x)
                        group.process_group.allreduce([z]).wait()
                    times[kind].append(time.perf_counter() - t0)
            _emit(reply="overhead", **times)
        elif cmd["op"] == "loop":
            x = torch.randn(cmd["n"])
            first = True
            while True:
                try:
                    group.release(group.allreduce([x]))
                except PeerFailure as exc:
                    t_raise = time.monotonic()
                    g = exc.generation
                    group = group.next_generation()
                    t_ready = time.monotonic()
                    group.allreduce([x])
                    _emit(reply="loop", dead=list(exc.dead), t_notice=client.notice_time(g), t_raise=t_raise,
                          t_ready=t_ready, generation=group.generation)
                    break
                if first:
                    _emit(event="looping", replica=replica)
                    first = False
        elif cmd["op"] == "vote":
            if client.vote_commit(group.generation, cmd["step"], [0]) is not None:
                group = group.next_generation()
                src = source_rank(group)
                if group.rank == src:
                    send_state(group, state)
                else:
                    receive_state(group, src)
            _emit(reply="vote", generation=group.generation)
    deathwatch.release()
    os._exit(0)


# ---------------------------------------------------------------- driver side

class _Proc:
    def __init__(self, replica: int, port: int, token: str, join: bool, bucket_mb: float, watched: bool) -> None:
        from recover import deathwatch
        from recover.coord.operator import tell_died

        env = dict(os.environ)
        env["PYTHONPATH"] = _SRC + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        env[_TOKEN_ENV] = token  # never on the command line
        cmd = [sys.executable, "-m", "recover.bench.collectives", str(port), str(replica),
               "1" if join else "0", str(bucket_mb)]
        self.replica = replica
        options: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True,
                                   "start_new_session": True}
        self.popen = (deathwatch.popen(cmd, lambda pid: tell_died(f"127.0.0.1:{port}", token, pid), env, **options)
                      if watched else subprocess.Popen(cmd, env=env, **options))  # as recover launch does
        self.lines: Queue[dict[str, Any]] = Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """The worker's JSON records; any other line on its stdout (gloo on torch 2.9 prints "[Gloo] Rank 0 is
        connected to 1 peer ranks ..." there, from C++) is passed on to stderr."""
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                sys.stderr.write(line)

    def send(self, **cmd: Any) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()

    def expect(self, key: str, value: str, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                rec = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise RuntimeError(f"bench replica {self.replica}: no {key}={value} within {timeout} s "
                                   f"(exit code {self.popen.poll()})") from None
            if rec.get(key) == value:
                return rec

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1e3, "max_ms": max(xs) * 1e3, "min_ms": min(xs) * 1e3}


def run(kills: int = 20, replicas: int = 4, floats: int = 10_000_000, kill_floats: int = 1_000_000,
        iters: int = 10, bucket_mb: float = 16.0, seed: int = 0, log: Any = print,
        deathwatch: bool = True) -> dict[str, Any]:
    """Runs the benchmark; returns the results (also what ``--json`` writes). ``deathwatch``: the driver sees a
    killed worker die and tells the coordinator at once (:mod:`recover.deathwatch`, as ``recover launch``
    does); False: the coordinator sees the death only when the worker's connection closes."""
    from recover.coord.server import Coordinator
    from recover.observe.events import read_jsonl

    rng = random.Random(seed)
    token = secrets.token_hex(16)
    tmp = tempfile.mkdtemp(prefix="recover-bench-")
    events = Path(tmp) / "events.jsonl"
    coord = Coordinator(token=token, events_path=str(events), expected_replicas=replicas,
                        max_replicas=replicas + kills).start()  # each kill's spare joins with a new id
    procs: dict[int, _Proc] = {}
    spare: _Proc | None = None
    try:
        procs = {r: _Proc(r, coord.port, token, False, bucket_mb, deathwatch) for r in range(replicas)}
        for p in procs.values():
            p.expect("event", "ready")
        log(f"{replicas} replicas ready; timing {iters} x 3 all-reduces of {floats:,} floats")
        for p in procs.values():
            p.send(op="overhead", n=floats, iters=iters)
        over = [p.expect("reply", "overhead") for p in procs.values()]
        ft, plain, copy = ([statistics.mean(o[k][i] for o in over) for i in range(iters)]
                           for k in ("ft", "plain", "copy"))
        next_id = replicas
        samples: list[dict[str, float]] = []
        for k in range(kills):
            if spare is None:
                spare, next_id = _Proc(next_id, coord.port, token, True, bucket_mb, deathwatch), next_id + 1
            coord.wait_until(lambda s, r=spare.replica: r in s["pending_join"], 300)
            for p in procs.values():
                p.send(op="loop", n=kill_floats)
            for p in procs.values():
                p.expect("event", "looping")
            time.sleep(rng.uniform(0.0, 0.05))  # a random point inside the loop, not a synchronisation
            victim = procs.pop(rng.choice(sorted(procs)))
            t_wall, t_kill = time.time(), time.monotonic()
            os.kill(victim.popen.pid, signal.SIGKILL)
            reps = [p.expect("reply", "loop") for p in procs.values()]
            victim.kill()
            assert all(r["dead"] == [victim.replica] for r in reps), reps
            detected = [e["t"] for e in read_jsonl(events)
                        if e["kind"] == Event.FAILURE_DETECTED and e["replica"] == victim.replica]
            samples.append({
                "detect": detected[0] - t_wall,
                "notice": max(r["t_notice"] for r in reps) - t_kill,
                "raise": max(r["t_raise"] for r in reps) - t_kill,
                "ready": max(r["t_ready"] for r in reps) - t_kill,
            })
            log(f"kill {k + 1}/{kills}: replica {victim.replica}, new group ready after "
                f"{samples[-1]['ready'] * 1e3:.1f} ms")
            for p in procs.values():
                p.send(op="vote", step=k)
            for p in procs.values():
                p.expect("reply", "vote")
            spare.expect("event", "ready")
            procs[spare.replica], spare = spare, None
    finally:
        for p in [*procs.values(), *([spare] if spare else [])]:
            p.kill()
        coord.stop()
    result: dict[str, Any] = {
        "replicas": replicas, "kills": kills, "floats": floats, "kill_floats": kill_floats, "iters": iters,
        "bucket_mb": bucket_mb, "deathwatch": deathwatch,
        "overhead": {"ft": _summary(ft), "plain": _summary(plain), "copy": _summary(copy),
                     "ratio_median": statistics.median(ft) / statistics.median(plain),
                     "ratio_paired": statistics.median(f / p for f, p in zip(ft, plain, strict=True)),
                     "copy_ratio_paired": statistics.median(c / p for c, p in zip(copy, plain, strict=True)),
                     "ft_s": ft, "plain_s": plain, "copy_s": copy},
        "kill_to": {key: _summary([s[key] for s in samples]) for key in ("detect", "notice", "raise", "ready")}
        if samples else {},
        "events": str(events),
    }
    return result


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"layer 1 collectives: {res['replicas']} replicas, gloo on loopback")
    for col in ("measure", "median", "max", "target"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    labels = {"detect": "kill -> coordinator detects", "notice": "kill -> last survivor notified",
              "raise": "kill -> last survivor's PeerFailure", "ready": "kill -> new group ready"}
    for key, label in labels.items():
        if key in res["kill_to"]:
            s = res["kill_to"][key]
            t.add_row(f"{label} ({res['kills']} kills)", f"{s['median_ms']:.1f} ms", f"{s['max_ms']:.1f} ms",
                      "<= 100 ms" if key == "ready" else "")
    o = res["overhead"]
    t.add_row(f"plain all_reduce, {res['floats']:,} floats", f"{o['plain']['median_ms']:.1f} ms",
              f"{o['plain']['max_ms']:.1f} ms", "")
    t.add_row(f"copy + plain all_reduce, {res['floats']:,} floats", f"{o['copy']['median_ms']:.1f} ms",
              f"{o['copy']['max_ms']:.1f} ms", "")
    t.add_row(f"FT allreduce, {res['floats']:,} floats", f"{o['ft']['median_ms']:.1f} ms",
              f"{o['ft']['max_ms']:.1f} ms", "")
    t.add_row("overhead (median FT / median plain)", f"{(o['ratio_median'] - 1) * 100:+.1f} %", "", "<= 3 %")
    t.add_row("overhead (median of paired FT / plain)", f"{(o['ratio_paired'] - 1) * 100:+.1f} %", "", "<= 3 %")
    t.add_row("of which the copy alone (paired copy+plain / plain)",
              f"{(o['copy_ratio_paired'] - 1) * 100:+.1f} %", "", "")
    Console().print(t)


if __name__ == "__main__":
    _port, _replica, _join, _bucket = sys.argv[1:5]
    _worker(int(_port), os.environ[_TOKEN_ENV], int(_replica), _join == "1", float(_bucket))
