"""The Kubernetes recipe (examples/k8s/) as far as this machine can take it without an API server (none is
packaged in the registries these machines reach): every rendered manifest checked against the Kubernetes API
schema offline (`kubernetes-validate`, strict: an unknown field is an error), and the rendered pods' commands
run as the pods would run them, each pod on a host of its own.

A pod here is its container's command from the rendered manifest, with the container's environment, in a
network namespace of its own (netns.py: its own address on a private bridge) and a UTS namespace whose host
name is the pod's, which resolves to its address (as the kubelet writes it into the pod's /etc/hosts). The
Service's name resolves to the coordinator pod's address through each namespace's hosts file, as a
cluster's DNS resolves it to the Service's address: the replicas reach the coordinator and its c10d store
across the bridge, never through 127.0.0.1. A new coordinator pod takes the same address (the Service's,
which outlives its pods); a new replica pod (the Job's replacement for its index) gets a new host and
address. Volumes are directories (the claim's, an emptyDir the pod's own, the Secret's keys written as
files), the image's entry points (`recover`, `torchrun`) scripts running this interpreter's; torchrun is
the real one.

Scenarios (deterministic, `debug` preset, 2 replicas of 1 process, 30 steps), each compared bitwise with
a failure-free `recover launch` of the same config (`recover compare --tol 0` on what `recover collect`
makes of the run, as the README runs them in the coordinator's pod): failure-free; a replica pod killed
(SIGKILL to every process of it: the others recover in-step and the Job's new pod joins); a replica pod
deleted (SIGTERM to its first process: the replica leaves at its next commit, the pod ends with 143, the
new pod joins); the coordinator pod killed and a new one started with the same command (the replicas wait
for it and lose no step); the coordinator pod deleted (SIGTERM: a stop at a checkpoint, the replica pods
end with 6, the new pods resume from it). Every pod ends by itself (the coordinator on SIGTERM, as
`kubectl delete` sends it once the Job is done) and no process is left in any of the namespaces; then the
namespaces go.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from netns import Hosts, usable

from recover.names import Event

ROOT = Path(__file__).resolve().parents[2]
RENDER = ROOT / "examples" / "k8s" / "render.py"
OLDEST, NEWEST = (1, 29), (1, 37)  # podReplacementPolicy is on by default from 1.29 (beta)
STEPS = 30
FLAGS = ["--training.steps", str(STEPS), "--training.eval_every", "10", "--training.deterministic", "true",
         "--training.threads", "1"]
# emulated device time per microbatch (it changes no bit). Where a new replica pod must join: 0.8 s a step
# with both replicas, 1.6 s with one: the ~45 s after a fault at step 0 leave it time to start (torchrun
# and its worker: 8 to 27 s on 2 cores at load 6-10) and join; elsewhere steps as short as a pod's tests allow
JOINING_S, SHORT_S = "0.2", "0.05"
SHAPES = {  # representative renderings: what --set combinations users write
    "cpu": {"REPLICAS": "2", "GPUS_PER_REPLICA": "0", "CONFIG": "debug"},
    "gpus": {"REPLICAS": "4", "IMAGE": "registry.example/recover:1", "CONFIG": "125m",
             "OVERRIDES": "--data.path /runs/data/mine --training.steps 5000"},
    "multi-rank": {"NAME": "llm-a", "REPLICAS": "3", "PROCS_PER_REPLICA": "4", "GPUS_PER_REPLICA": "4",
                   "MIN_REPLICAS": "2", "STORAGE": "2Ti", "STORAGE_CLASS": "cephfs", "GRACE_S": "300",
                   "OVERRIDES": "--parallel.tp 2 --parallel.fsdp 2 --data.path /runs/data/mine"},
}


def render(sets: dict[str, str]) -> str:
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def load_render() -> Any:
    """examples/k8s/render.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_render", RENDER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def versions() -> list[str]:
    """Every Kubernetes minor version from OLDEST to NEWEST."""
    return [f"{OLDEST[0]}.{minor}" for minor in range(OLDEST[1], NEWEST[1] + 1)]


