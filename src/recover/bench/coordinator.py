"""``recover bench coordinator``: a real coordinator against thousands of simulated clients; one replica killed.

Contract:
- Layouts (``--layout``): ``16k`` = 128 replicas of 128 ranks (llama3-16k), ``131k`` = 1,024
  replicas of 128 ranks, or ``RxP`` (R replicas of P ranks).
- Connections (``--connections``): ``rank``, one connection per rank (every rank's own
  ``CoordinatorClient``, the layout before issue #13 item 4), or ``replica``, one connection per
  replica carrying its ranks (a replica's relay, :mod:`recover.coord.relay`). Both speak the real
  protocol to a real ``python -m recover coordinator`` process (:mod:`recover.bench.simclients`).
- Heartbeats: ``--heartbeat auto`` sends at the interval the coordinator names in its register
  reply (adapted to the job size, :func:`recover.coord.cadence.cadence`); ``--heartbeat S`` asks the
  coordinator for S seconds (``--heartbeat-interval S``) and sends every S.
- Procedure: start the coordinator; start ``--procs`` client processes (whole replicas each);
  wait until every connection is in the first generation; then per round (``--rounds``): a steady
  window of ``--steady`` seconds over which the coordinator's CPU is read from
  ``/proc/<pid>/stat`` (utime + stime, % of one core), then the kill (one replica's connections
  closed at once, a different replica each round) and the *failure round*: from the kill until
  every surviving connection received the next generation's membership (``max_ms``; ``median_ms``
  over the connections), and the coordinator's own share (``coord_round_ms``: the ``latency_ms`` of
  its ``generation`` event, from the closed connection seen to the generation formed, i.e. the
  notice and every survivor's ack). Rounds are summarised with :func:`recover.bench.common.spread`.
- The machine: cores, load averages before and after, and the client processes' CPU are printed
  with the table: on few cores the simulated clients compete with the coordinator for CPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from recover.bench.common import fmt, machine_load, print_rich_table, recover_cmd, spread, stderr_log, write_json
from recover.errors import ConfigError
from recover.names import Event
from recover.observe.events import read_jsonl

LAYOUTS = {"16k": (128, 128), "131k": (1024, 128)}
TARGET_ROUND_MS = 200.0
TARGET_CPU_PCT = 50.0


def parse_layout(text: str) -> tuple[int, int]:
    """``(replicas, ranks per replica)`` of ``16k``, ``131k`` or ``RxP``. Raises ConfigError."""
    if text in LAYOUTS:
        return LAYOUTS[text]
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m[1]) < 2 or int(m[2]) < 1:
        raise ConfigError(f"--layout must be 16k, 131k or RxP with R >= 2 replicas and P >= 1 ranks, got {text!r}")
    return int(m[1]), int(m[2])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Bench:
    """One coordinator process and its client processes."""

    def __init__(self, replicas: int, ranks: int, relay: bool, procs: int, heartbeat: str, timeout_s: float,
                 step_s: float, workdir: Path, log: Any) -> None:
        self.replicas, self.ranks, self.relay = replicas, ranks, relay
        self.procs = max(1, min(procs, replicas))
        self.heartbeat, self.timeout_s, self.step_s = heartbeat, timeout_s, step_s
        self.workdir, self.log = workdir, log
        self.coord: subprocess.Popen[str] | None = None
        self.workers: list[tuple[Any, Any, list[int]]] = []  # (process, control pipe, replicas)

    def start(self) -> None:
        token = self.workdir / "token"
        token.write_text("bench-token\n")
        cmd = recover_cmd("coordinator", "--port", "0", "--token-file", str(token), "--replicas",
                          str(self.replicas), "--events", str(self.workdir / "events.jsonl"),
                          "--heartbeat-timeout", str(self.timeout_s), "--ranks-per-replica", str(self.ranks),
                          "--connections", "replica" if self.relay else "rank")
        if self.heartbeat != "auto":
            cmd += ["--heartbeat-interval", self.heartbeat]
        from recover import lifeline
        from recover.bench.common import child_env

        # the coordinator dies with this process, however it ends (PR_SET_PDEATHSIG, recover.lifeline)
        self.coord = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.workdir / "coordinator.log", "w"),
                                      text=True, env=lifeline.child_env(child_env()), start_new_session=True)
        assert self.coord.stdout is not None
        line = self.coord.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the coordinator did not start; see {self.workdir / 'coordinator.log'}")
        import json

        port = json.loads(line)["port"]
        hb = 0.1 if self.heartbeat == "auto" else float(self.heartbeat)
        ctx = mp.get_context("fork")
        shares = [list(range(self.replicas))[i::self.procs] for i in range(self.procs)]
        from recover.bench.simclients import serve

        for share in shares:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(child, "127.0.0.1", port, "bench-token", share, self.ranks,
                                                self.relay, hb, self.step_s), daemon=True)
            p.start()
            self.workers.append((p, parent, share))
        for p, pipe, _ in self.workers:
            if not pipe.poll(300):
                raise TimeoutError(f"client process {p.pid} did not connect within 300 s")
            msg = pipe.recv()
            if msg[0] != "ready":
                raise RuntimeError(msg[1])

    def ask(self, cmd: tuple[Any, ...]) -> list[Any]:
        for _, pipe, _ in self.workers:
            pipe.send(cmd)
        return [pipe.recv() for _, pipe, _ in self.workers]

    def wait_formed(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        total = sum(len(share) for _, _, share in self.workers) * (1 if self.relay else self.ranks)
        while True:
            st = self.ask(("status",))
            live, fenced = sum(s[0] for s in st), sum(s[3] for s in st)
            if live < total or fenced:
                raise RuntimeError(f"{total - live} of {total} connections were lost ({fenced} fenced) before the "
                                   "first generation formed (heartbeat timeouts while the others registered): the "
                                   "coordinator or this machine cannot carry this layout at this heartbeat")
            if sum(s[1] for s in st) == live:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the first generation did not reach every connection within {timeout_s:.0f} s: "
                                   f"{sum(s[1] for s in st)} of {sum(s[0] for s in st)}")
            time.sleep(0.2)

    def kill_round(self, victim: int, timeout_s: float) -> dict[str, Any]:
        before = max(s[2] for s in self.ask(("status",)))
        owner = next(i for i, (_, _, share) in enumerate(self.workers) if victim in share)
        pipe = self.workers[owner][1]
        pipe.send(("kill", victim))
        t_kill = pipe.recv()
        deadline = time.monotonic() + timeout_s
        while True:
            times = [t for ts in self.ask(("round", before)) for t in ts]
            if times and all(t is not None for t in times):
                lat = [(t - t_kill) * 1e3 for t in times]
                return {"victim": victim, "generation": before + 1, "max_ms": max(lat),
                        "median_ms": statistics.median(lat), "clients": len(lat)}
            if time.monotonic() > deadline:
                got = sum(t is not None for t in times)
                raise TimeoutError(f"{got} of {len(times)} survivors got generation {before + 1} within {timeout_s} s")
            time.sleep(0.02)

    def worker_cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p, _, _ in self.workers)

    def stop(self) -> None:
        for p, pipe, _ in self.workers:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.coord is not None:
            from recover.bench.common import kill_group

            kill_group(self.coord, 5.0)


def run(layout: str, connections: str, rounds: int = 3, steady_s: float = 5.0, procs: int = 2,
        heartbeat: str = "auto", timeout_s: float = 3.0, step_s: float = 0.0, log: Any = stderr_log) -> dict[str, Any]:
    """Runs the bench (see the module docstring); returns its results."""
    replicas, ranks = parse_layout(layout)
    if rounds < 1 or rounds > replicas - 1:
        raise ConfigError(f"--rounds must be in 1..{replicas - 1} (one replica is killed per round), got {rounds}")
    relay = connections == "replica"
    load_before = machine_load()
    with tempfile.TemporaryDirectory(prefix="recover-bench-coord-") as tmp:
        bench = _Bench(replicas, ranks, relay, procs, heartbeat, timeout_s, step_s, Path(tmp), log)
        try:
            t0 = time.monotonic()
            bench.start()
            bench.wait_formed(600)
            log(f"[bench] {replicas}x{ranks} {connections}: {replicas * (1 if relay else ranks)} connections "
                f"formed generation 1 in {time.monotonic() - t0:.1f} s")
            per_round = []
            for r in range(rounds):
                assert bench.coord is not None
                c0, w0, t0 = cpu_seconds(bench.coord.pid), bench.worker_cpu(), time.monotonic()
                time.sleep(steady_s)
                c1, w1, t1 = cpu_seconds(bench.coord.pid), bench.worker_cpu(), time.monotonic()
                res = bench.kill_round(replicas - 1 - r, 60)
                res["coord_cpu_pct"] = 100 * (c1 - c0) / (t1 - t0)
                res["clients_cpu_pct"] = 100 * (w1 - w0) / (t1 - t0)
                log(f"[bench] round {r}: failure round max {res['max_ms']:.1f} ms, median {res['median_ms']:.1f} ms; "
                    f"coordinator CPU {res['coord_cpu_pct']:.1f}% of a core")
                per_round.append(res)
                time.sleep(0.5)
            fenced = sum(s[3] for s in bench.ask(("status",)))
            events = list(read_jsonl(Path(tmp) / "events.jsonl"))
        finally:
            bench.stop()
    starts = [e for e in events if e.get("kind") == Event.COORDINATOR_START]
    formed = {e["generation"]: e.get("latency_ms") for e in events if e.get("kind") == Event.GENERATION}
    for res in per_round:  # the coordinator's own share: round opened (kill seen) to generation formed
        res["coord_round_ms"] = formed.get(res["generation"])
    hb_s = (starts[0].get("heartbeat_s") if starts else None) or (None if heartbeat == "auto" else float(heartbeat))
    return {"layout": layout, "replicas": replicas, "ranks": ranks, "connections": connections,
            "connection_count": replicas * (1 if relay else ranks), "heartbeat": heartbeat,
            "heartbeat_s": hb_s, "rounds": per_round, "max_ms": spread([r["max_ms"] for r in per_round]),
            "median_ms": spread([r["median_ms"] for r in per_round]),
            "coord_round_ms": spread([r["coord_round_ms"] for r in per_round if r["coord_round_ms"] is not None]),
            "coord_cpu_pct": spread([r["coord_cpu_pct"] for r in per_round]),
            "clients_cpu_pct": spread([r["clients_cpu_pct"] for r in per_round]), "fenced": fenced,
            "cores": os.cpu_count(), "load_before": load_before, "load_after": machine_load(), "procs": bench.procs}


def print_table(res: dict[str, Any]) -> None:
    def sp(d: dict[str, Any]) -> str:
        return f"{fmt(d['median'], '.1f')} ({fmt(d['min'], '.1f')}-{fmt(d['max'], '.1f')})"

    rows = [[f"{res['replicas']}x{res['ranks']} {res['connections']}", str(res["connection_count"]),
             fmt(res["heartbeat_s"], ".3g"), sp(res["max_ms"]), sp(res["median_ms"]), sp(res["coord_round_ms"]),
             sp(res["coord_cpu_pct"]),
             sp(res["clients_cpu_pct"]), str(res["fenced"])]]
    ok = (res["max_ms"]["median"] or 1e9) <= TARGET_ROUND_MS and \
        (res["coord_cpu_pct"]["median"] or 1e9) <= TARGET_CPU_PCT
    print_rich_table(
        f"recover bench coordinator: {res['layout']} ({res['replicas']} replicas x {res['ranks']} ranks), "
        f"{len(res['rounds'])} rounds, median (min-max)",
        ["layout / connections", "conns", "hb s", "failure round max ms", "median ms", "coord's round ms",
         "coord CPU %", "clients CPU %", "fenced"], rows,
        [f"target: failure round <= {TARGET_ROUND_MS:g} ms and coordinator CPU <= {TARGET_CPU_PCT:g}% of a core: "
         f"{'met' if ok else 'NOT met'}",
         "failure round: kill to the last (max) / median surviving connection holding the next membership; "
         "coord's round: the coordinator's own failure round (its events' latency_ms: kill seen to generation formed)",
         f"machine: {res['cores']} cores, load {res['load_before']} before, {res['load_after']} after; "
         f"{res['procs']} client processes on the same machine (their CPU in 'clients CPU %')"])


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench coordinator`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "coordinator", help="a real coordinator against simulated clients (16k/131k layouts), one replica killed",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="16k", help="16k (128x128), 131k (1024x128) or RxP (default 16k)")
    p.add_argument("--connections", choices=("rank", "replica"), default="replica",
                   help="one connection per rank (as before) or per replica (default replica)")
    p.add_argument("--rounds", type=int, default=3, help="kills, one replica each (default 3)")
    p.add_argument("--steady", type=float, default=5.0, help="seconds of steady state before each kill (default 5)")
    p.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--heartbeat", default="auto",
                   help="'auto' (the coordinator's adapted interval) or seconds between heartbeats")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="coordinator's heartbeat timeout (default 3)")
    p.add_argument("--step-s", type=float, default=0.0, help="commit votes every S seconds (default 0: none)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args)
    return p


def _terminate_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, so cleanup runs as after Ctrl-C."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def run_from_args(args: argparse.Namespace) -> int:
    if args.heartbeat != "auto":
        try:
            if float(args.heartbeat) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--heartbeat must be 'auto' or a positive number of seconds, "
                              f"got {args.heartbeat!r}") from None
    if args.procs < 1 or args.steady <= 0:
        raise ConfigError(f"--procs must be >= 1 and --steady > 0, got {args.procs} and {args.steady}")
    _terminate_as_interrupt()  # SIGTERM (timeout, Slurm) runs run()'s cleanup, as Ctrl-C does
    res = run(args.layout, args.connections, args.rounds, args.steady, args.procs, args.heartbeat,
              args.heartbeat_timeout, args.step_s)
    print_table(res)
    if args.json:
        write_json(args.json, res)
    return 0
