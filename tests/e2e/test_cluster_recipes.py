"""The cluster recipes of examples/ run on this machine: the Slurm batch script under bash with local
stand-ins for srun, scontrol and torchrun, and the Kubernetes manifests rendered, parsed and their
containers' commands run as the pods would run them, real torchrun included (the Service names
mapped to 127.0.0.1).

Each job is 2 replicas of 1 process (`debug` preset, emulated devices). Every process a test starts
is found by its parentage (torchrun starts its workers in sessions of their own) and SIGKILLed by
PID at the end, whatever happened. A preemption notice is sent as the cluster sends it: Slurm's to
every process of one step (`scancel --signal=TERM JOBID.STEPID`), the kubelet's to a pod's first
process. Each test prints the notice's cost: signal -> the leave committed, and -> the replacement
training again (with the machine's load).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, run_recover, subprocess_env
from recover.launch.processes import free_port
from recover.launch.records import StepRecords

pytestmark = pytest.mark.slow

STEPS = 20
FLAGS = ["--training.steps", str(STEPS), "--training.eval_every", "10", "--training.deterministic", "true",
         "--training.threads", "1"]

SRUN = """#!/bin/bash
# srun stand-in: runs the step's command here, as its one task, with the task's Slurm variables
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --output=*) out=${1#--output=}; shift ;;
    --*=*|--exact|--overlap) shift ;;
    *) break ;;
  esac
done
line="srun $$$(printf ' %q' "$@")"  # its PID (the step's first process) and its command, on one line
echo "$line" >> "$FAKE_SLURM_LOG"  # one write: steps start together
export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 SLURM_STEP_ID=$$
if [ -n "$out" ]; then exec "$@" >> "$out" 2>&1; else exec "$@"; fi
"""
TORCHRUN = """#!/bin/bash
# torchrun stand-in for replicas of one process: runs the module (or the script) itself (saves two torch
# imports per replica; the Kubernetes test runs the real torchrun)
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do shift; done
if [ "$1" = "-m" ]; then shift; exec "$PYTHON" -m "$@"; fi
exec "$PYTHON" "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: `show hostnames LIST` (a plain comma-separated list) and `requeue JOBID`
case "$1 $2" in
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
  requeue*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "scontrol stand-in: $*: not supported" >&2; exit 1 ;;
