"""The Kubernetes recipe (examples/k8s/) as far as this machine can take it without an API server (none is
packaged in the registries these machines reach): every rendered manifest checked against the Kubernetes API
schema offline (`kubernetes-validate`, strict: an unknown field is an error), and the rendered pods' commands
run as the pods would run them, each pod on a host of its own (how a pod runs here: k8s_pods.py).

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
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_pods import CPU_JOB, FLAGS, RENDER, ROOT, STEPS, Job, load_render, render
from netns import Hosts, usable

from recover.names import Event

OLDEST, NEWEST = (1, 29), (1, 37)  # podReplacementPolicy is on by default from 1.29 (beta)
# emulated device time per microbatch (it changes no bit). Where a new replica pod must join: 0.8 s a step
# with both replicas, 1.6 s with one: the ~45 s after a fault at step 0 leave it time to start (torchrun
# and its worker: 8 to 27 s on 2 cores at load 6-10) and join; elsewhere steps as short as a pod's tests allow
JOINING_S, SHORT_S = "0.2", "0.05"
SHAPES = {  # representative renderings: what --set combinations users write
    "cpu": CPU_JOB,
    "gpus": {"REPLICAS": "4", "IMAGE": "registry.example/recover:1", "CONFIG": "125m",
             "OVERRIDES": "--data.path /runs/data/mine --training.steps 5000"},
    "multi-rank": {"NAME": "llm-a", "REPLICAS": "3", "PROCS_PER_REPLICA": "4", "GPUS_PER_REPLICA": "4",
                   "MIN_REPLICAS": "2", "STORAGE": "2Ti", "STORAGE_CLASS": "cephfs", "GRACE_S": "300",
                   "OVERRIDES": "--parallel.tp 2 --parallel.fsdp 2 --data.path /runs/data/mine"},
}


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
    if (why := usable() or (None if shutil.which("unshare") else "`unshare` (util-linux) is not installed")):
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
    summary = json.loads((job.run_dir / "summary.json").read_text())  # what no launcher saw, counted
    assert summary["failures_detected"] == {"connection_closed": 1}
    assert [x["replica"] for x in summary["recoveries"]] == [1]
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
    assert json.loads((job.run_dir / "summary.json").read_text())["coordinator_restarts"] == 1
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
