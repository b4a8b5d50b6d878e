"""recover as a library: your own model, optimizer and loop, trained under the invariant.

    rt = recover.init()                                  # this process's replica, device, run directory
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda step: ..., clip=1.0)
    for step in job.steps(total):                        # committed steps only
        for mb in step:                                  # this replica's ids, then orphans of a lost replica
            x, y = mb.batch                              # sample(step, id): a pure function of (step, id)
            mb.backward(loss_fn(model(x), y))            # recover folds the gradient; divides by M, clips, steps

Contract:
- Every step that ``steps()`` yields is committed: it held exactly M microbatches, the same ids
  ``0..M-1`` (the same ``samples(step, id)``) as a failure-free run, and the update divided their gradient
  sum by M, clipped it by ``clip`` and ran ``optimizer.step()`` with ``lr(step)``. recover owns the
  microbatch boundary: a step hands out this replica's share, and after a failure elsewhere the orphans
  it was given in the same step (:meth:`~recover.recovery.protocol.ResilientStep.run_iter`).
- The global RNG is seeded from (seed, step, id) before each microbatch is handed out, so dropout follows
  the sample, not the replica that computes it.
- ``samples`` is read ahead (``prefetch`` steps, :mod:`recover.data.prefetch`): a step's share and this
  replica's expected share of the coming steps are read in one background thread (pinned for a GPU), so
  ``samples`` must be what the contract says, a pure function of (step, id) (no global RNG, no cursor);
  it is never called twice at once. An exception it raises surfaces at the microbatch it was reading.
  ``prefetch=0`` calls it on your thread as each microbatch is handed out.
- :func:`init` finds its job in the environment ``recover launch ... -- python SCRIPT`` sets
  (:data:`WORKER_ENV`: the coordinator, the token file, the run directory, this process's replica id,
  its fault injections, whether it joins a running job). There, every replica registers with the
  coordinator, reduces over layer 1's fault-tolerant groups, writes its step records and events into the
  run directory like a built-in replica, and exits with the same statuses when it is fenced or the job
  ends (:mod:`recover.train.processes.exits`). Run as plain ``python SCRIPT`` it is one replica on its own.
- A joiner (a restarted replica) takes the model's parameters, buffers, optimizer state and ``extra``
  state from a live replica at a step boundary; ``steps()`` then continues from the step the job is at.
- :meth:`Job.save` checkpoints the model, optimizer, ``extra`` state and counters between steps
  (:mod:`recover.train.checkpoints.own_checkpoint`: the built-in trainer's disk conventions); ``Job(resume=RUN)``
  continues from the newest intact one, bitwise in deterministic mode. In a launched job only the lowest
  live replica writes, with no collective; ``recover launch --resume`` makes ``RUN`` the run directory.
  When every replica holding the state is lost at once, the replicas started in their place load the newest
  of these checkpoints and ``steps()`` redoes the steps after it (none saved: they exit with status 11).
- A replica of several ranks (``recover launch --fsdp F --tp T``, or plain ``torchrun``: one replica of all
  its ranks, fsdp over them): :func:`init` forms the replica's process group and ``rt.mesh``, its
  ``(fsdp, tp)`` DeviceMesh, on which you apply your own FSDP2 (``fully_shard(..., mesh=rt.mesh["fsdp"])``)
  and TP plans before building the ``Job``. The ranks of an fsdp column compute different microbatches (a
  rank with fewer runs a zero-weight padding pass, ``mb.weight == 0``, so FSDP's collectives pair up); the
  ranks of a TP group compute the same ones. recover sums the gradients across replicas from the local
  shards after backward: no DDP or FSDP hooks of its own (it sets FSDP2's gradient divide factor to 1: a
  shard holds a sum).
- SIGINT in a launched script (or SIGTERM to the launcher): the job stops after the next commit; the
  lowest live replica saves a checkpoint of it (as it does when the quorum or the coordinator is lost,
  or the replicas diverge), every replica's ``steps()`` ends and the process exits with status 6.
  SIGTERM to one replica's process is its graceful leave: its ``steps()`` ends after the next commit,
  it saves nothing and exits with status 0, and the others train on.
- Scope: pipeline parallelism, audits of arithmetic and the overlapped reduction are the built-in
  trainer's (``recover train``, ``recover launch`` without ``--``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recover.names import WORKER_ENV, Event, Phase
from recover.train.processes import script
from recover.train.replicas.steps import LoopContext, Step, Steps

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim.lr_scheduler import LRScheduler

    from recover.recovery.protocol import Progress


@dataclass
class Runtime:
    """Where this process trains (see :func:`init`)."""

    replica: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    out: Path | None = None
    """The run directory (``--out`` of ``recover launch``); None when run on its own."""
    launched: dict[str, Any] | None = None
    """The job's description from :data:`WORKER_ENV`; None when run on its own."""
    rank: int = 0
    """This process's rank inside its replica."""
    ranks: int = 1
    """The replica's processes (``fsdp x tp``)."""
    mesh: DeviceMesh | None = None
    """The replica's ``(fsdp, tp)`` DeviceMesh for your FSDP2 / TP; None for a replica of one process."""
    group: Any = None
    """The replica's process group (all its ranks); None for a replica of one process."""

    @property
    def fsdp(self) -> int:
        return self.mesh["fsdp"].size() if self.mesh is not None else 1

    @property
    def coordinate(self) -> tuple[int, int]:
        """This rank's ``(fsdp, tp)`` index in :attr:`mesh`."""
        coordinate = self.mesh.get_coordinate() if self.mesh is not None else None
        if coordinate is None:  # no mesh, or this rank is not in it
            return 0, 0
        fsdp, tp = coordinate
        return fsdp, tp