# ---- the manifests against the API schema ----------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_every_rendered_manifest_is_valid_against_the_kubernetes_api_schema(shape: str) -> None:
    """Each document of the rendering is valid, strictly (no field the API does not know), for every
    Kubernetes version the recipe supports (1.29, when podReplacementPolicy became beta, to the newest the
    package knows)."""
    kv = pytest.importorskip("kubernetes_validate", reason="`make test-slurm` installs kubernetes-validate")
    yaml = pytest.importorskip("yaml")
    text = render(SHAPES[shape])
    docs = list(yaml.safe_load_all(text))
    assert docs == load_render().load_subset(text)  # render.py's own reader (no PyYAML) reads the same
    assert [d["kind"] for d in docs] == ["Secret", "PersistentVolumeClaim", "Service", "Deployment", "Service",
                                         "Job"]
    for version in versions():
        for doc in docs:
            kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


@pytest.mark.parametrize("breakage", ["misspelt field", "wrong type", "missing field"])
def test_the_schema_check_rejects_a_broken_manifest(breakage: str) -> None:
    """The check above can fail: a field the API does not know, a number as a string, a Service port
    without its port."""
    kv = pytest.importorskip("kubernetes_validate", reason="`make test-slurm` installs kubernetes-validate")
    yaml = pytest.importorskip("yaml")
    text = render(SHAPES["cpu"])
    broken = {"misspelt field": lambda t: t.replace("restartPolicy: Never", "restartPolicyy: Never"),
              "wrong type": lambda t: re.sub(r"completions: (\d+)", r'completions: "\1"', t),
              "missing field": lambda t: re.sub(r"\n +port: \d+", "", t, count=1)}[breakage](text)
    assert broken != text
    bad = [d for d in yaml.safe_load_all(broken) if d not in list(yaml.safe_load_all(text))]
    assert len(bad) == 1
    with pytest.raises(kv.ValidationError):
        kv.validate(bad[0], f"{NEWEST[0]}.{NEWEST[1]}", strict=True)


def test_render_refuses_a_bad_value_and_the_job_replaces_a_left_or_disrupted_pod() -> None:
    """render.py refuses a value out of range before writing anything; the Job's pods are replaced, not
    counted as failures, when they end with 6 (a stop, checkpoint saved) or 143 (a leave) or were disrupted
    (eviction, preemption, drain)."""
    yaml = pytest.importorskip("yaml")
    bad = subprocess.run([sys.executable, str(RENDER), "--set", "GRACE_S=10"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "GRACE_S=10" in bad.stderr and not bad.stdout
    (job,) = [d for d in yaml.safe_load_all(render(SHAPES["cpu"])) if d["kind"] == "Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": "replica", "operator": "In", "values": [6, 143]}}]


