"""A real Slurm cluster on this machine, for the cluster tier: Debian's ``slurm-wlm`` and ``munge``.

``SlurmCluster(workdir, nodes)`` writes a ``slurm.conf`` under ``workdir``, starts ``munged`` on a socket
of its own, ``slurmctld`` in the hub namespace of a :class:`netns.Hosts` and one ``slurmd -N nK`` in
each node's namespace (so node nK really is another host: its own address, reached over the bridge),
and waits until every node is idle. The node names resolve nowhere (as on a cluster whose node names
are not in DNS): what needs an address must take it from ``scontrol show node``'s NodeAddr.

What mattered on one host: ``SlurmdParameters=config_overrides`` (every node declares the CPUs it
lacks), ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups), no
accounting, ``OverSubscribe=FORCE``, per-node spool directories made first, and a short
``SlurmdTimeout`` so that a dead node is declared DOWN within the test's time.

``install()`` puts the packages on a machine without them (root and apt-get; about 2 minutes).
``stop()`` ends every daemon it started by PID (SIGTERM, then SIGKILL), and every process still in a
node's namespace (a job's steps), then removes the namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from netns import Hosts, usable

PACKAGES = ["slurm-wlm", "munge"]
NEEDED = ["slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue", "scancel"]
CPUS = 4  # each node's declared CPUs: room for 2 one-rank replicas, or one of two ranks, per node
SLURMD_TIMEOUT_S = 12


def missing() -> list[str]:
    return [name for name in NEEDED if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]


def install() -> str | None:
    """Installs Slurm and munge with apt-get when they are absent; None, or why the tier cannot run."""
    why = usable()
    if why:
        return why
    if not missing():
        return None
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing())} missing) and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if got.returncode:
            return f"`{' '.join(cmd)}` failed: {got.stderr.strip()[-300:]}"
    return None if not missing() else f"still missing after apt-get: {', '.join(missing())}"


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


CONF = """\
ClusterName=recover-tier
SlurmctldHost={host}({hub})
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldParameters=enable_configless
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=20
MinJobAge=600
SchedulerParameters=defer_batch
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class SlurmCluster:
    """Daemons of a Slurm cluster of ``nodes`` nodes; see the module docstring."""

    def __init__(self, workdir: Path, nodes: int = 4, prefix: str = "rs") -> None:
        self.dir = workdir
        self.conf = workdir / "slurm.conf"
        self.names = [f"n{i}" for i in range(nodes)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hosts = Hosts(prefix, self.names)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # ---- set-up -------------------------------------------------------------------------------------
    def _start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for name in self.names:
            (self.dir / "spool" / name).mkdir(exist_ok=True)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge = self.dir / "munge.sock"
        self._daemon("munged", [_sbin("munged"), "-F", "-f", f"--socket={self.munge}", f"--key-file={key}",
                                f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/log/munged.log",
                                f"--seed-file={self.dir}/munged.seed"], ns=None)
        self._wait(lambda: self.munge.exists(), 20, "munged's socket")
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts.addr[n]} CPUs={CPUS} RealMemory=4000 State=UNKNOWN"
                          for n in self.names)
        host = socket.gethostname().split(".")[0]  # slurmctld runs on this machine, under its name
        self.conf.write_text(CONF.format(host=host, hub=self.hosts.hub_addr, munge=self.munge, dir=self.dir,
                                         nodes=nodes, slurmd_timeout=SLURMD_TIMEOUT_S))
        self._daemon("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], ns=self.hosts.hub)
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, 60, "slurmctld")
        for name in self.names:
            self.start_node(name)
        self.wait_nodes("idle", 90)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _daemon(self, key: str, argv: list[str], ns: str | None) -> None:
        cmd = self.hosts.enter(ns, argv) if ns else argv
        log = open(self.dir / "log" / f"{key}.out", "ab")  # noqa: SIM115 (the daemon keeps it)
        self.procs[key] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                           start_new_session=True)

    def start_node(self, name: str) -> None:
        """(Re)starts node ``name``'s slurmd in its namespace."""
        self._daemon(f"slurmd-{name}", [_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)],
                     ns=self.hosts.ns[name])

    @staticmethod
    def _wait(ok: object, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not ok():  # type: ignore[operator]
            if time.time() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
            time.sleep(0.25)

    # ---- commands -----------------------------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, ns: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm command run on the hub (the login node), or in namespace ``ns``."""
        got = subprocess.run(self.hosts.enter(ns or self.hosts.hub, argv), capture_output=True, text=True,
                             env=self.env(), timeout=timeout)
        if check and got.returncode:
            raise RuntimeError(f"{' '.join(argv)}: exit {got.returncode}: {got.stderr.strip()}")
        return got

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str, timeout: float, names: list[str] | None = None) -> None:
        names = names or self.names
        self._wait(lambda: all(self.node_states().get(n, "").rstrip("*~#").startswith(state) for n in names),
                   timeout, f"nodes {names} {state} (now {self.node_states()})")

    def job(self, jobid: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ...); {} once the job is gone."""
        got = self.run(["scontrol", "show", "job", "-o", jobid], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", got.stdout)) if got.returncode == 0 else {}

    def kill_node(self, name: str) -> list[int]:
        """The node dies: its slurmd and every process in its namespace SIGKILLed; their PIDs."""
        pids = self.hosts.pids_in(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    # ---- tear-down ----------------------------------------------------------------------------------
    def stop(self) -> None:
        for name in getattr(self.hosts, "ns", {}):
            self.kill_node(name)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.hosts.close()
