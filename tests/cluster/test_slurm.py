"""examples/slurm/recover.sbatch on a real Slurm cluster (slurm.py): slurmctld and four slurmd daemons,
each node in a network namespace of its own with its own address, node names that resolve nowhere.

Every job is submitted with ``sbatch`` as a user submits it (the script itself, `CONFIG=debug
GPUS_PER_NODE=0`, deterministic), and every run is compared bitwise with the failure-free run of the
same recipe and config (``recover compare --tol 0``; deterministic mode makes a run of any replica count
equal to it), each step committed with all its microbatches. The signals are Slurm's own: `scancel`,
`scancel --signal=TERM JOBID.STEP`, `scancel --batch`, the time limit's `--signal=B:TERM@...`,
`scontrol update state=down`, and a node's death (its slurmd and every process in its namespace
SIGKILLed). A real Prometheus (prometheus.py) scrapes the coordinator's /metrics through a node's death.

Each test prints what the scenario cost (with the machine's load). The cluster and Prometheus are
stopped by PID at the end of the module, and every process left in a node's namespace with them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus import Prometheus, prometheus_missing
from slurm import SlurmCluster, install

from conftest import ROOT, run_recover, subprocess_env

pytestmark = pytest.mark.cluster

STEPS = 40
FLAGS = ["--training.steps", str(STEPS), "--training.eval_every", "20", "--training.deterministic", "true",
         "--training.threads", "1"]
SCRIPT = ROOT / "examples" / "slurm" / "recover.sbatch"
SLOW_SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_slow.py"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")
METRICS_PORT = 29499


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = install()
    if why:
        pytest.skip(f"no real Slurm cluster here: {why}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=4)
    try:
        yield c
    finally:
        c.stop()


@dataclass
class Job:
    """A submitted batch job: its id, run directory and output file."""

    cluster: SlurmCluster
    id: str
    out: Path
    log: Path

    def state(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def wait(self, timeout: float = 240, until: tuple[str, ...] = ENDED) -> dict[str, str]:
        """Waits until the job's state is one of ``until`` (its COMPLETING phase done); returns the job."""
        deadline = time.time() + timeout
        while True:
            job = self.state()
            if job.get("JobState") in until:
                return job
            assert time.time() < deadline, f"job {self.id}: {job.get('JobState')} after {timeout} s\n{self.output()}"
            time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""

    def last_step(self, replica: int = 0) -> int:
        path = self.out / "replicas" / f"replica_{replica}.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return json.loads(lines[-1])["step"] if lines else -1

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while self.last_step() < step:
            assert self.state().get("JobState") in ("RUNNING", "PENDING", "CONFIGURING"), self.output()
            assert time.time() < deadline, f"step {step} not reached in {timeout} s\n{self.output()}"
            time.sleep(0.2)

    def steps(self) -> dict[str, str]:
        """The job's srun steps by name (replica-R -> JOBID.STEP)."""
        out = self.cluster.run(["squeue", "-h", "-s", "-j", self.id, "-o", "%i %j"]).stdout
        return {name: step for step, name in (line.split() for line in out.splitlines() if line.strip())}

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "events.jsonl").read_text().splitlines()]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def restart_now(self, restarts: int, timeout: float = 150, minutes: int = 10) -> None:
        """Waits until the job is requeued for the ``restarts``-th time; a requeued job is held about two minutes
        before it may start again: it starts as soon as its nodes are done with the last start instead (a
        start while they still complete it fails: "Job credential revoked"), with a longer time limit."""
        deadline = time.time() + timeout
        while not ((job := self.state()).get("JobState") == "PENDING" and int(job.get("Restarts", 0)) >= restarts
                   and not any("comp" in st for st in self.cluster.node_states().values())):
            assert job.get("JobState") not in ENDED, f"job {self.id} ended: {job.get('JobState')}\n{self.output()}"
            assert time.time() < deadline, f"job {self.id} not requeued in {timeout} s\n{self.output()}"
            time.sleep(0.5)
        time.sleep(2)  # slurmd refuses credentials issued within a second of the revocation
        self.cluster.run(["scontrol", "update", f"jobid={self.id}", "StartTime=now", f"TimeLimit={minutes}"])


_ports = iter(range(29400, 29490, 3))
_submitted: list[Job] = []


@pytest.fixture(autouse=True)
def no_job_left(cluster: SlurmCluster) -> Iterator[None]:
    """Whatever a test did, its jobs end with it (a failed test's job would hold nodes for the next)."""
    yield
    for job in _submitted:
        if job.state().get("JobState") not in (*ENDED, None):
            cluster.run(["scancel", job.id], check=False)
    for job in _submitted:
        deadline = time.time() + 90
        while job.state().get("JobState") not in (*ENDED, None) and time.time() < deadline:
            time.sleep(0.5)
    _submitted.clear()


