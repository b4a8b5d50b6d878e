"""One replica of a fault-tolerant job (``recover worker``, started by ``recover launch``).

It composes the layers and runs the loop shared with ``recover train``:

    replica = Replica.from_config(...)                # model, optimizer, data (before joining: slow)
    membership = client.register()                    # the coordinator
    group = FaultTolerantGroup.create(...)            # layer 1: this generation's collectives
    step = ResilientStep(replica, group, client, M)   # layers 2+3 (or a baseline's variant)
    Loop(...).run(steps)                              # step.run(): plan, compute, reduce, recover,
                                                      # commit, apply, admit; records; eval; checkpoints

Contract: every committed step this replica applies holds exactly M microbatches; a joiner starts
from state bitwise equal to the live replicas' at a step boundary (a worker joins when started with
``--join``, or when the coordinator admits it after the job began: a restarted pod or srun step; one
that registers after every replica finished exits with status 0, nothing to join); if
fewer than ``fault_tolerance.min_replicas`` survive, the lowest live replica saves a complete
checkpoint and every survivor exits with status 3 and a message saying so.

Stops and coordinator loss (exit statuses in ``train/exits.py``):
- SIGTERM or SIGINT (:meth:`ReplicaWorker.request_stop`): the next vote asks for a stop; the commit
  that carries it ends the job for every member after that step, the lowest live replica saving a
  complete checkpoint: status 6. A process not yet training exits at once with status 6.
- Silent data corruption and non-finite values: a replica the coordinator fences as ``divergent`` or
  faulty exits like any fenced one; when it ends the job (no majority among the parameter
  fingerprints, or a microbatch not finite on two replicas) the state is saved (each side's under
  ``checkpoints/diverged/``, or the last committed one) and every replica exits with status 8 or 9.
- The coordinator lost: the client reconnects for ``fault_tolerance.coordinator_reconnect_s`` while
  the training thread keeps its state (see :mod:`recover.coord.client`); if it does not come back,
  the lowest member saves a complete checkpoint and every replica exits with status 7.

A replica of several ranks (``parallel.pp x fsdp x tp > 1``) is one torchrun-style job: every rank
runs this same loop with the same control flow. Rank k holds its own coordinator client (through
the replica's relay in rank 0, one connection per replica, unless ``fault_tolerance.connections``
is ``rank``) and its own fault-tolerant group, *lane* k (rank k of every live replica), on which it
sums its shard of the gradient; the coordinator treats the replica's ranks as one member (registered,
acked and voted only when all ranks have), so a step commits only if every rank of every live
replica voted for it, and the death of any rank fences the whole replica: its other ranks leave
with :data:`EXIT_FENCED` (or fail fast on the bounded intra-replica groups) and the launcher
reaps them. Only rank 0 writes the replica's step records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from recover.baselines import JobFailed, ShrinkStep, step_class
from recover.config import Config
from recover.coord.client import CoordinatorLost, Diverged
from recover.data.sampler import EvalSampler
from recover.errors import QuorumLost, RecoverError
from recover.faults import FailureSpec, FaultInjector
from recover.names import Baseline, Fault, Phase
from recover.observe.events import EventLog, JsonlWriter
from recover.recovery.protocol import Progress, ResilientStep
from recover.train.checkpoint import Checkpointer
from recover.train.dist import DistContext, init_from_env
from recover.train.exits import (
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_FENCED,
    EXIT_JOB_FAILED,
    EXIT_NONFINITE,
    EXIT_QUORUM_LOST,
    EXIT_STOPPED,
    replica_log_path,
)
from recover.train.loop import Loop, use_deterministic_kernels
from recover.train.replica import Replica
from recover.train.trainer import build_replica

Built = tuple[Replica, EvalSampler, DistContext]


def build(cfg: Config, procs: int) -> Built:
    """The replica's model, optimizer and data (the slow part of starting: done before joining).

    The launcher prepared the data. A replica of several ranks reads its torchrun environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and forms its own process group with the
    intra-replica timeout first.
    """
    from recover.comm.nccl import apply_env_defaults
    from recover.data.prepare import resolve_data_dir

    apply_env_defaults(collective_timeout_s=cfg.fault_tolerance.collective_timeout_s)  # before any NCCL use
    if cfg.training.deterministic:  # before CUDA initialises
        use_deterministic_kernels()
    ctx = DistContext(local_world_size=procs, device=own_device(cfg))
    if cfg.parallel.procs_per_replica > 1:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RecoverError(f"a replica of {cfg.parallel.procs_per_replica} ranks (parallel.pp x fsdp x tp) "
                               "runs as a torchrun job: start `recover worker` with torchrun --nproc-per-node "
                               f"{cfg.parallel.procs_per_replica}, or let `recover launch` start it")
        ctx = init_from_env(cfg.parallel.backend, cfg.fault_tolerance.intra_replica_timeout_s)
        ctx.local_world_size = procs
    replica, eval_data = build_replica(cfg, ctx, resolve_data_dir(cfg.data, prepare=False))
    return replica, eval_data, ctx


def own_device(cfg: Config) -> Any:
    """A one-process replica's device: the GPU the launcher gave it (``cuda:0`` in its own view), else the CPU
    (:func:`~recover.launch.placement.worker_device`; checked for every rank). Raises ConfigError."""
    import torch

    from recover.launch.placement import PLACEMENT_ENV, worker_device

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = cfg.parallel.replicas * cfg.parallel.procs_per_replica
    device = torch.device(worker_device(gpus, os.environ.get(PLACEMENT_ENV), processes))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's barrier-like calls use the current device
    return device


class ReplicaWorker:
    """Trains ``cfg`` as replica ``replica`` of a job whose coordinator listens at ``host:port``."""

    def __init__(self, cfg: Config, out: str | os.PathLike[str], replica: int, host: str, port: int, token: str,
                 failures: list[FailureSpec] = (), join: bool = False, procs: int = 1,
                 built: Built | None = None, baseline: Baseline | str | None = None, resume: bool = False) -> None:
        self.cfg, self.out, self.replica_id = cfg, Path(out), replica
        self.host, self.port, self.token, self.join = host, port, token, join
        self.baseline = Baseline(baseline) if baseline else None
        self.replica, self.eval_data, ctx = built or build(cfg, procs)
        self.rank, self.ranks = (ctx.rank, ctx.world_size) if cfg.parallel.procs_per_replica > 1 else (0, 1)
        self.checkpointer = Checkpointer(self.out / "checkpoints", self.replica, cfg, self.replica.data.epoch_of)
        self.start = Progress.of(self.checkpointer.resume()[1]) if resume else Progress()
        self.events = EventLog(self.out / "events.jsonl")
        self.log = JsonlWriter(replica_log_path(self.out, replica)) if self.rank == 0 else None
        self.cut: set[int] = set()  # replicas this one cannot reach (--cut fault injection)
        self.client: Any = None  # the coordinator client, once training starts
        self.relay: Any = None  # rank 0's relay of the replica's coordinator connection, if any
        self.injector = FaultInjector(failures, replica, self.rank, self.ranks, before_kill=self._before_kill,
                                      slow=self._slow_down, cut=self.cut.add, corrupt=self._corrupt,
                                      nan=lambda step, mb: self.replica.poison.add((step, mb)))

    def _before_kill(self, spec: FailureSpec) -> None:
        if spec.fault is Fault.CUT:
            self._event("link_cut", step=spec.step, peer=int(spec.factor))
            return
        if spec.fault in (Fault.CORRUPT, Fault.MISCOMPUTE, Fault.NAN):  # nothing dies: the coordinator must find it
            self._event("injected", fault=spec.fault, step=spec.step,
                        **({"microbatch": int(spec.factor)} if spec.fault is Fault.NAN else {}))
            return
        if not spec.kills:
            self._event("slowed", step=spec.step, factor=spec.factor)
            return
        self.events.event("kill", replica=self.replica_id, rank=self.rank, step=spec.step, phase=spec.phase,
                          fault=spec.fault, pid=os.getpid())

    def _corrupt(self, arithmetic: bool) -> None:
        """``--corrupt``: one parameter bit flips; ``--miscompute``: every gradient from now on is off."""
        if arithmetic:
            self.replica.miscompute = True
        else:
            self.replica.corrupt()

    def _slow_down(self, factor: float) -> None:
        self.replica.slowdown = factor

    def _event(self, kind: str, **fields: Any) -> None:
        if self.ranks > 1:
            fields["rank"] = self.rank
        self.events.event(kind, replica=self.replica_id, **fields)

    def _write(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write({**record, "replica": self.replica_id})

    def _step(self) -> tuple[Any, ResilientStep]:
        """Registers with the coordinator and builds this generation's group and the step protocol."""
        from recover.comm import FaultTolerantGroup
        from recover.coord.client import CoordinatorClient

        ft, tc = self.cfg.fault_tolerance, self.cfg.training
        host, port = self._coordinator_address()
        client = CoordinatorClient(host, port, self.token, self.replica_id,
                                   heartbeat_interval_s=ft.heartbeat_interval_s, rank=self.rank, ranks=self.ranks,
                                   fence_exit_s=ft.fence_exit_s, on_fenced=self._exit_fenced,
                                   reconnect_s=ft.coordinator_reconnect_s,
                                   on_reconnected=lambda s: self._event("coordinator_reconnected",
                                                                        outage_ms=round(s * 1000, 1)))
        client.committed_step = self.start.step - 1
        self.client = client

        def hook(step: int, phase: str) -> None:  # every phase point: progress, then fault injection
            client.advance()
            self.injector.maybe_fail(step, phase)

        client.cut = self.cut
        membership = client.register(join=self.join)
        group = FaultTolerantGroup.create(client, membership, backend=self.cfg.parallel.backend,
                                          timeout_s=ft.collective_timeout_s, bucket_bytes=int(ft.bucket_mb * 2**20))
        extra = {"initial_replicas": self.cfg.parallel.replicas} if step_class(self.baseline) is ShrinkStep else {}
        step = step_class(self.baseline)(
            self.replica, group, client, tc.global_microbatches, self.start, ft.min_replicas,
            hook=hook, on_event=self._event, assignment=tc.assignment, seed=tc.seed,
            policy=self.cfg.workload.policy, fingerprint_every=ft.fingerprint_every, audit_every=ft.audit_every,
            overlap=ft.overlaps(self.replica.device.type),
            **extra)
        # admitted as a joiner: --join, or started after the job began (a restarted pod or srun step)
        self.join = self.join or self.replica_id in membership.joined
        if self.join:
            step.join()
        self._event("started", generation=step.group.generation, members=list(step.group.members),
                    step=step.progress.step, joined=self.join)
        return client, step

    def request_stop(self, signum: int) -> None:
        """SIGTERM or SIGINT: stop after the next commit (see the module docstring). Signal handler."""
        if self.client is None or self.client.membership is None:
            print(f"recover: replica {self.replica_id} rank {self.rank}: stopped by signal {signum} before "
                  "training", file=sys.stderr, flush=True)
            os._exit(EXIT_STOPPED)
        if not self.client.stop_requested:
            self.client.stop_requested = True
            self._event("stop_signal", signal=signum)

    def _coordinator_address(self) -> tuple[str, int]:
        """Where this rank's client connects: the coordinator, or its replica's relay (one connection per
        replica, ``fault_tolerance.connections = "replica"``): rank 0 starts it and publishes its address
        in the replica's own store, the other ranks read it there."""
        if self.ranks == 1 or self.cfg.fault_tolerance.connections != "replica":
            return self.host, self.port
        from torch.distributed.distributed_c10d import _get_default_store

        from recover.coord.relay import Relay

        store, key = _get_default_store(), f"recover/relay/{self.replica_id}"
        if self.rank == 0:
            try:
                ft = self.cfg.fault_tolerance
                self.relay = Relay(self.host, self.port, self.token, self.replica_id, self.ranks,
                                   ft.heartbeat_interval_s, reconnect_s=ft.coordinator_reconnect_s).start()
            except OSError as exc:
                raise CoordinatorLost(f"replica {self.replica_id}: its relay cannot reach the coordinator at "
                                      f"{self.host}:{self.port}: {exc}") from None
            store.set(key, "{}:{}".format(*self.relay.address))
        host, _, port = store.get(key).decode().rpartition(":")
        return host, int(port)

    def run(self) -> int:
        """Trains to ``training.steps``; returns the process's exit status (see ``train/exits.py``)."""
        try:
            client, step = self._step()
        except CoordinatorLost as exc:
            if self.client is None or not self.client.stopping:
                raise
            print(f"recover: replica {self.replica_id}: {exc}", file=sys.stderr, flush=True)
            return 0 if self.client.finished else EXIT_STOPPED
        loop = Loop(self.cfg, step, self.replica, self.eval_data, self.checkpointer, self._write,
                    after_step=lambda s: step.hook(s, Phase.IDLE), busy=client.activity,
                    on_event=self._event if self.rank == 0 else lambda kind, **fields: None)
        try:
            loop.run(self.cfg.training.steps)
        except QuorumLost as exc:
            return self._save_and_stop(loop, "quorum_lost", exc, "resume with more replicas", EXIT_QUORUM_LOST)
        except JobFailed:
            return EXIT_JOB_FAILED
        except Diverged as exc:
            return self._on_divergence(loop, exc)
        except CoordinatorLost as exc:
            if client.diverged is not None:  # the coordinator ended the job while this replica waited
                return self._on_divergence(loop, client.diverged)
            if client.gone:  # it did not come back
                return self._save_and_stop(loop, "coordinator_lost", exc, "continue with --resume",
                                           EXIT_COORDINATOR_LOST)
            print(f"recover: replica {self.replica_id} rank {self.rank}: {exc}; stopping (the launcher restarts "
                  "the replica if --rejoin-after is set)", file=sys.stderr, flush=True)
            return EXIT_FENCED
        finally:
            if self.log is not None:
                self.log.close()
        self.checkpointer.wait()
        if loop.stopped:
            self._event("stopped", step=step.progress.step, generation=step.group.generation)
            if self.rank == 0 and step.me == min(step.group.members):
                print(f"recover: stopped on request after {step.progress.step} committed steps; a complete checkpoint "
                      f"is in {self.checkpointer.root}; continue with --resume", file=sys.stderr, flush=True)
        else:
            self._event("finished", step=step.progress.step, generation=step.group.generation)
        step.group.close()
        client.close()
        if self.relay is not None:
            self.relay.stop()
        return EXIT_STOPPED if loop.stopped else 0

    def _exit_fenced(self, why: str) -> None:
        """The watchdog's end of a fenced process whose training thread did not stop by itself (it may
        be stuck in a kernel, a collective inside the replica, or a hang): one line, no traceback."""
        print(f"recover: replica {self.replica_id} rank {self.rank}: fenced by the coordinator ({why}); "
              "exiting (the launcher restarts the replica if --rejoin-after is set)", file=sys.stderr, flush=True)
        self._event("fenced_exit", reason=why)
        sys.stdout.flush()
        os._exit(EXIT_FENCED)

    def _on_divergence(self, loop: Loop, exc: Diverged) -> int:
        """The coordinator ended the job. ``nonfinite``: the lowest live replica saves the last committed
        state. ``diverged``: the lowest replica of each side saves that side's state under
        ``checkpoints/diverged/replicas_A-B/`` (never over a checkpoint of the run)."""
        print(f"recover: replica {self.replica_id} rank {self.rank}: {exc}", file=sys.stderr, flush=True)
        step, members = loop.step, self.client.membership.members
        if exc.code == "nonfinite":
            if step.me == min(members):
                path = loop.save(blocking=True)
                self._event("nonfinite_stop", step=step.progress.step, checkpoint=str(path), message=str(exc))
            return EXIT_NONFINITE
        side = next((sorted(rs) for rs in exc.sides.values() if step.me in rs), [step.me])
        if step.me == side[0]:
            root = self.out / "checkpoints" / "diverged" / f"replicas_{'-'.join(map(str, side))}"
            p = step.progress
            path = Checkpointer(root, self.replica, self.cfg, self.replica.data.epoch_of).save(
                p.step, p.data_step, p.tokens, blocking=True)
            self._event("diverged_stop", step=p.step, checkpoint=str(path), side=side)
        return EXIT_DIVERGED

    def _save_and_stop(self, loop: Loop, kind: str, exc: Exception, advice: str, status: int) -> int:
        """The job cannot go on (``kind``: ``quorum_lost``, ``coordinator_lost``): the lowest member of
        the last generation saves a complete checkpoint of the committed state; returns ``status``."""
        step = loop.step
        if step.me == min(step.group.members):
            path = loop.save(blocking=True)
            self._event(kind, step=step.progress.step, checkpoint=str(path), message=str(exc))
            if self.rank == 0:
                print(f"recover: replica {self.replica_id}: {exc}. Saved a complete checkpoint of step "
                      f"{step.progress.step} at {path}; {advice}.", file=sys.stderr, flush=True)
        return status