_RUNTIME: list[Runtime] = []  # the process's one runtime, once init() has made it


def init() -> Runtime:
    """This process's replica, rank, device, mesh and run directory: from ``recover launch``'s environment,
    else from ``torchrun``'s (one replica of all its ranks), else one replica of one process (``cuda:0``
    when a GPU is visible, else the CPU). Called again (by :class:`Job`), it returns the same runtime."""
    if not _RUNTIME:
        _RUNTIME.append(_init())
    return _RUNTIME[0]


def _init() -> Runtime:
    raw = os.environ.get(WORKER_ENV)
    if raw is None:
        from recover.config import Config, ParallelConfig

        world = int(os.environ.get("WORLD_SIZE", "1"))
        return _runtime(Config(parallel=ParallelConfig(fsdp=world)), None, 0, None)
    from recover.config import RUN_CONFIG, load_config
    from recover.train.processes.process import prepare

    job = json.loads(raw)
    # recover launch wrote the run's config.json; a cluster recipe names the preset and its overrides
    cfg = load_config(job.get("config") or str(Path(job["out"]) / RUN_CONFIG), list(job.get("overrides", [])))
    prepare(cfg)  # the set-up of every replica process (recover.train.processes.process)
    job["errors"] = script.ScriptErrors(Path(job["out"]), int(job["replica"]),
                                        int(os.environ.get("RANK", "0"))).install()
    script.skip_teardown()
    job["config"] = cfg
    return _runtime(cfg, job, int(job["replica"]), Path(job["out"]))


def _runtime(cfg: Any, job: dict[str, Any] | None, replica: int, out: Path | None) -> Runtime:
    """The runtime of a replica of ``cfg.parallel``'s ``fsdp x tp`` ranks (pipeline stages: the built-in
    trainer's only). Raises ConfigError."""
    from recover.errors import ConfigError
    from recover.parallel.dims import ParallelDims
    from recover.train.processes.worker import own_device
    from recover.train.replicas.dist import init_from_env

    p = cfg.parallel
    if p.pp > 1:
        raise ConfigError(f"parallel.pp = {p.pp}: pipeline stages are the built-in trainer's only; train your "
                          "model with fsdp and tp inside a replica (or pp = 1)")
    if p.procs_per_replica == 1:
        return Runtime(replica, own_device(cfg), out, job)
    ctx = init_from_env(p.backend, cfg.fault_tolerance.intra_replica_timeout_s)
    dims = ParallelDims.from_config(p)
    dims.check_world(ctx.world_size)
    timeout = cfg.fault_tolerance.intra_replica_timeout_s
    mesh = dims.build_mesh(ctx.device.type, timeout)
    return Runtime(replica, ctx.device, out, job, ctx.rank, ctx.world_size, mesh["fsdp", "tp"],
                   dims.build_group(timeout))


