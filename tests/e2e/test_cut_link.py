"""A link cut for good: replica 2's worker runs in its own network namespace, joined to the coordinator's
by a veth pair, and mid-run the namespace's route to the coordinator's host becomes a black hole (its
packets are dropped, the worker's sockets are told nothing: the coordinator's retransmissions still
arrive, which is why the worker judges by what its host acknowledges). The cut-off worker leaves within
10 s with one line and the fenced status, no traceback; replicas 0 and 1 go on committing steps without
it. (A link that goes down is judged the same way; by hand it left in 3.0-3.4 s.)

The coordinator and the workers are started by hand (as the cluster recipes do), the coordinator bound to
the host end of the pair, each worker's gloo on its own end. Needs root and `ip` (network namespaces);
skipped otherwise. The namespace, the pair and every process are named or tracked by this test's PID and
removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import subprocess_env
from recover.train.processes.exits import EXIT_FENCED

LEAVE_S = 10.0  # the acceptance bound: the cut-off worker has left this long after the cut


@dataclass(frozen=True)
class Net:
    """A namespace ``ns`` whose ``ns_if`` (``ns_ip``) is paired with this namespace's ``host_if`` (``host_ip``)."""

    ns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and `ip` to give a worker its own network namespace")
    pid = os.getpid()
    n = Net(f"rcvcut{pid}", f"rcvh{pid}", f"rcvn{pid}", f"10.213.{pid % 250}.1", f"10.213.{pid % 250}.2")
    steps = [("netns", "add", n.ns), ("link", "add", n.host_if, "type", "veth", "peer", "name", n.ns_if),
             ("link", "set", n.ns_if, "netns", n.ns), ("addr", "add", f"{n.host_ip}/30", "dev", n.host_if),
             ("link", "set", n.host_if, "up"), ("-n", n.ns, "addr", "add", f"{n.ns_ip}/30", "dev", n.ns_if),
             ("-n", n.ns, "link", "set", n.ns_if, "up"), ("-n", n.ns, "link", "set", "lo", "up")]
    try:
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: ip {' '.join(step)}: {done.stderr.strip()}")
        yield n
    finally:
        ip("link", "del", n.host_if)  # its peer goes with it
        ip("netns", "del", n.ns)


class Job:
    """A coordinator for 3 replicas on ``net.host_ip`` and its workers; every process killed at the end."""

    def __init__(self, run: Path, net: Net) -> None:
        self.run, self.net, self.procs = run, net, []
        run.mkdir()
        self.token = run / "token"
        self.token.write_text("t0ken\n")
        coord = self._start([sys.executable, "-m", "recover", "coordinator", "--host", net.host_ip, "--port", "0",
                             "--store-port", "0", "--token-file", str(self.token), "--events",
                             str(run / "events.jsonl"), "--replicas", "3", "--heartbeat-timeout", "1.0"],
                            subprocess_env(), stdout=subprocess.PIPE)
        assert coord.stdout is not None
        self.port = json.loads(coord.stdout.readline())["port"]

    def _start(self, cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(cmd, env=env, text=True, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def worker(self, replica: int, corpus: Path, inside: bool) -> tuple[subprocess.Popen[str], Path]:
        """Replica ``replica``'s worker (``inside``: in the namespace); its stderr goes to the returned file."""
        err = self.run / f"worker_{replica}.err"
        cmd = [sys.executable, "-m", "recover", "worker", "--config", "debug", "--replica", str(replica),
               "--coordinator", f"{self.net.host_ip}:{self.port}", "--token-file", str(self.token),
               "--out", str(self.run), "--data.path", str(corpus), "--parallel.replicas=3",
               "--training.steps", "400", "--training.device_time_s", "0.05", "--training.eval_every", "0",
               "--training.checkpoint_every", "0"]
        env = {**subprocess_env(), "GLOO_SOCKET_IFNAME": self.net.ns_if if inside else self.net.host_if}
        with err.open("w") as f:
            return self._start(["ip", "netns", "exec", self.net.ns, *cmd] if inside else cmd, env, stderr=f), err

    def steps(self, replica: int) -> list[dict]:
        path = self.run / "replicas" / f"replica_{replica}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def kill_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_until(done: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def cut(net: Net) -> subprocess.CompletedProcess[str]:
    """The namespace's route to the coordinator's host becomes a black hole: its packets are dropped, its
    sockets told nothing (the harder case: a link that goes down tells the kernel, and the worker's
    connection gets no acknowledgement either way)."""
    return ip("-n", net.ns, "route", "add", "blackhole", f"{net.host_ip}/32")


def test_a_worker_cut_off_leaves_in_one_line_and_the_job_goes_on(net: Net, corpus: Path, tmp_path: Path) -> None:
    job = Job(tmp_path / "run", net)
    try:
        (w0, _), (w1, _) = job.worker(0, corpus, False), job.worker(1, corpus, False)
        off, err = job.worker(2, corpus, True)
        wait_until(lambda: len(job.steps(2)) >= 2, 60, "replica 2's first steps")
        before = err.read_text()
        assert cut(net).returncode == 0
        t0 = time.monotonic()
        wait_until(lambda: off.poll() is not None, LEAVE_S + 5, "the cut-off worker to leave")
        left_s = time.monotonic() - t0
        said = err.read_text()[len(before):]
        assert off.returncode == EXIT_FENCED and left_s < LEAVE_S, (off.returncode, left_s, said)
        assert said.count("\n") == 1 and "cut off from the coordinator" in said and "Traceback" not in said, said
        last = job.steps(0)[-1]["step"]
        wait_until(lambda: any(r["step"] >= last + 2 and r["live_replicas"] == 2 for r in job.steps(0)), 30,
                   "replicas 0 and 1 to commit steps without replica 2")
        assert w0.poll() is None and w1.poll() is None
    finally:
        job.kill_all()