# ---- the pods' commands on hosts of their own ------------------------------------------------------------
class Job:
    """The rendered job's pods as processes in network namespaces (see the module docstring)."""

    def __init__(self, tmp: Path, corpus: Path, hosts: Hosts) -> None:
        self.tmp, self.hosts, self.corpus = tmp, hosts, corpus
        self.docs: list[dict[str, Any]] = []
        self.pods: list[subprocess.Popen[str]] = []
        self.coord: subprocess.Popen[str] | None = None
        self.bin = tmp / "image-bin"  # the image's entry points
        self.bin.mkdir()
        for name, module in (("recover", "recover"), ("torchrun", "torch.distributed.run")):
            (self.bin / name).write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
            (self.bin / name).chmod(0o755)
        self.run_dir = tmp / "runs" / "rk"
        self.service = "rk-coordinator"

    def render(self, device_s: str) -> None:
        """The job's manifests: 2 replicas of 1 process on CPUs, the test's flags as OVERRIDES."""
        import yaml

        overrides = " ".join(["--data.path", str(self.corpus), *FLAGS, "--training.device_time_s", device_s])
        self.docs = list(yaml.safe_load_all(render({**SHAPES["cpu"], "NAME": "rk", "OVERRIDES": overrides})))
        assert self.doc("Service", self.service)

    def doc(self, kind: str, name: str) -> dict[str, Any]:
        (d,) = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return d

    def container(self, pod: dict[str, Any], host: str) -> tuple[list[str], dict[str, str]]:
        """The pod's command with each volume a directory under the test's folder (a Secret's keys written
        as files, an emptyDir the pod's own), and its environment."""
        (c,) = pod["spec"]["containers"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        mounts = {}
        for m in c.get("volumeMounts", []):
            vol = volumes[m["name"]]
            local = self.tmp / "volumes" / (f"{host}-{m['name']}" if "emptyDir" in vol else m["name"])
            local.mkdir(parents=True, exist_ok=True)
            if "secret" in vol:
                for key, value in self.doc("Secret", vol["secret"]["secretName"])["stringData"].items():
                    (local / key).write_text(value)
            mounts[m["mountPath"]] = str(local) if m["mountPath"] != "/runs" else str(self.tmp / "runs")

        def local(arg: str) -> str:
            for path, there in mounts.items():
                arg = arg.replace(path + "/", there + "/").replace("=" + path, "=" + there)
            return arg

        env = {"PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(self.tmp),
               "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        env.update({e["name"]: e["value"] for e in c.get("env", [])})
        return [local(a) for a in c["command"]], env

    def start(self, host: str, hostname: str, pod: dict[str, Any], env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
        """Pod ``hostname`` on ``host``: its host name resolves to its address, the Service's to the
        coordinator's; its first process is the container's command (``ip netns exec``, ``unshare`` and
        the shell before it exec into it)."""
        self.hosts.hosts_file(self.hosts.ns[host], {self.service: self.hosts.addr["coord"],
                                                     hostname: self.hosts.addr[host]})
        cmd, pod_env = self.container(pod, host)
        argv = self.hosts.cmd(self.hosts.ns[host], ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                                                    hostname, *cmd])
        with open(self.tmp / f"{hostname}.log", "a") as log:
            proc = subprocess.Popen(argv, env={**pod_env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                    text=True, cwd=self.tmp, start_new_session=True)
        self.pods.append(proc)
        return proc

    def coordinator(self) -> subprocess.Popen[str]:
        """The Deployment's pod, started and ready (its `ready` line)."""
        log = self.tmp / "rk-coordinator.log"
        seen = log.read_text().count('"ready": true') if log.exists() else 0
        proc = self.start("coord", "rk-coordinator", self.doc("Deployment", "rk-coordinator")["spec"]["template"])
        self.until(lambda: log.read_text().count('"ready": true') > seen, 120, log, proc)
        self.coord = proc
        return proc

    def replica(self, index: int, host: str) -> subprocess.Popen[str]:
        """The Job's pod for ``index`` (JOB_COMPLETION_INDEX), host name rk-replicas-INDEX as the Job sets it."""
        return self.start(host, f"rk-replicas-{index}", self.doc("Job", "rk-replicas")["spec"]["template"],
                          {"JOB_COMPLETION_INDEX": str(index)})

    def until(self, ready: Any, timeout: float, log: Path, *alive: subprocess.Popen[str]) -> None:
        deadline = time.time() + timeout
        while not ready():
            assert all(p.poll() is None for p in alive), f"a pod ended early:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"timed out after {timeout} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)

    def last_step(self, replica: int) -> int:
        """The newest step ``replica`` recorded (-1: none yet)."""
        path = self.run_dir / "replicas" / f"replica_{replica}.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return json.loads(lines[-1])["step"] if lines else -1

    def wait(self, pod: subprocess.Popen[str], timeout: float) -> int:
        try:
            return pod.wait(timeout)
        except subprocess.TimeoutExpired:
            logs = "\n".join(p.read_text()[-1500:] for p in sorted(self.tmp.glob("*.log")))
            raise AssertionError(f"a pod still running after {timeout} s:\n{logs}") from None

    def kill_pod(self, host: str) -> None:
        """SIGKILL to every process of the pod on ``host`` (a node's death, an OOM kill of the pod)."""
        while pids := self.hosts.pids_in(host):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def end(self) -> None:
        """The end of the job: the Job's pods have ended; `kubectl delete` of the Deployment sends its pod
        SIGTERM (with no job running it exits 0 at once). Nothing is left in any namespace."""
        assert self.coord is not None
        self.coord.send_signal(signal.SIGTERM)
        assert self.wait(self.coord, 30) == 0
        left = {h: self.hosts.pids_in(h) for h in self.hosts.ns}
        assert not any(left.values()), f"processes left behind: {left}"

    def collect_and_compare(self, reference: Path) -> list[dict[str, Any]]:
        """`recover collect` in the coordinator's pod, then `recover compare --tol 0` with ``reference``;
        returns the step records."""
        env = self.container(self.doc("Deployment", "rk-coordinator")["spec"]["template"], "coord")[1]
        collect = subprocess.run(self.hosts.cmd(self.hosts.ns["coord"], ["recover", "collect", str(self.run_dir)]),
                                 env=env, capture_output=True, text=True, timeout=120)
        assert collect.returncode == 0, collect.stdout + collect.stderr
        compare = subprocess.run([sys.executable, "-m", "recover", "compare", str(reference), str(self.run_dir),
                                  "--tol", "0"], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert compare.returncode == 0, compare.stdout + compare.stderr
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS)) and {r["microbatches"] for r in rows} == {8}
        ref = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in rows] == [r["loss"] for r in ref]  # bitwise, step by step
        return rows

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]

    def close(self) -> None:
        """Whatever happened: every process in the namespaces SIGKILLed by PID, then the namespaces go."""
        for host in self.hosts.ns:
            self.kill_pod(host)
        for p in self.pods:
            p.wait(10)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A failure-free `recover launch` of the pods' config (deterministic: one replica computes what two
    do, bit for bit; no emulated device time, which changes no bit)."""
    out = tmp_path_factory.mktemp("k8s-ref") / "ref"
    done = subprocess.run([sys.executable, "-m", "recover", "launch", "--config", "debug", "--replicas", "1",
                           "--out", str(out), "--no-progress", "--data.path", str(corpus), *FLAGS],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture
def job(tmp_path: Path, corpus: Path) -> Iterator[Job]:
    if (why := usable()) is not None:
        pytest.skip(why)
    pytest.importorskip("yaml")
    hosts = Hosts("rk", ["coord", "r0", "r1", "r0b", "r1b"])
    job = Job(tmp_path, corpus, hosts)
    try:
        yield job
    finally:
        try:
            job.close()
        finally:
            hosts.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not re.search(r"^rk-", left, re.M), left


def started(job: Job, device_s: str = SHORT_S) -> tuple[subprocess.Popen[str], dict[int, subprocess.Popen[str]]]:
    """The job rendered; the coordinator's pod, ready, and both replica pods, training (step 0 recorded)."""
    job.render(device_s)
    coordinator = job.coordinator()
    pods = {i: job.replica(i, f"r{i}") for i in (0, 1)}
    job.until(lambda: job.last_step(0) >= 0, 180, job.tmp / "rk-replicas-0.log", coordinator, *pods.values())
    return coordinator, pods


