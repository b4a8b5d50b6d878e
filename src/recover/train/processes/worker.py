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

Stops and coordinator loss (exit statuses in ``train/processes/exits.py``):
- SIGTERM (:meth:`ReplicaWorker.request_stop`, a preempted node): a graceful leave: the next vote
  asks to leave; at its commit this replica leaves (its share of that step is in it), the others go
  on in the next generation without a failure round or any recompute; it saves nothing and exits
  with status 0 (the launcher does not restart it: a replacement joins when started). A process not
  yet training exits at once with status 0.
- SIGINT (Ctrl-C; the launcher's graceful stop sends it to every worker): the next vote asks for a
  stop; the commit that carries it ends the job for every member after that step, the lowest live
  replica saving a complete checkpoint: status 6. A process not yet training exits at once with 6.
- Silent data corruption and non-finite values: a replica the coordinator fences as ``divergent`` or
  faulty exits like any fenced one; when it ends the job (no majority among the parameter
  fingerprints, or a microbatch not finite on two replicas) the state is saved (each side's under
  ``checkpoints/diverged/``, or the last committed one) and every replica exits with status 8 or 9.
- Total loss of state (every replica that held it was lost, e.g. all killed at once): the replicas the
  launcher restarts load the newest complete checkpoint and the job goes on from there by itself; with
  no checkpoint each exits with status 11 and a line saying so.
- The coordinator lost: the client reconnects for ``fault_tolerance.coordinator_reconnect_s`` while
  the training thread keeps its state (see :mod:`recover.coord.client`); if it does not come back (or,
  paused, stays silent that long), the lowest member saves a complete checkpoint and every replica
  exits with status 7.
- Cut off: a replica that hears nothing from the coordinator for its read deadline while the
  coordinator's host answers nothing (a downed link, dropped packets) leaves with one line and
  status 5, like a fenced one (the coordinator fenced it; the job goes on without it), also when its
  training thread meets the broken path first as a torch.distributed network error.
- A full disk (or an I/O error): a periodic checkpoint the storage refuses is abandoned and training
  goes on; when the checkpoint the job ends with is refused (the last step's, a stop's, or one when the
  job cannot go on), the saver exits with status 12 (``EXIT_UNSAVED``) after one line naming the path,
  the free space and the cause; older checkpoints are kept (:class:`~recover.train.processes.loop.Loop`).

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
from typing import Any

from recover.baselines import JobFailed
from recover.config import Config
from recover.coord.client import CoordinatorLost, Diverged
from recover.data.sampler import EvalSampler
from recover.errors import ConfigError, DataError, QuorumLost, RecoverError, StateLost
from recover.names import Baseline, Phase
from recover.recovery.protocol import Progress
from recover.train.checkpoints.checkpoint import Checkpointer
from recover.train.processes.exits import EXIT_STOPPED, EXIT_UNSAVED, PLACEMENT_ENV
from recover.train.processes.loop import Loop, use_deterministic_kernels
from recover.train.processes.process import Launched
from recover.train.processes.session import NETWORK_ERRORS, Session
from recover.train.processes.trainer import build_replica
from recover.train.replicas.dist import DistContext, init_from_env
from recover.train.replicas.replica import Replica

Built = tuple[Replica, EvalSampler, DistContext]


def build(cfg: Config, procs: int) -> Built:
    """The replica's model, optimizer and data (the slow part of starting: done before joining).

    The launcher prepared the data. A replica of several ranks reads its torchrun environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and forms its own process group with the
    intra-replica timeout first.
    """
    from recover.comm.nccl import apply_env_defaults
    from recover.data.layout import resolve_data_dir

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
    replica, eval_data = build_replica(cfg, ctx, resolve_data_dir(cfg.data))
    return replica, eval_data, ctx


def worker_device(cuda_devices: int, placement: str | None, processes: int) -> str:
    """The device of a worker that sees ``cuda_devices`` CUDA GPUs, given its ``RECOVER_PLACEMENT``
    (None: the launcher gave it a GPU, or it was not started by ``recover launch``) in a job of
    ``processes`` processes. Raises ConfigError when it would silently share GPU 0 with the others."""
    if cuda_devices == 0:
        return "cpu"
    if placement == "none" and processes > 1:
        raise ConfigError(f"this worker sees {cuda_devices} CUDA GPU(s), but `recover launch` found none to give its "
                          f"{processes} processes (no CUDA_VISIBLE_DEVICES, /proc/driver/nvidia/gpus or nvidia-smi), "
                          "so they would all use GPU 0: pass --gpus 0,1,... to give each rank its own, or --share-gpus")
    return "cuda:0"


def own_device(cfg: Config) -> Any:
    """A one-process replica's device: the GPU the launcher gave it (``cuda:0`` in its own view), else the CPU
    (:func:`worker_device`; checked for every rank). Raises ConfigError."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    processes = cfg.parallel.replicas * cfg.parallel.procs_per_replica
    device = torch.device(worker_device(gpus, os.environ.get(PLACEMENT_ENV), processes))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's barrier-like calls use the current device
    return device


class ReplicaWorker:
    """Trains ``cfg`` as the replica ``launched`` names (:class:`~recover.train.processes.process.Launched`): the
    built-in replica through the launched :class:`~recover.train.processes.session.Session` every kind of
    replica shares."""

    def __init__(self, cfg: Config, launched: Launched, procs: int = 1, built: Built | None = None,
                 baseline: Baseline | str | None = None) -> None:
        self.cfg, self.out, self.replica_id = cfg, launched.out, launched.replica
        self.replica, self.eval_data, ctx = built or build(cfg, procs)
        rank, ranks = (ctx.rank, ctx.world_size) if cfg.parallel.procs_per_replica > 1 else (0, 1)
        self.checkpointer = Checkpointer(self.out / "checkpoints", self.replica, cfg, self.replica.data.epoch_of)
        start = Progress.of(self.checkpointer.resume()[1]) if launched.resume else Progress()
        self.session = Session.of(launched, cfg, rank=rank, ranks=ranks, start=start, baseline=baseline,
                                  restore=self.restore)

    def restore(self) -> Progress | None:
        """Every replica holding the state was lost: the newest intact checkpoint, loaded (None: none, or every
        one damaged: each named on stderr)."""
        from recover.errors import CheckpointError
        from recover.train.checkpoints.integrity import list_checkpoints

        if not list_checkpoints(self.checkpointer.root):
            return None
        try:
            path, counters = self.checkpointer.resume()
        except CheckpointError:
            return None
        print(f"recover: replica {self.replica_id}: every replica holding the training state was lost; restored "
              f"{path} (step {counters['step']})", file=sys.stderr, flush=True)
        return Progress.of(counters)

    def request_stop(self, signum: int) -> None:
        """SIGTERM: leave after the next commit; SIGINT: stop the job then (see the module docstring).
        Signal handler."""
        self.session.request_stop(signum)

    def run(self) -> int:
        """Trains to ``training.steps``; returns the process's exit status (see ``train/processes/exits.py``)."""
        try:
            return self._train()
        finally:
            self.checkpointer.close()  # its writer process, if a save started one

    def _train(self) -> int:
        session, tc, ft = self.session, self.cfg.training, self.cfg.fault_tolerance
        try:
            step = session.connect(self.replica, tc.global_microbatches, assignment=tc.assignment,
                                   audit_every=ft.audit_every, overlap=ft.overlaps(self.replica.device.type))
        except CoordinatorLost as exc:
            if session.client is None:
                raise
            if not session.client.stopping:  # fenced (a partition found in its first rendezvous): as mid-run
                code = session.status(exc, None)
                if code is None:
                    raise
                return code
            print(f"recover: replica {self.replica_id}: {exc}", file=sys.stderr, flush=True)
            return 0 if session.client.finished else EXIT_STOPPED
        except StateLost as exc:  # admitted where nobody holds the state, and no checkpoint to restore
            return session.status(exc, None)
        loop = Loop(self.cfg, step, self.replica, self.eval_data, self.checkpointer, session.write,
                    after_step=lambda s: step.hook(s, Phase.IDLE), busy=session.client.activity,
                    on_event=session.event if session.rank == 0 else lambda kind, **fields: None)

        try:
            loop.run(tc.steps)
        except (QuorumLost, JobFailed, Diverged, CoordinatorLost, DataError, StateLost, *NETWORK_ERRORS) as exc:
            code = session.status(exc, loop.save_last)
            if code is None:  # a network error of a replica that is not cut off: not ours to hide
                raise
            return EXIT_UNSAVED if loop.unsaved else code
        loop.settle()
        code = session.close(loop.stopped, None if loop.unsaved else self.checkpointer.root)
        return EXIT_UNSAVED if loop.unsaved else code