class Job(Steps):
    """Trains ``model`` with ``optimizer`` under recover (see the module docstring).

    Args:
        model, optimizer: yours; the optimizer over the model's trainable parameters.
        samples: ``samples(step, id) -> batch``, a pure function (tensors in the batch are moved to the
            device; tuples, lists and dicts of them too).
        microbatches: M, the microbatches of every step.
        lr: the learning rate of a committed step, ``lr(step)``; or a torch ``LRScheduler`` over ``optimizer``,
            stepped once after each committed update (and carried to joiners and checkpoints); None: the
            optimizer's, untouched.
        clip: the bound on the global gradient norm (0: none).
        seed: seeds each microbatch's RNG (with the step and the id).
        deterministic: float64 gradient sums (bitwise equal to the failure-free run); default: the
            launch's ``--deterministic``, else False.
        tokens_per_microbatch: for the records' token counts (0 if unknown).
        extra: more state that is trained along (an EMA, an LR scheduler): an object with ``state_dict()``
            and ``load_state_dict()`` or a dict of such; it goes to joiners and into checkpoints.
        resume: a run directory: the model, optimizer, ``extra`` and counters are loaded from the newest intact
            checkpoint of :meth:`save` under ``RUN/checkpoints`` (none there: a fresh start, said in one line);
            default: the launch's run directory with ``recover launch --resume``, else none.
        prefetch: steps of look-ahead of ``samples`` in a background thread (0: read on your thread);
            default: the launch's ``data.prefetch``, else ``DataConfig.prefetch``. ``job.reads.take()`` says
            how long your loop waited for samples since it was last asked.
        runtime: from :func:`init` (called here when not given).
        evaluate, eval_every: ``evaluate() -> float`` (e.g. a validation loss) after every ``eval_every``-th
            committed step and the last, by the lowest live replica (all its ranks): its value is the step
            record's ``val_loss`` (``metrics.jsonl``, the dashboards, the reports) and ``step.val_loss``
            (None on the other replicas and steps).
        scaler: a ``torch.amp.GradScaler`` for float16: each microbatch's loss is scaled by its scale before the
            backward, an overflowed step's update is skipped and the scale backs off, decided by the committed
            step on every replica alike (bitwise as without failures; :mod:`recover.train.replicas.scaling`).
        check_samples: read the first microbatch of each step twice and compare (an impure ``samples``, one
            with the global RNG or a running cursor, is refused at that step: :mod:`recover.train.replicas.contract`).

    Raises:
        IncompatibleCheckpoint: ``resume`` holds a checkpoint of another model or extra state (nothing loaded).
        ContractError: the optimizer steps parameters that are not the model's; the ranks of a replica built
            different initial weights (seed before building the model).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, samples: Callable[[int, int], Any],
                 microbatches: int, lr: Callable[[int], float] | LRScheduler | None = None, clip: float = 1.0,
                 seed: int = 0,
                 deterministic: bool | None = None, tokens_per_microbatch: int = 0, extra: Any = None,
                 resume: str | os.PathLike[str] | None = None, runtime: Runtime | None = None,
                 prefetch: int | None = None, check_samples: bool = True,
                 evaluate: Callable[[], float] | None = None, eval_every: int = 0, scaler: Any = None) -> None:
        from recover.config import DataConfig
        from recover.data.prefetch import Prefetcher
        from recover.train.replicas.contract import PureSamples, probe_id
        from recover.train.replicas.own import OwnReplica, column

        if microbatches < 1:
            raise ValueError(f"microbatches = {microbatches}: a step needs at least one")
        if eval_every < 0 or (eval_every and evaluate is None):
            raise ValueError(f"eval_every = {eval_every}: a count >= 0, with evaluate given")
        self.runtime = runtime or init()
        cfg = self.runtime.launched["config"] if self.runtime.launched else None
        if deterministic is None:
            deterministic = bool(cfg and cfg.training.deterministic)
        if deterministic:
            from recover.train.processes.loop import use_deterministic_kernels

            use_deterministic_kernels()
        self.model, self.samples, self.M, self.seed = model, samples, microbatches, seed
        rt = self.runtime
        if prefetch is None:
            prefetch = cfg.data.prefetch if cfg else DataConfig.prefetch
        # launched replicas of one rank digest each step's probe batch for the vote (recover.train.replicas.contract)
        probe = (lambda step: probe_id(step, microbatches)) if cfg is not None and rt.ranks == 1 else None
        self.pure = PureSamples(samples, check_samples, probe)
        self.reads = Prefetcher(self.pure, prefetch, rt.device)
        fsdp_index, tp_index = rt.coordinate
        dp_group = rt.mesh["fsdp"].get_group() if rt.mesh is not None and rt.fsdp > 1 else None
        self.replica = OwnReplica(model, optimizer, lr=lr, clip=clip, deterministic=deterministic,
                                  device=rt.device, tokens_per_microbatch=tokens_per_microbatch, group=rt.group,
                                  fsdp=rt.fsdp, fsdp_index=fsdp_index, tp_index=tp_index, extra=extra,
                                  dp_group=dp_group, scaler=scaler)
        fsdp = rt.fsdp
        super().__init__(context=LoopContext(
            self.replica, self.reads, rt.device, seed, column=lambda ids: column(ids, fsdp, fsdp_index),
            hook=self._hook, failed=self._failed, probe=probe, probed=self._probed if probe else lambda s: None,
            evaluated=self._evaluated))
        self.evaluate, self.eval_every = evaluate, eval_every
        self._total = 0
        self._fields: dict[str, Any] = {}  # what the next step record carries besides recover's own
        if self.runtime.launched and self.runtime.launched.get("errors") is not None:
            self.runtime.launched["errors"].job = self  # an uncaught exception reports this job's step
        self._session: Any = None
        self.start = self._resume(resume)
        """The counters the step protocol starts from (a resumed checkpoint's) and then advances."""

    def _resume(self, resume: str | os.PathLike[str] | None) -> Progress:
        from recover.recovery.protocol import Progress
        from recover.train.checkpoints import own_checkpoint

        launched = self.runtime.launched
        if resume is None and launched and launched.get("resume"):
            resume = self.runtime.out
        if resume is None or (launched and launched.get("join")):  # a joiner takes the live replicas' state
            return Progress()
        root = own_checkpoint.checkpoints_of(resume)
        return own_checkpoint.resume(root, self.replica, clean=launched is None) or Progress()

    def save(self, run_dir: str | os.PathLike[str] | None = None, *, keep: int | None = None) -> Path | None:
        """Checkpoints the model, optimizer, ``extra`` state and counters after the steps committed so far, in
        ``RUN/checkpoints/step_NNNNNN`` (layout: :mod:`recover.train.checkpoints.own_checkpoint`). Call it between steps
        (after a step's microbatch loop), the same on every replica.

        In a launched job only the lowest live replica writes, alone (no collective, the others do not wait):
        it returns the checkpoint's directory, every other replica None at once.

        Args:
            run_dir: RUN; default: the launch's run directory (``--out``).
            keep: complete checkpoints kept, older ones deleted (0: all); default: the launch's
                ``training.keep_checkpoints``, else 3.

        Raises:
            RuntimeError: called inside a step's microbatch loop. ValueError: no ``run_dir`` when not launched.
        """
        from recover.train.checkpoints import own_checkpoint

        if self.context is not None and self.context.inside:
            raise RuntimeError("job.save() inside a step's microbatch loop: call it after the loop, between steps")
        run_dir = run_dir if run_dir is not None else self.runtime.out
        if run_dir is None:
            raise ValueError("job.save(): run_dir is None; give the run directory, e.g. job.save('runs/mine')")
        if self.protocol is None:
            self._start()
        if self._session is not None and min(self.protocol.group.members) != self.runtime.replica:
            return None
        # launched: the coordinator's hang rule does not count the write as a stuck training loop
        with self._session.client.activity("io") if self._session is not None else nullcontext():
            return self._write(own_checkpoint.checkpoints_of(run_dir), keep)

    def _write(self, root: Path | None, keep: int | None = None) -> Path:
        """A checkpoint of the committed state under ``root`` (None: the run directory's ``checkpoints/``):
        :meth:`save`'s, and the launched session's own (a committed stop, quorum or coordinator lost,
        divergence: :mod:`recover.train.processes.session`)."""
        from recover.train.checkpoints import own_checkpoint

        cfg = self.runtime.launched["config"] if self.runtime.launched else None
        keep = keep if keep is not None else (cfg.training.keep_checkpoints if cfg else 3)
        if root is None:
            if self.runtime.out is None:
                raise ValueError("a checkpoint of a Job run alone needs its run directory: job.save('runs/mine')")
            root = own_checkpoint.checkpoints_of(self.runtime.out)
        return own_checkpoint.save(root, self.replica, self.protocol.progress, seed=self.seed, microbatches=self.M,
                                   keep=keep)

    def _hook(self, step: int, phase: Phase) -> None:
        if self._session is not None:
            self._session.hook(step, phase)

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Your own metrics (numbers, or tensors of one element) into the record of the step in progress, the
        last one committed once its microbatch loop is over: ``metrics.jsonl``'s ``user`` and the dashboards'
        ``user/NAME`` (TensorBoard, W&B) in a launched job; run alone, there is no record (nothing is written).

        Raises:
            TypeError: a value that is not a number.
        """
        user = self._fields.setdefault("user", {})
        for name, value in metrics.items():
            if torch.is_tensor(value) and value.numel() == 1:
                value = value.detach().item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"job.log({name}=...): {type(value).__name__} is not a number")
            user[name] = float(value)

    def _evaluated(self, outcome: Any) -> float | None:
        """After a step's commit: ``evaluate()`` when due and this replica is the lowest live one."""
        s = outcome.step
        if self.evaluate is None or not ((s + 1) % self.eval_every == 0 or s + 1 == self._total):
            return None
        if min(outcome.live) != self.runtime.replica:
            return None
        t0 = time.perf_counter()
        with self._session.client.activity("io") if self._session is not None else nullcontext():
            value = float(self.evaluate())
        self._fields.update(val_loss=value, eval_s=round(time.perf_counter() - t0, 6))
        return value

    def record_fields(self) -> dict[str, Any]:
        """What the step record of the last committed step carries besides recover's own (``job.log``'s ``user``,
        an evaluation's ``val_loss``), handed over once."""
        fields, self._fields = self._fields, {}
        return fields

    def _probed(self, data_step: int) -> None:
        """The digest of ``data_step``'s probe batch into this replica's vote (read now if it was not yet)."""
        from recover.train.replicas.contract import probe_id

        mb = probe_id(data_step, self.M)
        if data_step not in self.pure.digests:
            self.reads.get(data_step, mb)
        self.replica.audit_id = mb
        self.replica.audit_value = {"fp": self.pure.digests[data_step], "norm": 0.0, "exact": True, "samples": True}

    def steps(self, total: int) -> Iterator[Step]:
        """Committed steps until ``total`` are committed (a joiner starts where the job is), or until a
        committed stop (SIGINT in a launched job: the process then exits with status 6), or this replica's
        leave (SIGTERM to it: status 0)."""
        if self.protocol is None:
            self._start()
        self._total = total
        if self._session is not None and self.runtime.rank == 0:  # the script's step count is the job's
            self._session.event(Event.SCRIPT_STEPS, steps=int(total))
        try:
            yield from super().steps(total)
        except Exception as exc:
            self._failed(exc)
            raise
        if self._session is not None:
            script.end(self._session, self.protocol.progress.step < total, self._write)

    def _committed(self, outcome: Any, dt: float) -> None:
        if self._session is not None:
            script.record(self._session, self, outcome, dt)
        else:  # no record to carry them
            self.record_fields()

    def _failed(self, exc: Exception) -> None:
        if self._session is not None:
            script.fail(self._session, exc, self._write)

    def _start(self) -> None:
        from recover.train.processes.process import build_step
        from recover.train.replicas.dist import CommitAll, StaticGroup

        if self.runtime.launched is None:
            self.protocol = build_step(self.replica, StaticGroup(), CommitAll(), self.M, self.start, None,
                                       seed=self.seed, overlap=False)
        else:
            self._session, self.protocol = script.connect(self)
        assert self.context is not None  # a Job always has its loop's context
        self.context.protocol = self.protocol

