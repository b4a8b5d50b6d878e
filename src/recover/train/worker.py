"""One replica of a fault-tolerant job (``recover worker``, started by ``recover launch``).

The loop reads like plain PyTorch with the layers as wrappers:

    membership = client.register()                    # layer 1: coordinator
    group = FaultTolerantGroup.create(...)            # layer 1: this generation's collectives
    for step in steps:
        outcome = resilient_step.run(step)            # layers 2+3: compute, reduce, recover, commit
        accumulator.apply(outcome.reduced, M, ...)    # divide by M, clip, AdamW: only after commit
        if outcome.admitted: grow the group and send our state to the joiners

Contract: every committed step this replica applies holds exactly M microbatches; a joiner starts
from state bitwise equal to the live replicas' at a step boundary; if fewer than
``fault_tolerance.min_replicas`` survive, the lowest live replica saves a complete checkpoint
and every survivor exits with status 3 and a message saying so.

A replica of several ranks (``parallel.pp x fsdp x tp > 1``) is one torchrun-style job: every rank
runs this same loop with the same control flow. Rank k holds its own coordinator connection and
its own fault-tolerant group, *lane* k (rank k of every live replica), on which it sums its shard
of the gradient; the coordinator treats the replica's connections as one member (registered,
acked and voted only when all ranks have), so a step commits only if every rank of every live
replica voted for it, and the death of any rank fences the whole replica: its other ranks leave
with :data:`EXIT_FENCED` (or fail fast on the bounded intra-replica groups) and the launcher
reaps them. Only rank 0 writes the replica's step records.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from recover.baselines import JobFailed, StepDropped, step_class
from recover.config import Config
from recover.coord.client import CoordinatorLost
from recover.errors import QuorumLost, RecoverError
from recover.faults import FailureSpec, FaultInjector
from recover.observe.events import EventLog, JsonlWriter
from recover.recovery.protocol import StepOutcome
from recover.train.dist import DistContext, init_from_env
from recover.train.exits import EXIT_FENCED, EXIT_JOB_FAILED, EXIT_QUORUM_LOST, replica_log_path
from recover.train.optim import lr_at, set_lr
from recover.train.trainer import Trainer


def build_trainer(cfg: Config, out: Path, procs: int, resume: bool = False) -> Trainer:
    """The model, optimizer and data of one replica (the slow part of starting: done before joining).

    A replica of several ranks reads its torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and forms its own process group with the intra-replica timeout first.
    """
    ctx = DistContext(local_world_size=procs)
    if cfg.parallel.procs_per_replica > 1:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RecoverError(f"a replica of {cfg.parallel.procs_per_replica} ranks (parallel.pp x fsdp x tp) "
                               "runs as a torchrun job: start `recover worker` with torchrun --nproc-per-node "
                               f"{cfg.parallel.procs_per_replica}, or let `recover launch` start it")
        ctx = init_from_env(cfg.parallel.backend, cfg.fault_tolerance.intra_replica_timeout_s)
        ctx.local_world_size = procs
    return Trainer(cfg, out, ctx, resume=resume, quiet=True)


class ReplicaWorker:
    """Trains ``cfg`` as replica ``replica`` of a job whose coordinator listens at ``host:port``."""

    def __init__(self, cfg: Config, out: str | os.PathLike[str], replica: int, host: str, port: int, token: str,
                 failures: list[FailureSpec] = (), join: bool = False, procs: int = 1,
                 trainer: Trainer | None = None, baseline: str | None = None, resume: bool = False) -> None:
        self.cfg, self.out, self.replica = cfg, Path(out), replica
        self.host, self.port, self.token, self.join = host, port, token, join
        self.baseline = baseline
        self.trainer = trainer or build_trainer(cfg, self.out, procs, resume)
        sharded = self.trainer.engine is not None
        self.rank, self.ranks = (self.trainer.ctx.rank, self.trainer.ctx.world_size) if sharded else (0, 1)
        self.data_step = self.trainer.start_step
        self.events = EventLog(self.out / "events.jsonl")
        self.log = JsonlWriter(replica_log_path(self.out, replica)) if self.rank == 0 else None
        self.injector = FaultInjector(failures, replica, self.rank, self.ranks, before_kill=self._before_kill)

    def _before_kill(self, spec: FailureSpec) -> None:
        self.events.event("kill", replica=self.replica, rank=self.rank, step=spec.step, phase=spec.phase,
                          pid=os.getpid())

    def _event(self, kind: str, **fields: Any) -> None:
        if self.ranks > 1:
            fields["rank"] = self.rank
        self.events.event(kind, replica=self.replica, **fields)

    # ---- membership and state ------------------------------------------------------------
    def _connect(self) -> tuple[Any, Any, int]:
        from recover.comm import FaultTolerantGroup
        from recover.coord.client import CoordinatorClient

        ft = self.cfg.fault_tolerance
        client = CoordinatorClient(self.host, self.port, self.token, self.replica,
                                   heartbeat_interval_s=ft.heartbeat_interval_s, rank=self.rank, ranks=self.ranks)
        membership = client.register(join=self.join)
        group = FaultTolerantGroup.create(client, membership, backend=self.cfg.parallel.backend,
                                          timeout_s=ft.collective_timeout_s)
        step = self.trainer.start_step
        if self.join:
            group, step = self._receive_state(group)
        self._event("started", generation=group.generation, members=list(group.members), step=step,
                    joined=self.join)
        return client, group, step

    def _counters(self, step: int) -> dict[str, int]:
        return {"step": step, "data_step": self.data_step, "total_tokens": self.trainer.total_tokens}

    def _receive_state(self, group: Any) -> tuple[Any, int]:
        """A joiner takes the live replicas' state (again on the next generation if a peer dies meanwhile)."""
        from recover.comm.transfer import receive_state, source_rank
        from recover.errors import PeerFailure

        t0 = time.perf_counter()
        t = self.trainer
        while True:
            try:
                state = receive_state(group, source_rank(group))
                break
            except PeerFailure:
                group = group.next_generation()
        counters = t.load_transfer_state(state)
        t.total_tokens = counters["total_tokens"]
        self.data_step = counters["data_step"]
        self._event("state_received", step=counters["step"], ms=round((time.perf_counter() - t0) * 1000, 2),
                    tensors=len(state))
        return group, counters["step"]

    def _grow(self, group: Any, next_step: int) -> Any:
        """Moves to the generation that admits joiners; its lowest old member sends them our state.

        A failure during the transfer moves everyone to the next generation, which still lists the
        joiners until the next commit, and the transfer is redone (or skipped if they died)."""
        from recover.comm.transfer import receive_state, send_state, source_rank
        from recover.errors import PeerFailure

        t = self.trainer
        while True:
            group = group.next_generation()
            if not group.membership.joined:
                return group
            src = source_rank(group)
            try:
                if group.rank == src:
                    send_state(group, t.transfer_state(self._counters(next_step)))
                else:
                    receive_state(group, src)  # every member takes part; ours is already identical
                break
            except PeerFailure:
                continue
        self._event("grew", generation=group.generation, members=list(group.members), step=next_step)
        return group

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        t = self.trainer
        tc = self.cfg.training
        M = tc.global_microbatches
        client, group, step = self._connect()
        kwargs = {"initial_replicas": self.cfg.parallel.replicas} if self.baseline == "shrink" else {}
        protocol = step_class(self.baseline)(
            self.replica, group, client, t.acc, lambda s, ids: t.compute(s, ids, self.injector.maybe_fail), M,
            self.cfg.fault_tolerance.min_replicas, hook=self.injector.maybe_fail, on_event=self._event, **kwargs)
        try:
            while step < tc.steps:
                t0 = time.perf_counter()
                set_lr(t.optimizer, lr_at(step, tc))
                try:
                    outcome = protocol.run(step, self.data_step)
                except StepDropped:
                    self.data_step += 1  # shrink-and-drop: the step's samples are lost
                    continue
                self.injector.maybe_fail(step, "optimizer")
                # recover always divides by M; shrink-and-drop by the (smaller) count it committed
                grad_norm = t.acc.apply(outcome.reduced, M if self.baseline != "shrink" else outcome.microbatches,
                                        t.optimizer, tc.grad_clip)
                self._record(step, outcome, grad_norm, time.perf_counter() - t0)
                step += 1
                self.data_step += 1
                if outcome.admitted is not None:
                    protocol.group = self._grow(protocol.group, step)
                self.injector.maybe_fail(step - 1, "idle")
        except QuorumLost as exc:
            return self._stop_on_quorum_loss(protocol.group, step, exc)
        except JobFailed:
            return EXIT_JOB_FAILED
        except CoordinatorLost as exc:
            print(f"recover: replica {self.replica} rank {self.rank}: {exc}; stopping (the launcher restarts the "
                  "replica if --rejoin-after is set)", file=sys.stderr, flush=True)
            return EXIT_FENCED
        finally:
            if self.log is not None:
                self.log.close()
        self._event("finished", step=step, generation=protocol.group.generation)
        protocol.group.close()
        client.close()
        return 0

    def _is_leader(self, group: Any) -> bool:
        return self.replica == min(group.members)

    def _record(self, step: int, outcome: StepOutcome, grad_norm: float, dt: float) -> None:
        t, tc = self.trainer, self.cfg.training
        record = t.record(step, outcome.loss_sum, outcome.microbatches, grad_norm, dt, len(outcome.live),
                          outcome.generation)
        record.update(replica=self.replica, computed=outcome.computed, data_step=self.data_step)
        if outcome.recoveries:
            record["recovery_ms"] = sum(r["regroup_ms"] for r in outcome.recoveries)
            record["failures"] = [r["dead"] for r in outcome.recoveries]
        leader = self.replica == min(outcome.live)
        if leader and tc.eval_due(step):
            record["val_loss"] = t.evaluate()
        if self.log is not None:
            self.log.write(record)
        if leader and tc.checkpoint_due(step):
            t.save(step + 1)

    def _stop_on_quorum_loss(self, group: Any, step: int, exc: QuorumLost) -> int:
        if self._is_leader(group):
            path = self.trainer.save(step)
            self._event("quorum_lost", step=step, checkpoint=str(path), message=str(exc))
            if self.rank == 0:
                print(f"recover: replica {self.replica}: {exc}. Saved a complete checkpoint of step {step} at "
                      f"{path}; resume with more replicas.", file=sys.stderr, flush=True)
        return EXIT_QUORUM_LOST