esac
"""


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (by parent PID, through sessions), deepest first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out[::-1]


class Procs:
    """Processes a test started, each in its own session; :meth:`kill_all` SIGKILLs them and everything
    below them by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.seen: set[int] = set()

    def start(self, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        with open(log, "a") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def track(self) -> None:
        """Remembers the processes below the started ones now (an orphan is still killed at the end)."""
        for p in self.procs:
            self.seen.update(descendants(p.pid))

    def kill_all(self) -> None:
        self.track()
        for pid in [*sorted(self.seen, reverse=True), *(p.pid for p in self.procs)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.kill_all()


def wait_for(proc: subprocess.Popen[str], procs: Procs, timeout: float, log: Path) -> int:
    deadline = time.time() + timeout
    while proc.poll() is None:
        assert time.time() < deadline, f"timed out after {timeout} s:\n{log.read_text()[-3000:]}"
        procs.track()
        time.sleep(0.2)
    return proc.returncode


def committed(run: Path) -> list[dict]:
    """The run's step records (metrics.jsonl, written by `recover collect`)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def last_step(run: Path, replica: int = 0) -> int:
    """The newest step ``replica`` recorded (-1: none yet)."""
    path = run / "replicas" / f"replica_{replica}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else -1


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def notice_costs(ev: list[dict], replica: int, t0: float) -> tuple[dict, dict]:
    """The leave of ``replica`` signalled at ``t0`` and its replacement's start (joined, after the leave);
    prints what each cost, with the machine's load."""
    (leave,) = [e for e in ev if e["kind"] == "leave"]
    back = [e for e in ev if e["kind"] == "started" and e.get("replica") == replica and e["joined"]
            and e["t"] > leave["t"]]
    assert leave["replicas"] == [replica] and back, [e for e in ev if e.get("replica") == replica][-5:]
    print(f"replica {replica}'s notice: the leave committed {(leave['t'] - t0) * 1e3:.0f} ms later (step "
          f"{leave['step']}), its replacement trained again {back[0]['t'] - t0:.1f} s later; load "
          f"{os.getloadavg()[0]:.1f}")
    return leave, back[0]


def step_pid(slurm_log: Path, replica: int) -> int:
    """The first process of ``replica``'s newest srun step (the stand-in logs its PID and command)."""
    steps = [line.split() for line in slurm_log.read_text().splitlines() if line.startswith("srun ")]
    return int([words for words in steps if f"replica-{replica}" in words][-1][1])


def test_slurm_script_runs_is_preempted_requeues_resumes_and_replaces_a_replica_that_got_a_notice(
        tmp_path: Path, corpus: Path, procs: Procs) -> None:
    """The sbatch script with srun, scontrol and torchrun stand-ins, a deterministic job of 2 replicas:
    SIGTERM to every process of the job at once (the time limit, a preemption: the batch shell, the
    coordinator it started and every step; the replicas' leave votes and the script's and Slurm's stop
    requests meet) stops it at a step boundary with a checkpoint, exit 6, `recover collect` and a
    requeue (--signal=B:TERM@120 reaches the batch shell alone: the same without the leave votes); the
    requeued start resumes (--resume). There,
    replica 1's step gets SIGTERM in every process (`scancel --signal=TERM JOBID.STEPID`, a node's
    preemption notice): replica 1 leaves at its next commit (no failure detected), its step ends with
    143, and the script starts a replacement step (--join) that rejoins. The job ends with exit 0: every
    step once in metrics.jsonl with 8 microbatches, bitwise equal to a failure-free run."""
    ref = tmp_path / "ref"  # failure-free; deterministic: one replica computes what two do, bit for bit
    run_recover(["launch", "--config", "debug", "--replicas", "1", "--out", str(ref), "--no-progress",
                 "--data.path", str(corpus), *FLAGS])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run, slurm_log = tmp_path / "run", tmp_path / "slurm.log"
    env = {**subprocess_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_LOG": str(slurm_log),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "OUT": str(run), "CONFIG": "debug", "GPUS_PER_NODE": "0",
           "RANKS_PER_NODE": "2", "PORT": str(free_port()), "STORE_PORT": str(free_port()),
           "RECOVER": f"{sys.executable} -m recover", "TORCHRUN": str(bin_dir / "torchrun"), "PYTHON": sys.executable}
    # 0.15 s per microbatch: replica 0 alone takes 1.2 s a step, time for the replacement to start (4 to
    # 8 s at load 6-7 on 2 cores, one process without torchrun) and join within the ~14 steps after the
    # notice
    cmd = ["bash", str(ROOT / "examples" / "slurm" / "recover.sbatch"), "--data.path", str(corpus), *FLAGS,
           "--training.device_time_s", "0.15"]

    log = tmp_path / "job.out"
    job = procs.start(cmd, env, log)
    deadline = time.time() + 120
    while last_step(run) < 1:
        assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        procs.track()
        time.sleep(0.1)
    for pid in [job.pid, *descendants(job.pid)]:  # the time limit, a preemption: every process at once
        os.kill(pid, signal.SIGTERM)
    assert wait_for(job, procs, 120, log) == 6, log.read_text()[-3000:]
    stopped = committed(run)
    assert 2 <= len(stopped) < STEPS and (run / "checkpoints" / f"step_{len(stopped):06d}" / "COMMITTED").is_file()
    assert "requeue 4242" in slurm_log.read_text()
    assert json.loads((run / "summary.json").read_text())["stopped"]

    job = procs.start(cmd, {**env, "SLURM_RESTART_COUNT": "1"}, log)  # what Slurm runs after the requeue
    deadline = time.time() + 120
    while last_step(run) < len(stopped) + 1:
        assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        procs.track()
        time.sleep(0.1)
    first = step_pid(slurm_log, 1)
    t0 = time.time()
    for pid in [first, *descendants(first)]:  # scancel --signal=TERM 4242.STEP: every process of the step
        os.kill(pid, signal.SIGTERM)
    assert wait_for(job, procs, 180, log) == 0, log.read_text()[-3000:]

    rows = committed(run)
    assert [r["step"] for r in rows] == list(range(STEPS)) and {r["microbatches"] for r in rows} == {8}
    assert [r["loss"] for r in rows[:len(stopped)]] == [r["loss"] for r in stopped]
    assert [r["loss"] for r in rows] == [r["loss"] for r in committed(ref)]  # bitwise
    summary = json.loads((run / "summary.json").read_text())
    assert summary["committed_steps"] == STEPS and not summary["stopped"]
    ev = events(run)
    leave, back = notice_costs(ev, 1, t0)
    assert not [e for e in ev if e["kind"] == "failure_detected"]
    assert rows[leave["step"] + 1]["live_replicas"] == 1 and rows[-1]["live_replicas"] == 2
    assert "replica 1 left the job on a notice" in log.read_text() and "continuing from" in log.read_text()
    starts = [line for line in slurm_log.read_text().splitlines() if line.startswith("srun ")]
    assert [("--resume" in s, "--join" in s) for s in starts] == [(False, False)] * 2 + [(True, False)] * 2 + [
        (False, True)]  # no replacement after the stop: only after the notice
    assert step_pid(slurm_log, 1) != first and "replica-1" in starts[-1]


SLOW_SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_slow.py"


def test_slurm_script_runs_a_users_script_as_the_replicas_and_replaces_one_that_got_a_notice(
        tmp_path: Path, procs: Procs) -> None:
    """SCRIPT=train.py: the sbatch script runs the user's script (recover.api) as each replica, in place of
    `recover worker`. Replica 1's step gets SIGTERM in every process (a node's notice): it leaves at its next
    commit, its step ends with 143 and the replacement step joins (`"join": true` in its RECOVER_WORKER). The job
    ends with exit 0, every step bitwise the script's one-replica failure-free run."""
    ref = tmp_path / "ref"
    run_recover(["launch", "--config", "debug", "--replicas", "1", "--out", str(ref), "--no-progress",
                 "--deterministic", "--", sys.executable, str(SLOW_SCRIPT)], timeout=300)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run, slurm_log = tmp_path / "run", tmp_path / "slurm.log"
    env = {**subprocess_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_LOG": str(slurm_log),
           "SLURM_JOB_ID": "4243", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "OUT": str(run), "CONFIG": "debug", "GPUS_PER_NODE": "0",
           "RANKS_PER_NODE": "2", "PORT": str(free_port()), "STORE_PORT": str(free_port()),
           "RECOVER": f"{sys.executable} -m recover", "TORCHRUN": str(bin_dir / "torchrun"), "PYTHON": sys.executable,
           "SCRIPT": str(SLOW_SCRIPT)}
    log = tmp_path / "job.out"
    job = procs.start(["bash", str(ROOT / "examples" / "slurm" / "recover.sbatch"), "--training.deterministic",
                       "true"], env, log)
    deadline = time.time() + 120
    while last_step(run) < 2:
        assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        procs.track()
        time.sleep(0.1)
    first = step_pid(slurm_log, 1)
    t0 = time.time()
    for pid in [first, *descendants(first)]:  # scancel --signal=TERM 4243.STEP: every process of the step
        os.kill(pid, signal.SIGTERM)
    assert wait_for(job, procs, 180, log) == 0, log.read_text()[-3000:]
    rows = committed(run)
    assert [r["step"] for r in rows] == list(range(20)) and {r["microbatches"] for r in rows} == {4}
    assert [r["loss"] for r in rows] == [r["loss"] for r in committed(ref)]  # bitwise
    ev = events(run)
    leave, _ = notice_costs(ev, 1, t0)
    assert not [e for e in ev if e["kind"] == "failure_detected"] and rows[leave["step"] + 1]["live_replicas"] == 1
    assert "replica 1 left the job on a notice" in log.read_text()
    starts = [line for line in slurm_log.read_text().splitlines() if line.startswith("srun ")]
    assert len(starts) == 3 and "replica-1" in starts[-1] and "join\\\":\\ true" in starts[-1]


def load_render() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_render", ROOT / "examples" / "k8s" / "render.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pod_command(pod: dict, root: Path, services: list[str], docs: list[dict]) -> list[str]:
    """The pod's container command as this machine runs it: each volume a directory under ``root``
    (a Secret's keys written into it), each Service name resolved to 127.0.0.1."""
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "emptyDir" in vol:
            continue
        local = root / m["name"]
        local.mkdir(exist_ok=True)
        if "secret" in vol:
            name = vol["secret"]["secretName"]
            (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
            for key, value in secret["stringData"].items():
                (local / key).write_text(value)
        mounts[m["mountPath"]] = str(local)

    def local(arg: str) -> str:
        for path, there in mounts.items():
            arg = arg.replace(path + "/", there + "/").replace("=" + path, "=" + there)
        for name in services:
            arg = arg.replace(name + ":", "127.0.0.1:").replace("=" + name, "=127.0.0.1")
        return arg

    return [local(a) for a in container["command"]]


def test_kubernetes_manifests_render_parse_and_their_pods_commands_train_and_a_deleted_pod_is_replaced(
        tmp_path: Path, corpus: Path, procs: Procs) -> None:
    """render.py fills the template (and refuses a bad value); the manifests parse (PyYAML and the
    subset reader agree); the coordinator's and both replica pods' commands run here with the
    Service name mapped to 127.0.0.1. Replica 1's pod is deleted (SIGTERM to its first process, as the
    kubelet sends it): replica 1 leaves at its next commit (no failure detected) and the pod ends with
    143, which the Job's podFailurePolicy ignores (a replacement, not counted against backoffLimit; a
    pod that exits 0 would be its index completed); the replacement pod runs the same command and joins
    the running job; every step is committed with all microbatches, both pods end with 0."""
    render = [sys.executable, str(ROOT / "examples" / "k8s" / "render.py")]
    bad = subprocess.run([*render, "--set", "GRACE_S=10"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "GRACE_S=10" in bad.stderr and not bad.stdout
    # 2 pods on 2 cores: one thread each; 20 steps of 0.15 s per microbatch leave replica 0 alone for
    # 21 s after the leave (1.2 s a step), time enough for the new pod to start up (its torchrun and
    # its worker: 8 to 17 s on 2 busy cores) and join
    overrides = " ".join(["--data.path", str(corpus), "--training.threads", "1", "--training.steps", "20",
                          "--training.device_time_s", "0.15"])
    sets = {"NAME": "rt", "CONFIG": "debug", "REPLICAS": "2", "GPUS_PER_REPLICA": "0", "OVERRIDES": overrides,
            "PORT": str(free_port()), "STORE_PORT": str(free_port())}
    out = subprocess.run([*render, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    mod = load_render()
    docs = mod.load_all(out)  # type: ignore[attr-defined]
    assert docs == mod.load_subset(out)  # type: ignore[attr-defined]
    kinds = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
    assert kinds == {"Secret/rt-token", "PersistentVolumeClaim/rt-runs", "Service/rt-coordinator",
                     "Deployment/rt-coordinator", "Service/rt-replicas", "Job/rt-replicas"}
    coord_pod, job = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"], \
        next(d for d in docs if d["kind"] == "Job")
    spec, pod_spec = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == 2
    assert pod_spec["terminationGracePeriodSeconds"] > 20 and pod_spec["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["podFailurePolicy"]["rules"] == [  # evictions, preemptions and leaves are not failures
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": "replica", "operator": "In", "values": [143]}}]

    bin_dir = tmp_path / "bin"  # the image's entry points
    bin_dir.mkdir()
    for name, module in (("recover", "recover"), ("torchrun", "torch.distributed.run")):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    env = {**subprocess_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    coord_cmd = pod_command(coord_pod[0], tmp_path, services, docs)
    replica_cmd = pod_command(job["spec"]["template"], tmp_path, services, docs)
    run = tmp_path / "runs" / "rt"

    coordinator = procs.start(coord_cmd, env, tmp_path / "coordinator.log")
    deadline = time.time() + 120
    while '"ready": true' not in (tmp_path / "coordinator.log").read_text():
        assert coordinator.poll() is None and time.time() < deadline, (tmp_path / "coordinator.log").read_text()
        time.sleep(0.1)
    pods = {i: procs.start(replica_cmd, {**env, "JOB_COMPLETION_INDEX": str(i)}, tmp_path / f"replica_{i}.log")
            for i in (0, 1)}
    deadline = time.time() + 120
    while last_step(run) < 0:
        assert all(p.poll() is None for p in pods.values()) and time.time() < deadline, \
            (tmp_path / "replica_0.log").read_text()[-3000:]
        procs.track()
        time.sleep(0.1)
    t0 = time.time()
    pods[1].send_signal(signal.SIGTERM)  # kubectl delete pod, a drain, a preemption: its first process
    assert wait_for(pods[1], procs, 60, tmp_path / "replica_1.log") == 143
    print(f"the deleted pod ended {time.time() - t0:.1f} s after its SIGTERM")
    # the Job's new pod for index 1 (podReplacementPolicy Failed: once the old one has terminated)
    pods[1] = procs.start(replica_cmd, {**env, "JOB_COMPLETION_INDEX": "1"}, tmp_path / "replica_1.log")
    for i, pod in pods.items():
        assert wait_for(pod, procs, 180, tmp_path / f"replica_{i}.log") == 0

    # the step records as `recover collect` merges them (the Slurm test runs the command itself)
    merged = StepRecords(json.loads(line) for path in sorted((run / "replicas").glob("*.jsonl"))
                         for line in path.read_text().splitlines()).merged()
    rows = [merged[s] for s in sorted(merged)]
    assert [r["step"] for r in rows] == list(range(20)) and {r["microbatches"] for r in rows} == {8}
    ev = events(run)
    leave, _ = notice_costs(ev, 1, t0)
    assert not [e for e in ev if e["kind"] == "failure_detected"] and rows[-1]["live_replicas"] == 2
    assert rows[leave["step"] + 1]["live_replicas"] == 1
    coordinator.send_signal(signal.SIGTERM)  # kubectl delete: with no job running it exits at once
    assert coordinator.wait(20) == 0


def test_kubernetes_replica_pods_run_a_users_script_when_script_is_set(tmp_path: Path, procs: Procs) -> None:
    """SCRIPT=train.py: each replica pod's torchrun runs the user's script (recover.api) with RECOVER_WORKER
    written by the pod's command, in place of `recover worker`. Replica 1's pod is deleted (SIGTERM): it leaves at
    its next commit and ends with 143; the Job's new pod for index 1 runs the same command and ends with 0 (joined,
    or told that the job is over); every step holds its 4 microbatches, bitwise the one-replica failure-free run."""
    ref = tmp_path / "ref"
    run_recover(["launch", "--config", "debug", "--replicas", "1", "--out", str(ref), "--no-progress",
                 "--deterministic", "--", sys.executable, str(SLOW_SCRIPT)], timeout=300)
    render = [sys.executable, str(ROOT / "examples" / "k8s" / "render.py")]
    sets = {"NAME": "rs", "CONFIG": "debug", "REPLICAS": "2", "GPUS_PER_REPLICA": "0", "SCRIPT": str(SLOW_SCRIPT),
            "OVERRIDES": "--training.deterministic true", "PORT": str(free_port()), "STORE_PORT": str(free_port())}
    out = subprocess.run([*render, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    mod = load_render()
    docs = mod.load_all(out)  # type: ignore[attr-defined]
    assert docs == mod.load_subset(out)  # type: ignore[attr-defined]
    coord_pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    job = next(d for d in docs if d["kind"] == "Job")
    bin_dir = tmp_path / "bin"  # the image's entry points
    bin_dir.mkdir()
    for name, module in (("recover", "recover"), ("torchrun", "torch.distributed.run")):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    env = {**subprocess_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    replica_cmd = pod_command(job["spec"]["template"], tmp_path, services, docs)
    assert "RECOVER_WORKER=" in replica_cmd[-1] and "recover worker" in replica_cmd[-1]  # both branches there
    run = tmp_path / "runs" / "rs"
    coordinator = procs.start(pod_command(coord_pod, tmp_path, services, docs), env, tmp_path / "coordinator.log")
    deadline = time.time() + 120
    while '"ready": true' not in (tmp_path / "coordinator.log").read_text():
        assert coordinator.poll() is None and time.time() < deadline, (tmp_path / "coordinator.log").read_text()
        time.sleep(0.1)
    pods = {i: procs.start(replica_cmd, {**env, "JOB_COMPLETION_INDEX": str(i)}, tmp_path / f"replica_{i}.log")
            for i in (0, 1)}
    deadline = time.time() + 120
    while last_step(run) < 1:
        assert all(p.poll() is None for p in pods.values()) and time.time() < deadline, \
            (tmp_path / "replica_0.log").read_text()[-3000:]
        procs.track()
        time.sleep(0.1)
    pods[1].send_signal(signal.SIGTERM)  # kubectl delete pod: its first process
    assert wait_for(pods[1], procs, 60, tmp_path / "replica_1.log") == 143
    pods[1] = procs.start(replica_cmd, {**env, "JOB_COMPLETION_INDEX": "1"}, tmp_path / "replica_1.log")
    for i, pod in pods.items():
        log = tmp_path / f"replica_{i}.log"
        assert wait_for(pod, procs, 180, log) == 0, log.read_text()[-3000:]
    merged = StepRecords(json.loads(line) for path in sorted((run / "replicas").glob("*.jsonl"))
                         for line in path.read_text().splitlines()).merged()
    rows = [merged[s] for s in sorted(merged)]
    assert [r["step"] for r in rows] == list(range(20)) and {r["microbatches"] for r in rows} == {4}
    assert [r["loss"] for r in rows] == [r["loss"] for r in committed(ref)]  # bitwise
    assert [e["replicas"] for e in events(run) if e["kind"] == "leave"] == [[1]]
    coordinator.send_signal(signal.SIGTERM)