def test_the_pods_train_across_hosts_bitwise_equal_to_launch(job: Job, reference: Path) -> None:
    """Failure-free: the replicas reach the coordinator by the Service's name at its own address, train
    every step with all microbatches, and both pods end with 0."""
    _, pods = started(job)
    assert [job.wait(p, 180) for p in pods.values()] == [0, 0]
    job.end()
    rows = job.collect_and_compare(reference)
    assert {r["live_replicas"] for r in rows} == {2}
    registered = [e for e in job.events() if e["kind"] == Event.COORDINATOR_START]
    assert registered and registered[0]["advertise_host"] == "rk-coordinator"


def test_a_killed_replica_pod_is_recovered_in_step_and_its_new_pod_joins(job: Job, reference: Path) -> None:
    """Every process of replica 1's pod SIGKILLed (a node's death, an OOM kill): replica 0 recovers
    in-step; the Job's new pod for index 1, on another host, joins; no step is lost."""
    _, pods = started(job, JOINING_S)
    t0 = time.time()
    job.kill_pod("r1")
    assert job.wait(pods[1], 30) == -signal.SIGKILL  # the kubelet reports 137
    new = job.replica(1, "r1b")
    assert job.wait(pods[0], 240) == 0 and job.wait(new, 240) == 0
    job.end()
    rows = job.collect_and_compare(reference)
    ev = job.events()
    assert [e for e in ev if e["kind"] == Event.FAILURE_DETECTED], "the kill was not detected"
    back = [e for e in ev if e["kind"] == Event.STARTED and e.get("replica") == 1 and e["joined"]]
    assert back and rows[-1]["live_replicas"] == 2, back
    print(f"replica 1's pod killed: its new pod trained again {back[0]['t'] - t0:.1f} s later (step "
          f"{back[0]['step']} of {STEPS}); load "
          f"{os.getloadavg()[0]:.1f}")


