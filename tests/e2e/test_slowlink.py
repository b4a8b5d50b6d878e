"""A slow link across real links: one replica's link rate-limited mid-run (``tc`` ``tbf`` at 8 Mbit/s with tail
drops, both ways, as on a failing port). The slow-link rule (:mod:`recover.coord.graylinks`) fences that replica
with the cause named (``slow_link``), the job's steps go back near the failure-free step, the replica started
again is held back while its link is slow and admitted once the limit is gone, and every committed step is the
failure-free run's, bitwise.

The job is started as a multi-host user starts it (README, "Across machines"), in the partition tests' harness
(:mod:`test_partition`: each host a network namespace behind a router namespace). The step-time figures
(failure-free, with the slow link before detection, after detection) are printed and kept in
docs/BENCHMARKS.md; the test asserts the detection, the fence, the readmission and the bitwise equality, not
timings. Needs root, ``ip`` and ``tc``; skipped otherwise. Every process is stopped by PID and every namespace
removed (the harness checks).

``RECOVER_SLOWLINK_DEVICE_S`` sets the emulated device time per microbatch (default 0.05 s: a step long enough to
be a GPU's, not the 2 shared cores'); measurements vary it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from test_partition import REPLICAS, Job, Routed, failure_free, generations, net, wait_until  # noqa: F401 (net: the fixture)

from conftest import losses, run_recover
from recover.train.processes.exits import EXIT_FENCED

STEPS = 160
SLOW = 3  # the replica whose link is rate-limited
LIMIT_AT = 10  # committed steps before the limit (the failure-free steps measured)
DEVICE_S = os.environ.get("RECOVER_SLOWLINK_DEVICE_S", "0.05")


def tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30, check=True)


def limit(routed: Routed, r: int, on: bool = True) -> None:
    """Replica ``r``'s link at 8 Mbit/s both ways (its host's egress and the router's towards it), tail drops;
    ``on=False`` lifts it."""
    i = list(routed.hosts).index(f"h{r}")
    for ns, dev in ((routed.hosts[f"h{r}"], "eth0"), (routed.router, f"v{i}")):
        if on:
            tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "8mbit", "burst", "16kb", "latency", "100ms")
        else:
            tc(ns, "qdisc", "del", "dev", dev, "root")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    return failure_free(tmp_path_factory.mktemp("slowlink-ref"), corpus, STEPS)


def step_times(run: Path) -> dict[int, float]:
    return {rec["step"]: rec["time_s"] for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.long  # started first: among the suite's longest
def test_a_slow_link_is_fenced_with_its_cause_named_and_readmitted_once_it_recovered(
        net: Routed, reference: Path, tmp_path: Path) -> None:  # noqa: F811 (the imported fixture)
    if shutil.which("tc") is None:
        pytest.skip("needs `tc` to rate-limit a link")
    job = Job(net, tmp_path / "run", reference / "config.json")
    device = ("--training.device_time_s", DEVICE_S)  # changes no number
    try:
        for r in range(REPLICAS):
            job.worker(r, *device)
        wait_until(lambda: job.committed() >= LIMIT_AT, 120, f"{LIMIT_AT} committed steps")
        limit(net, SLOW)
        t_limit, limited_at = time.time(), job.committed()
        wait_until(lambda: any(e["kind"] == "failure_detected" for e in job.events()), 90, "the slow link fenced")
        ev = job.events()
        fenced = next(e for e in ev if e["kind"] == "failure_detected")
        assert (fenced["replica"], fenced["cause"]) == (SLOW, "slow_link"), ev[-20:]
        verdict = next(e for e in ev if e["kind"] == "slow_link" and e["fenced"])
        assert verdict["replica"] == SLOW and verdict["ratio"] > verdict["factor"]
        assert job.procs[f"worker{SLOW}"].wait(30) == EXIT_FENCED
        err = (job.run / f"worker{SLOW}.err").read_text()
        assert "slow link" in err, err[-2000:]  # one line naming the replica and the cause
        fenced_at = job.committed()
        # started again while its link is still slow: held back, its probes show the link slow
        job.worker(SLOW, *device, "--join")
        wait_until(lambda: any(e["kind"] == "join_held" and e.get("cause") == "slow_link" for e in job.events()), 90,
                   "replica 3 held back")
        wait_until(lambda: any(e["kind"] == "slow_link_held" for e in job.events()), 30, "its probe: still slow")
        assert not [e for e in job.events() if e["kind"] == "slow_link_cleared"]
        limit(net, SLOW, on=False)
        t_lift = time.time()
        wait_until(lambda: any(e["kind"] == "slow_link_cleared" for e in job.events()), 30, "the probe healthy")
        wait_until(lambda: len(generations(job)[-1]["members"]) == REPLICAS, 30, "replica 3 admitted")
        admitted = generations(job)[-1]
        admitted_at = admitted["step"]
        for name in ("worker0", "worker1", "worker2", f"worker{SLOW}_again"):
            wait_until(lambda n=name: job.procs[n].poll() is not None, 180, f"{name} to finish")
            assert job.procs[name].returncode == 0, (job.run / f"{name}.err").read_text()[-2000:]
    finally:
        job.close()
    run_recover(["collect", str(job.run)], timeout=120)
    assert losses(job.run) == losses(reference)  # bitwise, every step
    times = step_times(job.run)
    free = statistics.median(times[s] for s in range(1, limited_at))
    slow = statistics.median(times[s] for s in range(limited_at + 1, fenced_at))
    after = statistics.median(times[s] for s in range(fenced_at + 1, admitted_at))
    back = statistics.median(times[s] for s in range(admitted_at + 1, STEPS))
    print(f"slow link (device {DEVICE_S} s/microbatch, load {os.getloadavg()[0]:.1f}): median step failure-free "
          f"{free:.3f} s, with the slow link {slow:.3f} s, after the fence {after:.3f} s ({after / free:.2f}x), "
          f"readmitted {back:.3f} s; limited at step {limited_at}, fenced by step {fenced_at}, readmitted at "
          f"{admitted_at}; detected {fenced['t'] - t_limit:.2f} s after the limit, admitted "
          f"{admitted['t'] - t_lift:.2f} s after it was lifted; ratio {verdict['ratio']}, links {verdict['links']}")
