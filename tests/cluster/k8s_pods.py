"""The Kubernetes recipe's pods as processes on this machine (tests/cluster/test_k8s.py's).

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

``Job(tmp, corpus, hosts)`` on hosts ``coord`` (the coordinator's pods, at the Service's address) and one per
replica pod; ``render(device_s)`` renders the job (2 replicas of 1 process, CPU); ``coordinator()`` and
``replica(index, host)`` start pods; ``kill_pod(host)``, ``end()``, ``collect_and_compare(reference)`` and
``close()`` (every process in the namespaces SIGKILLed by PID, whatever happened).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netns import Hosts

from recover.bench.common import signal_all

ROOT = Path(__file__).resolve().parents[2]
RENDER = ROOT / "examples" / "k8s" / "render.py"
STEPS = 30
FLAGS = ["--training.steps", str(STEPS), "--training.eval_every", "10", "--training.deterministic", "true",
         "--training.threads", "1"]
CPU_JOB = {"REPLICAS": "2", "GPUS_PER_REPLICA": "0", "CONFIG": "debug"}


def render(sets: dict[str, str]) -> str:
    """The manifests render.py writes with ``--set KEY=VALUE`` for each of ``sets``."""
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
        self.docs = list(yaml.safe_load_all(render({**CPU_JOB, "NAME": "rk", "OVERRIDES": overrides})))
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
            signal_all(pids, signal.SIGKILL)
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