def submit(cluster: SlurmCluster, tmp: Path, name: str, nodes: int, *args: str, env: dict[str, str] | None = None,
           sbatch: tuple[str, ...] = (), out: Path | None = None) -> Job:
    """``sbatch`` of the recipe as a user submits it, from the hub (the login node)."""
    out = out or tmp / name
    port = next(_ports)
    job_env = {**subprocess_env(), "OUT": str(out), "CONFIG": "debug", "GPUS_PER_NODE": "0",
               "RECOVER": f"{sys.executable} -m recover", "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
               "PORT": str(port), "STORE_PORT": str(port + 1), "RDZV_PORT": str(port + 2), **(env or {})}
    log = tmp / f"{name}.out"
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", f"--nodes={nodes}", f"--chdir={tmp}", f"--output={log}",
           *sbatch, str(SCRIPT), *args]
    got = subprocess.run(cluster.hosts.enter(cluster.hosts.hub, cmd), capture_output=True, text=True,
                         env={**job_env, "SLURM_CONF": str(cluster.conf)}, timeout=60)
    assert got.returncode == 0, got.stderr
    _submitted.append(job := Job(cluster, got.stdout.strip().split(";")[0], out, log))
    return job


def bitwise(ref: Path, run: Path) -> None:
    """Every step committed once with all 8 microbatches, each loss bitwise equal to the reference's."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and {r["microbatches"] for r in rows} == {8}
    got = run_recover(["compare", str(ref), str(run), "--tol", "0"])
    assert got.returncode == 0 and "bitwise equal" in got.stdout, got.stdout + got.stderr


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


@pytest.fixture(scope="module")
def reference(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The failure-free run on 2 nodes (2 replicas of one process)."""
    tmp = tmp_path_factory.mktemp("ref")
    t0 = time.time()
    job = submit(cluster, tmp, "ref", 2, "--data.path", str(corpus), *FLAGS)
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    assert "every step committed" in job.output() and "srun: error" not in job.output(), job.output()
    # the coordinator is at the first node's NodeAddr: its name resolves nowhere
    assert f"coordinator {cluster.hosts.addr['n0']}:" in job.output()
    print(f"failure-free, 2 nodes: {time.time() - t0:.1f} s from sbatch to the end ({load()})")
    return job.out