def test_a_deleted_replica_pod_leaves_ends_with_143_and_its_new_pod_joins(job: Job, reference: Path) -> None:
    """SIGTERM to replica 1's first process (kubectl delete pod, a drain, a preemption): the replica leaves
    at its next commit (no failure detected), the pod ends with 143 (the Job's podFailurePolicy ignores
    it), the new pod for index 1 joins; every step committed with all microbatches."""
    _, pods = started(job, JOINING_S)
    t0 = time.time()
    pods[1].send_signal(signal.SIGTERM)
    assert job.wait(pods[1], 90) == 143
    new = job.replica(1, "r1b")
    assert job.wait(pods[0], 240) == 0 and job.wait(new, 240) == 0
    job.end()
    rows = job.collect_and_compare(reference)
    ev = job.events()
    (leave,) = [e for e in ev if e["kind"] == Event.LEAVE]
    back = [e for e in ev if e["kind"] == Event.STARTED and e.get("replica") == 1 and e["joined"]
            and e["t"] > leave["t"]]
    assert leave["replicas"] == [1] and back
    assert not [e for e in ev if e["kind"] == Event.FAILURE_DETECTED]
    assert rows[leave["step"] + 1]["live_replicas"] == 1 and rows[-1]["live_replicas"] == 2
    print(f"replica 1's pod deleted: the leave committed {(leave['t'] - t0) * 1e3:.0f} ms later (step "
          f"{leave['step']}), its new pod trained again {back[0]['t'] - t0:.1f} s later (step {back[0]['step']}); load "
          f"{os.getloadavg()[0]:.1f}")


def test_the_coordinator_pods_loss_loses_no_step(job: Job, reference: Path) -> None:
    """Every process of the coordinator's pod SIGKILLed, a new pod started with the same command at the
    Service's address: the replicas reconnect to it with what they hold and train on; no step is lost or
    redone, both replica pods end with 0."""
    _, pods = started(job)
    job.kill_pod("coord")
    t0 = time.time()
    job.coordinator()
    ready = time.time() - t0
    assert [job.wait(p, 240) for p in pods.values()] == [0, 0]
    job.end()
    job.collect_and_compare(reference)
    ev = job.events()
    assert len([e for e in ev if e["kind"] == Event.COORDINATOR_START]) == 2
    back = [e for e in ev if e["kind"] == Event.COORDINATOR_RECONNECTED]
    assert back, [e["kind"] for e in ev][-20:]
    print(f"the coordinator's pod killed: a new one ready {ready:.1f} s later, the replicas back after "
          f"{max(e['outage_ms'] for e in back) / 1e3:.1f} s; load {os.getloadavg()[0]:.1f}")


def test_a_deleted_coordinator_pod_stops_the_job_at_a_checkpoint_and_the_new_pods_resume(
        job: Job, reference: Path) -> None:
    """SIGTERM to the coordinator's pod (its deletion, eviction, a drained node): the next commit is a stop,
    replica 0 saves a complete checkpoint, both replica pods end with 6 (stopped: the Job's podFailurePolicy
    replaces them without counting a failure; torchrun itself ends with 1), the coordinator with 0. The
    Deployment's new pod and the Job's new pods (other hosts) continue from the checkpoint (--resume): every
    step once, bitwise."""
    coordinator, pods = started(job)
    job.until(lambda: job.last_step(0) >= 2, 120, job.tmp / "rk-replicas-0.log", coordinator, *pods.values())
    coordinator.send_signal(signal.SIGTERM)
    assert [job.wait(p, 120) for p in pods.values()] == [6, 6]
    assert job.wait(coordinator, 60) == 0
    saved = sorted((job.run_dir / "checkpoints").glob("step_*/COMMITTED"))
    assert saved and job.last_step(0) < STEPS - 1, saved
    job.coordinator()
    new = [job.replica(i, f"r{i}b") for i in (0, 1)]
    assert [job.wait(p, 240) for p in new] == [0, 0]
    job.end()
    rows = job.collect_and_compare(reference)
    assert {r["live_replicas"] for r in rows} == {2}
    resumed = [e for e in job.events() if e["kind"] == Event.STARTED and e["step"] > 0]
    assert sorted(e["replica"] for e in resumed) == [0, 1] and not any(e["joined"] for e in resumed), resumed
    assert {e["step"] for e in resumed} == {int(saved[-1].parent.name.split("_")[1])}  # from the checkpoint
