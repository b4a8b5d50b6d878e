"""What a launch runs: its options, and the command line and environment of every process it starts.

Contract (pure: nothing here starts a process or touches a file):
- :class:`LaunchOptions` is a launch after every check (:func:`recover.launch.cli.check_launch`).
- A worker reads the job's config from the run directory's ``config.json``, which the launcher writes
  before it starts anything (:func:`recover.config.write_run_config`); its command line carries only
  what differs between processes: the coordinator's address, its replica, its failures, join/resume.
- A replica of P = pp x fsdp x tp ranks is P processes given torchrun's environment (RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a port of its own) and the device of each rank
  (:mod:`recover.launch.placement`; a warm spare's are those the pool gives it, :mod:`recover.launch.spares`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recover.config import RUN_CONFIG, Config
from recover.coord.tls import Tls
from recover.faults import FailureSchedule
from recover.launch.placement import Placement
from recover.names import WORKER_ENV, Baseline


@dataclass
class LaunchOptions:
    config: Config
    out: Path
    failures: FailureSchedule = field(default_factory=FailureSchedule)
    random_mtbf_s: float | None = None
    random_faults: tuple[str, ...] = ("kill",)
    """What each random failure does (drawn uniformly): SIGKILL, a hung training thread (SIGUSR1 to
    the worker) or SIGSTOP."""
    rejoin_after_s: float | None = None
    baseline: Baseline | None = None
    """None (recover) or the baseline run instead (see :class:`recover.names.Baseline`)."""
    rejoin_replicas: frozenset[int] | None = None
    """Which killed replicas rejoin (None: all)."""
    seed: int = 0
    host: str = "127.0.0.1"
    progress: bool = True
    title: str = "launch"
    resume: bool = False
    """Start from the newest complete checkpoint in ``out`` (keeping the step records before it)."""
    placement: Placement = field(default_factory=Placement)
    """The device of every rank (:mod:`recover.launch.placement`)."""
    script: tuple[str, ...] = ()
    """Each replica runs this command (a user's script on :mod:`recover.api`) instead of ``recover worker``;
    it learns its job from :data:`recover.api.WORKER_ENV`. No warm spare is kept for a script."""
    warm_spares: int = 0
    """Spare workers kept started for rejoins (:mod:`recover.launch.spares`; resolved by
    :func:`recover.launch.cli.check_launch`)."""
    max_replicas: int | None = None
    """Replica ids the coordinator admits: ``0..max_replicas - 1`` (None: ``parallel.replicas``)."""
    tls: Tls | None = None
    """The coordinator wire over TLS: every process started gets ``--tls-*`` (None: plain TCP)."""
    metrics_port: int = 0
    """The coordinator's Prometheus endpoint, ``--metrics-port`` (0: none)."""
    fork_workers: bool = True
    """``recover worker`` processes are forked from the job's fork server (:mod:`recover.launch.forkserver`);
    False (``--no-fork-server``): each starts as a new interpreter."""
    kill_coordinator: str | None = None
    """Fault injection ``STEP[:SENT]``: the first coordinator SIGKILLs itself in step STEP's commit after
    SENT of its replies went out (the launcher then restarts it)."""


@dataclass(frozen=True)
class Address:
    """Where the job's coordinator listens and the file holding its token."""

    host: str
    port: int | str
    store_port: int | str
    token_file: Path


def python(*args: str) -> list[str]:
    """``recover ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "recover", *args]


@dataclass(frozen=True)
class Commands:
    """The command lines and environments of a launch's processes."""

    o: LaunchOptions
    struck: set[str] = field(default_factory=set)
    """Labels of the failure specs that struck in this launch (their events carry ``spec``)."""

    @property
    def ranks(self) -> int:
        return self.o.config.parallel.procs_per_replica

    def coordinator(self, addr: Address, expected: int, first: bool) -> list[str]:
        """The coordinator of ``expected`` replicas; the ``first`` one gets ``--kill-coordinator``'s fault."""
        cmd = python("coordinator", "--host", addr.host, "--port", str(addr.port), "--store-port",
                     str(addr.store_port), "--token-file", str(addr.token_file), "--events",
                     str(self.o.out / "events.jsonl"), "--config", str(self.o.out / RUN_CONFIG),  # as the workers
                     "--replicas", str(expected),
                     "--max-replicas", str(self.o.max_replicas or self.o.config.parallel.replicas), *self.tls_flags)
        if self.o.metrics_port:
            cmd += ["--metrics-port", str(self.o.metrics_port)]
        if self.o.config.observe.tensorboard:
            cmd += ["--tensorboard", str(self.o.out / "tensorboard" / "job")]
        if self.o.kill_coordinator and first:
            cmd += ["--die-at-commit", self.o.kill_coordinator]
        return cmd

    def worker(self, addr: Address, resume: bool) -> list[str]:
        """``recover worker`` of this job, before it is told its replica."""
        cmd = python("worker", "--config", str(self.o.out / RUN_CONFIG), "--out", str(self.o.out), "--coordinator",
                     f"{addr.host}:{addr.port}", "--token-file", str(addr.token_file), "--procs",
                     str(self.o.config.parallel.replicas * self.ranks), *self.tls_flags)
        if self.o.baseline:
            cmd += ["--baseline", Baseline(self.o.baseline).value]
        if resume:
            cmd.append("--resume")
        return cmd

    def replica(self, addr: Address, resume: bool, rid: int, join: bool) -> list[str]:
        """``recover worker`` as replica ``rid``, with its failures."""
        cmd = [*self.worker(addr, resume), "--replica", str(rid), *(a for f in self.fails(rid) for a in ("--fail", f))]
        return [*cmd, "--join"] if join else cmd

    def spare_order(self, rid: int) -> bytes:
        """The line a warm spare reads on its stdin to become replica ``rid``."""
        return (json.dumps({"replica": rid, "fail": self.fails(rid)}) + "\n").encode()

    def script_env(self, addr: Address, resume: bool, rid: int, join: bool) -> dict[str, str]:
        """What a user's script learns its job from (:data:`recover.names.WORKER_ENV`)."""
        job = {"coordinator": f"{addr.host}:{addr.port}", "token_file": str(addr.token_file), "out": str(self.o.out),
               "replica": rid, "fail": self.fails(rid), "join": join,
               "resume": resume,  # Job(resume=) defaults to this run's checkpoints
               **({"tls": asdict(self.o.tls)} if self.o.tls else {})}
        return {WORKER_ENV: json.dumps(job)}

    @property
    def tls_flags(self) -> list[str]:
        return self.o.tls.flags() if self.o.tls is not None else []

    def fails(self, rid: int) -> list[str]:
        """Failure specs of replica ``rid`` as the worker reads them, ``R@STEP:PHASE[#RANK]``, but those that
        struck already (:attr:`struck`): a replica that restores an older checkpoint goes through their step
        again, and an injected fault strikes once per launch."""
        return [spec.label for spec in self.o.failures.for_replica(rid) if spec.label not in self.struck]

    def env(self, gpu: str | None, k: int, port: int | str) -> dict[str, str]:
        """What rank ``k`` of a replica or spare gets on top of this environment: torchrun's variables
        (P > 1) and its device, ``gpu`` (None: the CPU; :mod:`recover.launch.placement`)."""
        env = self.o.placement.env_on(gpu)
        if self.ranks > 1:
            env.update({"RANK": str(k), "LOCAL_RANK": str(k), "WORLD_SIZE": str(self.ranks),
                        "LOCAL_WORLD_SIZE": str(self.ranks), "MASTER_ADDR": self.o.host, "MASTER_PORT": str(port)})
        return env

    def plan(self) -> list[str]:
        """``--dry-run``: one line per process it would start (replica, rank, device, environment,
        command), and the parallel layout of the config it would write."""
        addr = Address(self.o.host, "<port>", "<port>", self.o.out / "token")
        layout = " ".join(f"parallel.{k}={v}" for k, v in asdict(self.o.config.parallel).items())
        lines = [f"coordinator: {' '.join(python('coordinator', '--port', '<port>', '...'))}",
                 f"config: {self.o.out / RUN_CONFIG} (written at the start; every worker reads it): {layout}"]
        for rid in range(self.o.config.parallel.replicas):
            cmd = " ".join(self.replica(addr, self.o.resume, rid, join=False))
            for k in range(self.ranks):
                env = " ".join(f"{key}={v}" for key, v in sorted(self.env(self.o.placement.gpus.get((rid, k)), k,
                                                                          "<port>").items()))
                lines.append(f"replica {rid} rank {k}: {self.o.placement.device(rid, k)}; env {env or '-'}; {cmd}")
        if self.o.rejoin_after_s is not None:
            spares = self.o.placement.spare_devices(self.ranks, self.o.warm_spares)
            where = " on GPUs " + " ".join(",".join(map(str, d)) for d in spares) if self.o.placement.gpus else ""
            lines.append("rejoins: a replica restarts on the devices of the one it replaces, or takes a warm "
                         f"spare's; {len(spares)} warm spare(s) wait" + (where if spares else ""))
        return lines