def test_a_failure_free_run_on_four_nodes_is_bitwise_the_two_node_run(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    job = submit(cluster, tmp_path, "four", 4, "--data.path", str(corpus), *FLAGS)
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    bitwise(reference, job.out)
    rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    assert {r["live_replicas"] for r in rows} == {4}
    assert not list((job.out / "logs").glob("*.exit.node1"))  # one node per replica: node 0 of its step


def test_a_replica_notice_is_a_leave_and_a_replacement_step_joins(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """`scancel --signal=TERM JOBID.STEP` of replica 1's step (a node's notice): it leaves at its next commit,
    its step ends with 143 and the script starts a replacement step with --join, which takes the others'
    state at a step boundary; no failure is detected, the job ends COMPLETED."""
    job = submit(cluster, tmp_path, "notice", 2, "--data.path", str(corpus), *FLAGS,
                 "--training.device_time_s", "0.15")
    job.wait_step(2)
    t0 = time.time()
    # Slurm 22.05's scancel signals the step yet answers "Invalid job id specified" (exit 225) here: the test
    # judges by what the step did
    cluster.run(["scancel", "--signal=TERM", job.steps()["replica-1"]], check=False)
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    bitwise(reference, job.out)
    ev = job.events()
    (leave,) = [e for e in ev if e["kind"] == "leave"]
    back = [e for e in ev if e["kind"] == "started" and e.get("replica") == 1 and e.get("joined")]
    assert leave["replicas"] == [1] and back and not [e for e in ev if e["kind"] == "failure_detected"]
    assert "replica 1 left the job on a notice" in job.output() and "lost" not in job.output()
    print(f"replica 1's notice: left {leave['t'] - t0:.2f} s after scancel, its replacement trained again "
          f"{back[0]['t'] - t0:.1f} s after ({load()})")


def test_a_node_dies_and_another_is_set_down_the_job_trains_on_and_prometheus_saw_it(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """4 replicas on 4 nodes (#SBATCH --no-kill). Node n1 dies (its slurmd and every process on it
    SIGKILLed); later `scontrol update nodename=n2 state=down`. Each time the survivors recover in-step and
    the job trains on to COMPLETED 0:0, every step with all microbatches, bitwise; the script names both
    lost replicas; summary.json counts both losses; a real Prometheus scraping the coordinator shows the
    generations, the live replicas falling to 2, the failures by cause, and the goodput."""
    why = prometheus_missing()
    if why:
        pytest.skip(why)
    prom = Prometheus(tmp_path / "prometheus", cluster.hosts, f"{cluster.hosts.addr['n0']}:{METRICS_PORT}")
    try:
        job = submit(cluster, tmp_path, "deaths", 4, "--data.path", str(corpus), *FLAGS,
                     "--training.device_time_s", "0.1", env={"METRICS_PORT": str(METRICS_PORT)})
        job.wait_step(4)
        prom.wait_up(60)
        t_kill = time.time()
        cluster.kill_node("n1")
        job.wait_step(job.last_step() + 4)
        cluster.run(["scontrol", "update", "nodename=n2", "state=down", "reason=tier"])
        state = job.wait()
        assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
        bitwise(reference, job.out)
        out = job.output()
        assert "replica 1 lost" in out and "replica 2 lost" in out and "node n1 is down" in out, out
        summary = job.summary()
        assert summary["failures_detected"] == {"connection_closed": 2}, summary["failures_detected"]
        assert sorted(x["replica"] for x in summary["recoveries"]) == [1, 2]
        rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["live_replicas"] == 4 and rows[-1]["live_replicas"] == 2
        over = {"live": "recover_live_replicas", "generation": "recover_generation", "goodput": "recover_goodput",
                "failures": 'recover_failures_total{cause="connection_closed"}', "step": "recover_committed_step"}
        series = {f"{fn}_{key}": prom.value(f"{fn}_over_time({name}[10m])") for key, name in over.items()
                  for fn in ("min", "max")}
        live = [int(v) for v in prom.samples("recover_live_replicas[10m]")]
        changes = [v for i, v in enumerate(live) if i == 0 or v != live[i - 1]]
        print(f"prometheus: {series}; live replicas as scraped: {changes}")
        # counting up as the replicas register, 4 training, 3 after n1's death, 2 after n2's; then 1 and 0 as the
        # last two finish and leave
        assert series["max_live"] == 4 and changes[changes.index(4):][:3] == [4, 3, 2], changes
        assert series["max_generation"] >= 3 and series["max_failures"] == 2
        assert 0 < series["max_goodput"] <= 1
        assert series["max_step"] >= STEPS - 5  # scraped every second
        lat = [x["latency_ms"] for x in summary["recoveries"]]
        print(f"node deaths: recovered in {lat} ms; job {time.time() - t_kill:.1f} s after the first ({load()})")
    finally:
        prom.stop()
        cluster.start_node("n1")  # the node comes back (ReturnToService=2) for the tests after this one
        cluster.run(["scontrol", "update", "nodename=n1,n2", "state=resume"], check=False)
        cluster.wait_nodes("idle", 90)


def test_the_time_limit_notice_stops_with_a_checkpoint_requeues_and_the_job_resumes(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """`--time=2 --signal=B:TERM@35`: Slurm's own timer signals the batch script; the next commit is a stop, a
    checkpoint is saved, the script requeues the job (it is still RUNNING), and the requeued job resumes
    from the checkpoint to the end. slurmctld looks at time limits in rounds of about 30 s and may send the
    signal up to a minute before @ seconds remain, so it comes 25 to 85 s into the job (a CI run saw none by
    67 s): 0.8 s per microbatch keeps the job training past its limit (40 steps of 3.2 s), so a job that
    completes without the notice fails the test instead of passing by luck."""
    job = submit(cluster, tmp_path, "limit", 2, "--data.path", str(corpus), *FLAGS,
                 "--training.device_time_s", "0.8", sbatch=("--time=2", "--signal=B:TERM@35"))
    job.restart_now(1, timeout=200)
    assert "requeueing job" in job.output(), job.output()
    stopped = json.loads((job.out / "summary.json").read_text())
    assert stopped["stopped"] and 0 < stopped["committed_steps"] < STEPS, job.output()
    state = job.wait()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), job.output()
    assert "continuing from the newest complete checkpoint" in job.output()
    bitwise(reference, job.out)
    print(f"time-limit notice: stopped after {stopped['committed_steps']} steps, resumed to the end ({load()})")


def test_scancel_batch_requeues_scancel_ends_and_a_new_submission_continues(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """`scancel --batch --signal=TERM JOBID` (the script alone) is a stop that requeues; on the requeued
    start, `scancel JOBID` (every process) is a stop too, but the job ends CANCELLED and is not requeued;
    submitting the script again with the same OUT continues from the newest checkpoint to the end."""
    args = ("--data.path", str(corpus), *FLAGS, "--training.device_time_s", "0.2")
    job = submit(cluster, tmp_path, "cancel", 2, *args)
    job.wait_step(3)
    cluster.run(["scancel", "--batch", "--signal=TERM", job.id])
    job.restart_now(1)
    assert "requeueing job" in job.output(), job.output()
    first = job.summary()["committed_steps"]
    job.wait_step(first + 3)
    cluster.run(["scancel", job.id])
    state = job.wait(until=("CANCELLED",))
    assert state["Restarts"] == "1"
    time.sleep(3)
    assert job.state()["JobState"] == "CANCELLED"  # for good: not requeued
    assert "not requeued" in job.output() and job.output().count("requeueing job") == 1, job.output()
    second = job.summary()
    assert second["stopped"] and first < second["committed_steps"] < STEPS
    again = submit(cluster, tmp_path, "cancel-again", 2, *args, out=job.out)
    state = again.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), again.output()
    bitwise(reference, job.out)


def test_the_coordinator_killed_is_started_again_and_no_step_is_lost(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    job = submit(cluster, tmp_path, "coord", 2, "--data.path", str(corpus), *FLAGS,
                 "--training.device_time_s", "0.1")
    job.wait_step(4)
    (pid,) = [p for p, command in cluster.hosts.commands_in("n0").items() if b"recover\x00coordinator" in command]
    os.kill(pid, signal.SIGKILL)
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    assert "starting it again" in job.output()
    bitwise(reference, job.out)
    summary = job.summary()
    assert summary["coordinator_restarts"] == 1 and summary["failures_detected"] == {}, summary
    print(f"coordinator killed: outage {summary['coordinator_outage_ms_max']} ms at most ({load()})")


def test_a_replica_spanning_two_nodes_trains_bitwise(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """PROCS_PER_REPLICA=2 with one rank per node: 2 replicas, each a torchrun job across 2 nodes whose
    rendezvous is at its first node's NodeAddr; FSDP over the two ranks. Bitwise equal to the one-process
    replicas' run (deterministic mode sums every microbatch in float64, whatever the layout)."""
    job = submit(cluster, tmp_path, "span", 4, "--data.path", str(corpus), *FLAGS, "--parallel.fsdp", "2",
                 env={"PROCS_PER_REPLICA": "2", "RANKS_PER_NODE": "1"})
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    bitwise(reference, job.out)
    assert sorted(p.name for p in (job.out / "logs").glob("replica_1.exit.node*")) == [
        "replica_1.exit.node0", "replica_1.exit.node1"]


def test_a_notice_after_every_step_was_committed_changes_nothing(
        cluster: SlurmCluster, reference: Path, tmp_path: Path, corpus: Path) -> None:
    """The notice reaches the script after the replicas finished (while `recover collect` writes the outputs):
    the run's own end decides, so the job ends COMPLETED 0:0 and is not requeued to redo steps."""
    job = submit(cluster, tmp_path, "late", 2, "--data.path", str(corpus), *FLAGS)
    deadline = time.time() + 180
    while not (job.out / "metrics.jsonl").is_file():  # written by the script's `recover collect`, at the end
        assert time.time() < deadline and job.state().get("JobState") in ("RUNNING", "PENDING"), job.output()
        time.sleep(0.05)
    cluster.run(["scancel", "--batch", "--signal=TERM", job.id], check=False)
    state = job.wait()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "0"), job.output()
    assert "signal: stopping" in job.output() and "requeueing" not in job.output(), job.output()
    bitwise(reference, job.out)


def test_a_users_script_runs_as_the_replicas_and_a_notice_replaces_one(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """SCRIPT=train.py (recover.api, the README's example at 0.3 s a microbatch, time for a replacement's torchrun
    and script to start on 2 busy cores and join): the recipe runs the user's
    script as each replica in place of `recover worker`. Replica 1's step gets `scancel --signal=TERM`: it leaves
    at its next commit and a replacement step joins; COMPLETED 0:0, every step bitwise the script's one-replica
    failure-free `recover launch`."""
    ref = tmp_path / "script-ref"
    got = run_recover(["launch", "--config", "debug", "--replicas", "1", "--out", str(ref), "--no-progress",
                       "--deterministic", "--", sys.executable, str(SLOW_SCRIPT)], timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    job = submit(cluster, tmp_path, "script", 2, "--training.deterministic", "true",
                 env={"SCRIPT": str(SLOW_SCRIPT), "PYTHON": sys.executable, "SLOW_S": "0.3"})
    job.wait_step(1)
    cluster.run(["scancel", "--signal=TERM", job.steps()["replica-1"]], check=False)  # see the notice test
    state = job.wait()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20)) and {r["microbatches"] for r in rows} == {4}
    assert [r["loss"] for r in rows] == [r["loss"] for r in want]  # bitwise
    ev = job.events()
    assert [e["replicas"] for e in ev if e["kind"] == "leave"] == [[1]]
    assert [e for e in ev if e["kind"] == "started" and e.get("replica") == 1 and e.get("joined")]
    assert "replica 1 left the job on a notice" in job.output()
