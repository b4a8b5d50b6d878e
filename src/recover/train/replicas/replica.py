"""One replica: its model, optimizer, data and step gradients, under any PP x FSDP x TP layout.

There is one implementation: a one-process replica is the degenerate layout ``pp = tp = fsdp = 1``
(no mesh, no intra-replica group). Inside, a step is plain PyTorch::

    for microbatch in my share of ids:               # compute(step, ids)
        loss = lm_loss(model(inputs), targets); loss.backward(); fold .grad into the buffers
    reduced = <cross-replica sum of payload()>       # layer 1, outside this class
    grad = reduced / M; clip; optimizer.step()       # apply(reduced, M, step)

Contract (a method marked *collective* must be called by every rank of the replica, in the same
order, with the same arguments; the intra-replica groups have a bounded timeout, so a dead peer
surfaces as an exception within it and the caller treats the whole replica as lost):

- ``compute(step, ids, hook, final)`` (collective): the replica runs exactly ``ids`` of ``step``. FSDP shard
  column ``f`` takes block ``f`` of ``split_within_replica(ids, fsdp)``, padded with zero-weight
  passes so every rank runs the same number; with ``pp > 1`` the column's microbatches go through
  one pipeline schedule. Afterwards this rank's buffers hold its LOCAL part (TP shard, FSDP shard,
  pipeline stage) of ``sum over ids of d(mean loss of id)/d(params)``, the ledger holds ``ids``.
  The buffers belong to the replica and a reduction never writes them: a microbatch is in the
  ledger if and only if its gradient is in the buffers. Callable several times in a step (orphans
  after a failure); ``reset()`` starts a step; an empty ``ids`` is a no-op on every rank.
  ``final(i)`` (optional) is told when gradient buffer ``i`` is complete for this call: a one-process
  replica folds its last pass's gradients from autograd hooks as they become final and calls it
  there, so a streamed reduction (:mod:`recover.comm.reduction`, in ``reduce_order``) overlaps that
  backward, as DDP does; other layouts call it for every buffer at the end.
- No host synchronisation per microbatch: losses stay on the device until the end of the call, and
  finiteness is checked once per call, on the losses and the buffers, in ONE read to the host
  (:func:`~recover.train.replicas.bits.to_host`). Every tensor a collective inside the replica sees lives on
  ``device`` (an NCCL group has no CPU backend).
- ``payload()`` (local): this rank's gradient buffers in ``model.parameters()`` order, then a float64
  ``[loss_sum, count]`` of the WHOLE replica (the same tensors all step: ``reduce_order`` lists them in
  the order they become final). Summed with the payloads of the SAME replica-local rank
  of the other replicas (one lane per rank), every sum holds the global gradient shard and ``[sum, M]``.
- ``totals(reduced, fingerprint)`` (collective): what the step's reduced payload holds, read to the host
  at once (the one synchronisation after the reduction): ``[loss_sum, count]``, the L2 norm of the
  summed gradient over the whole replica (each shard counted once) and, when asked, this rank's
  parameter fingerprint.
- ``apply(reduced, divisor, step, sum_norm)`` (collective): the learning rate of ``step``; ``grad =
  reduced / divisor`` on the local shards, clipped by the global norm ``sum_norm / divisor``;
  ``optimizer.step()``. No host synchronisation; it consumes ``reduced`` (scaled in place where its
  dtype is the parameters'). Returns the norm.
- A pass whose loss or gradient is not finite puts its id in ``nonfinite`` (with ``pp > 1`` the loss on
  the last stage, and each stage's gradients of the schedule, which mix the ids of its column: all of
  them go to ``nonfinite`` on that stage); the step protocol reports it and the replica is fenced (its
  buffers, now not finite, are never reduced) or the job ends. Which pass it was: from the losses;
  on one process, a gradient that is not finite shows in the buffers (checked once per call) and is
  found by computing the call's microbatches again one by one (a fault path); a replica of several
  ranks keeps a finiteness flag per pass on the device.
- ``fingerprint()`` is an exact fingerprint of this rank's parameter shards.
- Data is read ahead (``data.prefetch`` steps, :mod:`recover.data.prefetch`): ``compute(step, ids)`` schedules
  this rank's microbatches of ``ids`` and its expected share of the coming steps (``upcoming``: the step
  protocol's plan; else the same ids) for one background thread, and each pass takes its batch from it,
  pinned when the device is a GPU; orphans and a changed plan are read when needed. The same pure
  function is read either way (bitwise the same batches). ``reads.take()`` tells how long the training
  thread waited for data since it was last asked (the step record's ``data_wait_ms``).
- With ``training.device_time_s`` every microbatch (pass) takes at least that wall time: an emulated
  dedicated device, for benchmarks and tests on shared CPU cores; the arithmetic is unchanged.
  An injected fault (``perturb``, :class:`~recover.faults.Perturbation`: the one hook, installed by the
  session) may stretch each pass's time or alter its gradients.
- With ``training.init_from`` (``--init-from``) the whole model is loaded from those weights right after
  it is built, on every rank, before the pipeline split, TP and FSDP (:mod:`recover.train.checkpoints.weights`):
  every replica starts from the same parameters, as with the seeded initialisation.
- In deterministic mode the buffers are float64: a sum of float32 microbatch gradients in float64 does
  not depend on who computed which id, so a step is bitwise reproducible. Each microbatch's gradient
  reaches the buffers on its own. A pipeline stage folds from a post-accumulate-grad hook on each
  parameter as each microbatch's backward inside the schedule accumulates it, and clears ``.grad`` (the
  schedule never sums two microbatches in float32; a padding pass adds exact zeros).
  In an FSDP replica FSDP2 reduce-scatters each pass's gradient over the shard columns in float64 and the
  pass's float64 shard is folded (:mod:`recover.parallel.exact`; the float32 ``.grad`` beside it is
  dropped): which ids met in a pass, and a zero-weight padding pass, change nothing (under a pipeline,
  FSDP2 accumulates the stage's passes in float64 and the hooks stand aside).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from recover.config import Config, ModelConfig, TrainingConfig
from recover.data.prefetch import Prefetcher
from recover.faults.perturb import NONE
from recover.faults.registry import GradientFn
from recover.model import build_model, lm_loss
from recover.names import Phase
from recover.parallel.apply import clean_name, parallelize
from recover.parallel.dims import AXES, Coord, MeshAxis, ParallelDims
from recover.parallel.exact import ExactShards
from recover.recovery.interfaces import Totals
from recover.train.checkpoints.weights import load_initial_weights
from recover.train.replicas.bits import MASK, bit_sum, flip_bit, to_host
from recover.train.replicas.optim import build_optimizer, lr_at, set_lr
from recover.train.replicas.update import apply_sum, read_totals
from recover.workload.policy import split_within_replica

if TYPE_CHECKING:
    from recover.parallel.pipeline import PipelineRunner
    from recover.train.replicas.dist import DistContext

Hook = Callable[[int, str], Any]  # (step, phase) -> fault injection point
Final = Callable[[int], None]  # final(i): gradient buffer i is complete (a streamed reduction may launch it)


def _no_hook(step: int, phase: str) -> None:
    return None


AUDIT_TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-3}
"""Relative difference of an audited gradient's norm tolerated outside deterministic mode, by compute
dtype: kernels that are not bitwise reproducible (atomics in attention backward, split-K matmuls) move a
norm by ~1e-7 relative in float32 and by up to ~1e-4 in bfloat16 (one bfloat16 unit is 2**-8 = 3.9e-3
per element, averaged over the tensor); a systematically wrong gradient of 2**-8 stays far above both."""


def audit_tolerance(dtype: str) -> float:
    return AUDIT_TOLERANCES.get(dtype, AUDIT_TOLERANCES["float32"])


class MicrobatchSource(Protocol):
    """What a replica needs from :class:`~recover.data.sampler.Sampler`: samples by (step, id)."""

    microbatch_size: int
    seq_len: int

    def microbatch(self, step: int, microbatch_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Replica:
    """This rank's share of one replica's model, optimizer, gradients and ledger.

    Args:
        model_cfg: the whole model.
        training: optimiser, seed, clipping and ``deterministic`` (float64 gradient buffers).
        data: microbatches by (step, id).
        dims: the replica's degrees (default: one process).
        mesh: the replica's mesh (:meth:`ParallelDims.build_mesh`); None for a one-process replica.
        group: a process group of all the replica's ranks with the intra-replica timeout (loss and
            grad-norm all-reduces, evaluation); None only for a one-process replica.
        device: where this rank computes.
        schedule: ``"1f1b"`` or ``"gpipe"`` when ``pp > 1``.
        activation_checkpointing: recompute each block in backward.
        sequence_parallel: sequence-parallel norms (tp > 1, pp = 1).
        prefetch: steps of look-ahead of the data reads (``data.prefetch``; 0: read when computed).

    Raises:
        ConfigError: the degrees do not fit the model or the mesh.
    """

    def __init__(self, model_cfg: ModelConfig, training: TrainingConfig, data: MicrobatchSource,
                 dims: ParallelDims | None = None, mesh: DeviceMesh | None = None,
                 group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 schedule: str = "1f1b", activation_checkpointing: bool = False,
                 sequence_parallel: bool = False, prefetch: int = 0) -> None:
        dims = dims or ParallelDims()
        dims.check_model(model_cfg)
        if dims.world > 1 and (mesh is None or group is None):
            raise ValueError(f"a replica of {dims.world} ranks needs its mesh and its process group")
        if mesh is not None:
            dims.check_world(mesh.size())
            if mesh.mesh_dim_names != tuple(a.value for a in AXES) or tuple(mesh.shape) != dims.shape:
                raise ValueError(f"mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} is not this replica's "
                                 f"(pp, fsdp, tp) = {dims.shape}; build it with ParallelDims.build_mesh")
        self.cfg, self.training, self.data = model_cfg, training, data
        self.dims, self.mesh, self.group = dims, mesh, group
        self.device = torch.device(device)
        self.coord = Coord(*mesh.get_coordinate()) if mesh is not None else Coord(0, 0, 0)
        self.reads = Prefetcher(data.microbatch, prefetch, self.device)
        self.upcoming: Callable[[int], list[int]] | None = None
        """This replica's expected ids of a coming step (set by the step protocol); None: those of the last call."""
        model = build_model(model_cfg, training.seed, self.device)  # whole model, same values on every rank
        if training.init_from:  # the same full tensors on every rank, before any split or shard
            load_initial_weights(model, training.init_from)
        if dims.pp > 1:
            from recover.parallel.pipeline import PipelineRunner, split_stage  # ~1 s import: only when used

            split_stage(model, dims, self.coord.pp)
        exact = training.deterministic and dims.fsdp > 1  # FSDP2 reduce-scatters in float64
        self.model = parallelize(model, dims, mesh, activation_checkpointing, sequence_parallel,
                                 training.compile_backend if training.compile else None, exact)
        self.optimizer = build_optimizer(self.model, training)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [clean_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.exact = ExactShards(self.model, self.params) if exact else None
        self.dtype = torch.float64 if training.deterministic else torch.float32
        self.buffers = [torch.zeros_like(local(p), dtype=self.dtype) for p in self.params]
        self.stats = torch.zeros(2, dtype=torch.float64, device=self.device)  # the replica's [loss_sum, count]
        self._copies = torch.tensor([float(self._copies_of(p)) for p in self.params], dtype=torch.float64,
                                    device=self.device)  # each shard of the whole gradient counted once
        self.pipe: PipelineRunner | None = None
        if dims.pp > 1:
            self.pipe = PipelineRunner(self.model, self.coord.pp, dims.pp, mesh[MeshAxis.PP.value].get_group(),
                                       self.device, model_cfg.dim, model_cfg.vocab_size, schedule)
        self.perturb = NONE  # injected faults (the session installs this process's)
        self.audit_id: int | None = None  # the audited microbatch of this step, if this replica owns it
        self.audit_value: dict[str, Any] | None = None  # its gradient's fingerprint, once computed
        self.nonfinite: list[int] = []  # ids of this step whose loss or gradient was not finite here
        self.ledger: list[int] = []
        self.losses: dict[int, float] = {}
        self.loss_sum = 0.0
        # evaluation of a replica of several ranks: its rank 0 gathers the stages into a plain copy
        self._eval_model = build_model(model_cfg, 0, self.device).eval() if self._evaluates_a_copy else None

    @classmethod
    def from_config(cls, cfg: Config, data: MicrobatchSource, ctx: DistContext) -> Replica:
        """This rank's part of a replica of ``pp x fsdp x tp`` ranks: the processes of ``ctx`` when
        there are several (a torchrun job per replica), else this process alone."""
        p, dims = cfg.parallel, ParallelDims.from_config(cfg.parallel)
        mesh = group = None
        if dims.world > 1:
            dims.check_world(ctx.world_size)
            timeout = cfg.fault_tolerance.intra_replica_timeout_s
            mesh = dims.build_mesh(ctx.device.type, timeout)
            group = dims.build_group(timeout)
        return cls(cfg.model, cfg.training, data, dims, mesh, group, ctx.device, p.schedule,
                   p.activation_checkpointing, p.sequence_parallel, cfg.data.prefetch)

    @property
    def owns_loss(self) -> bool:
        """Whether this rank reports the losses of its column (last stage, TP index 0)."""
        return self.coord.pp == self.dims.pp - 1 and self.coord.tp == 0

    @property
    def is_writer(self) -> bool:
        """The replica's rank 0: the one that writes its logs and checkpoint metadata."""
        return self.coord == Coord(0, 0, 0)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.data.microbatch_size * self.data.seq_len

    def _copies_of(self, p: torch.Tensor) -> int:
        """How many ranks of this pipeline stage hold the same values as this rank's shard of ``p``."""
        return self.dims.tp * self.dims.fsdp // shards(p)

    # ---- a step ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """(collective) One zero-weight forward and backward, folded into nothing: compiled blocks compile
        and a GPU's libraries and allocator warm up here, at start-up, not inside the first step (where a
        replacement replica would make every other replica wait on its compiler until the hang rule
        fences it). Leaves the buffers, ledger and gradients empty; needs no samples."""
        if self.pipe is not None:
            self._run_pipeline(0, [None], _no_hook)
        else:
            self._run_passes(0, [None], _no_hook, None)
        self.reset()

    def reset(self) -> None:
        """Starts a step: empty buffers and ledger."""
        for buf in self.buffers:
            buf.zero_()
        self.stats.zero_()
        self.ledger, self.losses, self.loss_sum = [], {}, 0.0
        self.nonfinite = []
        self.audit_id, self.audit_value = None, None

    @property
    def reduce_order(self) -> list[int]:
        """Payload indices in the order they become final: the gradient buffers in reverse parameter
        order (the order a backward completes them), then the stats."""
        return [*reversed(range(len(self.params))), len(self.params)]

    def compute(self, step: int, ids: list[int], hook: Hook = _no_hook, final: Final | None = None) -> None:
        """(collective) Forward and backward of the replica's microbatches ``ids`` of ``step``.

        ``hook(step, phase)`` runs before each forward and each backward (fault injection points);
        ``final(i)`` is told when gradient buffer ``i`` is complete for this call (see the module docstring).
        """
        ids = [int(i) for i in ids]
        if ids:
            self._read_ahead(step, ids)
            column = split_within_replica(ids, self.dims.fsdp)[self.coord.fsdp]
            if self.pipe is not None:
                mine = self._run_pipeline(step, column, hook)
            else:
                mine = self._run_passes(step, column, hook, final if self.alone else None)
            self._record(ids, mine)
        if final is not None:
            for i in range(len(self.buffers)):
                final(i)  # a no-op for those the last backward already finalised

    @property
    def alone(self) -> bool:
        """A one-process replica: its gradients are plain tensors and each pass's are its own. Only such a
        replica folds its last pass from autograd hooks (DTensor gradients of sharded layouts are folded
        after the backward), finds a non-finite gradient in its buffers, and audits."""
        return self.group is None and self.pipe is None

    def _read_ahead(self, step: int, ids: list[int]) -> None:
        """Schedules the background reads of this rank's microbatches of ``ids`` and of its expected share of
        the next ``reads.steps`` steps: ``upcoming``'s, else the ids of the step's first call (its share: the
        steady-state plan; not orphans)."""
        self.reads.ahead(step, self._reads_of(ids))
        if self.upcoming is None and self.ledger:
            return
        for coming in range(step + 1, step + 1 + self.reads.steps):
            self.reads.ahead(coming, self._reads_of(self.upcoming(coming) if self.upcoming else ids))

    def _reads_of(self, ids: list[int]) -> list[int]:
        """The microbatches of ``ids`` this rank reads: its FSDP column's, on a pipeline's first and last stages."""
        if self.pipe is not None and not (self.pipe.is_first or self.pipe.is_last):
            return []
        return [mb for mb in split_within_replica(ids, self.dims.fsdp)[self.coord.fsdp] if mb is not None]

    def _batch(self, step: int, mb: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch ``mb`` of ``step`` on this rank's device (read ahead, pinned: asynchronous copies to a GPU)."""
        if mb is None:  # zero-weight padding pass: any valid tokens will do
            zeros = torch.zeros(self.data.microbatch_size, self.data.seq_len, dtype=torch.long, device=self.device)
            return zeros, zeros
        inputs, targets = self.reads.get(step, mb)
        cuda = self.device.type == "cuda"
        return inputs.to(self.device, non_blocking=cuda), targets.to(self.device, non_blocking=cuda)

    def _run_passes(self, step: int, column: list[int | None], hook: Hook, final: Final | None) -> dict[int, float]:
        checks: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (id, loss, gradient finite) on the device
        yes = torch.ones((), dtype=torch.bool, device=self.device)
        for k, mb in enumerate(column):
            t0 = time.perf_counter()
            inputs, targets = self._batch(step, mb)
            hook(step, Phase.FORWARD)
            with self.compute_dtype():
                loss = lm_loss(self.model(inputs), targets)  # mean over B x T
            hook(step, Phase.BACKWARD)
            streamed = final is not None and k == len(column) - 1 and mb is not None and mb != self.audit_id
            handles = self._fold_as_final(step, mb, final) if streamed else []
            try:
                (loss if mb is not None else loss * 0.0).backward()
            finally:
                for h in handles:
                    h.remove()
            finite = yes
            if not streamed:
                self._inject(step, mb)
                if mb is not None and mb == self.audit_id:
                    self.audit_value = self._gradient_fingerprint()
                if not self.alone:
                    finite = self._gradient_finite()
                self._fold()
            if mb is not None:
                checks.append((mb, loss.detach().float(), finite))
            self._emulate_device(t0, 1)
        if not checks:
            return {}
        losses = torch.stack([loss for _, loss, _ in checks])
        finite = torch.stack([ok for _, _, ok in checks]) & losses.isfinite()
        buffers = self._buffers_finite() if self.alone else yes
        values, oks, (buffers_ok,) = to_host(losses.double(), finite, buffers)  # the one host sync of the call
        bad = [mb for (mb, _, _), ok in zip(checks, oks, strict=True) if not ok]
        if not bad and not buffers_ok:
            bad = self._find_nonfinite(step, [mb for mb, _, _ in checks])
        self.nonfinite += bad
        return {mb: v for (mb, _, _), v in zip(checks, values, strict=True) if mb not in bad}

    def _fold_as_final(self, step: int, mb: int, final: Final) -> list[Any]:
        """Autograd hooks that fold each parameter's gradient into its buffer as soon as the backward has
        accumulated it, then call ``final`` (the streamed reduction launches the buckets that are ready)."""
        perturb = self.perturb.gradient(step, mb)

        def fold(i: int) -> Callable[[torch.Tensor], None]:
            @torch.no_grad()
            def hook(p: torch.Tensor) -> None:
                if p.grad is None:
                    return
                if perturb is not None:
                    perturb(p.grad)
                self.buffers[i].add_(p.grad.to(self.dtype))
                p.grad = None
                final(i)
            return hook

        return [p.register_post_accumulate_grad_hook(fold(i)) for i, p in enumerate(self.params)]

    def _inject(self, step: int, mb: int | None) -> None:
        """Injected faults on the gradients of the pass just run (``perturb``)."""
        perturb: GradientFn | None = self.perturb.gradient(step, mb)
        if perturb is None:
            return
        with torch.no_grad():
            for g in self._local_grads():
                perturb(g)

    @property
    def audits(self) -> bool:
        """Whether this replica can audit (a microbatch's gradient is its own, unmixed: :attr:`alone`)."""
        return self.alone

    def audit(self, step: int, mb: int) -> dict[str, Any]:
        """(local) Computes microbatch ``mb`` of ``step`` a second time, on its own, for the audit: the
        fingerprint and norm of its gradient (see :meth:`_gradient_fingerprint`). Nothing is folded
        into the buffers or the ledger."""
        t0 = time.perf_counter()
        inputs, targets = self._batch(step, mb)
        with self.compute_dtype():
            loss = lm_loss(self.model(inputs), targets)
        loss.backward()
        self._inject(step, None)
        value = self._gradient_fingerprint()
        for p in self.params:
            p.grad = None
        self._emulate_device(t0, 1)
        return value

    @torch.no_grad()
    def _gradient_fingerprint(self) -> dict[str, Any]:
        """The gradient of the pass just run: its exact fingerprint (as :meth:`fingerprint`), its L2 norm,
        and ``exact`` (deterministic mode: compare fingerprints; otherwise norms, within a tolerance)."""
        grads = [local(p.grad.detach()) for p in self.params if p.grad is not None]
        norm = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).norm()
        (fp,), (value,) = to_host(bit_sum(grads, self.device), norm)
        return {"fp": f"{fp & MASK:016x}", "norm": value, "exact": self.training.deterministic,
                "tol": audit_tolerance(self.training.dtype)}

    @torch.no_grad()
    def _buffers_finite(self) -> torch.Tensor:
        """Whether every element of the gradient buffers is finite: a boolean on the device (one read of
        the buffers). A sum that holds a non-finite gradient is not finite (NaN and infinities survive
        addition)."""
        return torch.stack(torch._foreach_norm(self.buffers)).sum().isfinite()

    @torch.no_grad()
    def _gradient_finite(self) -> torch.Tensor:
        """Whether every element of this rank's gradients of the pass just run is finite: a boolean on the
        device (one read of the gradients, no host synchronisation)."""
        grads = self._local_grads()
        if not grads:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack(torch._foreach_norm(grads)).sum().isfinite()

    def _find_nonfinite(self, step: int, ids: list[int]) -> list[int]:
        """The ids among ``ids`` whose gradient is not finite, each computed again on its own (the
        fault path; nothing is folded)."""
        bad = []
        for mb in ids:
            inputs, targets = self._batch(step, mb)
            with self.compute_dtype():
                lm_loss(self.model(inputs), targets).backward()
            self._inject(step, mb)
            if not self._gradient_finite().item():
                bad.append(mb)
            for p in self.params:
                p.grad = None
        return bad

    def compute_dtype(self) -> AbstractContextManager[Any]:
        """Autocast to bfloat16 when ``training.dtype`` says so (parameters and gradients stay float32)."""
        if self.training.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _emulate_device(self, t0: float, microbatches: int) -> None:
        """With ``training.device_time_s``, sleeps until ``microbatches`` x that time has passed since ``t0``;
        under an injected time factor s, until s times that time (or s times the real compute, if longer)."""
        elapsed = time.perf_counter() - t0
        left = max(self.training.device_time_s * microbatches, elapsed) * self.perturb.time_factor() - elapsed
        if left > 0:
            time.sleep(left)

    def _run_pipeline(self, step: int, column: list[int | None], hook: Hook) -> dict[int, float]:
        assert self.pipe is not None
        B, T, n = self.data.microbatch_size, self.data.seq_len, len(column)
        t0 = time.perf_counter()
        inputs = targets = None
        if self.pipe.is_first or self.pipe.is_last:
            batches = [self._batch(step, mb) for mb in column]
            inputs = torch.cat([x for x, _ in batches])  # (n*B, T)
            targets = torch.cat([y for _, y in batches])
        hook(step, Phase.FORWARD)
        with self.compute_dtype(), self._folding_each_backward():
            by_position = self.pipe.run(n, B, T, inputs, targets, [0.0 if mb is None else 1.0 for mb in column])
        hook(step, Phase.BACKWARD)
        grads_finite = self._stage_gradients(step, column)
        self._fold()  # deterministic without FSDP: the hooks left nothing in .grad
        self._emulate_device(t0, n)
        losses = {column[k]: v for k, v in by_position.items() if column[k] is not None}
        if grads_finite:
            self.nonfinite += [mb for mb, v in losses.items() if not math.isfinite(v)]  # the last stage sees it
        else:  # one schedule mixed the column's gradients: every one of its ids is suspect on this stage
            self.nonfinite += [mb for mb in column if mb is not None and mb not in self.nonfinite]
        return losses

    @torch.no_grad()
    def _stage_gradients(self, step: int, column: list[int | None]) -> bool:
        """A pipeline stage's gradients of the schedule just run: the injected faults of its microbatches
        applied (``perturb``), then whether they are finite on this stage (one host read per call). They
        are the ``.grad`` the schedule summed, or, where each backward was folded as it came
        (deterministic mode), the buffers themselves."""
        grads = self._local_grads() or list(self.buffers)
        for mb in column:
            perturb = self.perturb.gradient(step, mb) if mb is not None else None
            if perturb is not None:
                for g in grads:
                    perturb(g)
        if not grads:
            return True
        return bool(torch.stack(torch._foreach_norm(grads)).sum().isfinite().item())

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradients of the pass just run, as they are folded: each ``.grad``'s local shard, or
        in deterministic FSDP replicas the float64 sums over the shard ranks (:mod:`recover.parallel.exact`)."""
        if self.exact is not None:
            return [g for g in self.exact.gradients() if g is not None]
        return [local(p.grad) for p in self.params if p.grad is not None]

    @torch.no_grad()
    def _fold(self) -> None:
        """Adds this rank's local gradients into the buffers and clears ``.grad``."""
        if self.exact is not None:
            self._fold_exact()
            return
        for buf, p in zip(self.buffers, self.params, strict=True):
            fold_grad(buf, p)

    def _folding_each_backward(self) -> AbstractContextManager[Any]:
        """In deterministic mode, a context in which each backward's gradient of a parameter goes into its
        buffer on its own, as autograd accumulates it (a post-accumulate-grad hook folds ``.grad`` and clears
        it, so the next microbatch's backward starts from nothing): a pipeline stage's buffers are then the
        float64 sum of per-microbatch gradients, whichever microbatches shared its schedule and in what order.
        Otherwise, and under FSDP (whose reduce-scatter sets ``.grad``; :mod:`recover.parallel.exact`), nothing:
        the schedule sums in ``.grad`` and :meth:`_fold` folds once."""
        if not self.training.deterministic or self.exact is not None:  # PP x FSDP: FSDP2 sums in float64
            return nullcontext()
        hooks = ExitStack()
        for buf, p in zip(self.buffers, self.params, strict=True):
            hooks.callback(p.register_post_accumulate_grad_hook(partial(fold_grad, buf)).remove)
        return hooks

    def _fold_exact(self) -> None:
        """Deterministic FSDP: adds the pass's float64 shard sums (:class:`~recover.parallel.exact.ExactShards`)."""
        assert self.exact is not None
        for buf, g in zip(self.buffers, self.exact.gradients(), strict=True):
            if g is not None:
                buf.add_(g)
        self.exact.clear()
        for p in self.params:
            p.grad = None

    def _record(self, ids: list[int], mine: dict[int, float]) -> None:
        """Shares per-id losses over the replica (one owner per id) and extends the ledger. The stats
        are filled from host values (a fill, not a pageable copy: no synchronisation)."""
        values = [mine.get(mb, 0.0) if self.owns_loss else 0.0 for mb in ids]
        if self.group is not None:  # every rank learns every id's loss: one all-reduce on the device
            shared = torch.tensor(values, dtype=torch.float64, device="cpu")
            shared = shared.pin_memory() if self.device.type == "cuda" else shared
            shared = shared.to(self.device, non_blocking=True)
            dist.all_reduce(shared, group=self.group)
            (values,) = to_host(shared)
        self.losses.update(zip(ids, values, strict=True))
        self.loss_sum += sum(values)
        self.ledger.extend(ids)
        self.stats[0].fill_(self.loss_sum)
        self.stats[1].fill_(float(len(self.ledger)))

    def payload(self) -> list[torch.Tensor]:
        """This rank's gradient buffers, then the replica's float64 ``[loss_sum, count]``."""
        return [*self.buffers, self.stats]

    def totals(self, reduced: list[torch.Tensor], fingerprint: bool = False) -> Totals:
        """(collective) What the reduced payload holds (see the module docstring), in one host read."""
        return read_totals(reduced, len(self.params), self._copies, self._fingerprint() if fingerprint else None,
                           self.group)

    def apply(self, reduced: list[torch.Tensor], divisor: int, step: int, sum_norm: float) -> float:
        """(collective) The optimizer update of ``step`` from the reduced gradient sum (consumed: scaled in
        place where it has the parameters' dtype) and its norm ``sum_norm`` (:meth:`totals`); returns the
        step's gradient norm. No host synchronisation."""
        set_lr(self.optimizer, lr_at(step, self.training))
        return apply_sum(self.optimizer, self.params, reduced, divisor, sum_norm, self.training.grad_clip, like)

    # ---- integrity -----------------------------------------------------------------------------
    @torch.no_grad()
    def fingerprint(self) -> str:
        """(local) An exact fingerprint of this rank's parameter shards, computed where they live
        (:func:`~recover.train.replicas.bits.bit_sum`): any single changed bit changes it. One read of the
        parameters; 16 hex digits."""
        ((total,),) = to_host(self._fingerprint())
        return f"{total & MASK:016x}"

    def _fingerprint(self) -> torch.Tensor:
        return bit_sum([local(p.detach()) for p in self.params], self.device)

    def corrupt(self) -> None:
        """Fault injection (``--corrupt``): one bit of one element of this rank's first parameter shard
        flips in memory, as silent data corruption would (nothing else notices)."""
        flip_bit(local(self.params[0]))

    # ---- evaluation ----------------------------------------------------------------------------
    @property
    def _evaluates_a_copy(self) -> bool:
        return self.group is not None and self.coord == Coord(0, 0, 0)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """(collective) Mean loss of ``batches`` under the replica's current parameters (same on every rank).

        A one-process replica evaluates its model in place. In a replica of several ranks the stages'
        whole parameters are gathered on its rank 0, which evaluates a plain copy of the whole model;
        the gather is over the intra-replica group, so it is bounded by its timeout.
        """
        if self.group is None:
            return self._mean_loss(self.model, batches)
        params = self.full_parameters()
        mine = params if self.coord.fsdp == 0 and self.coord.tp == 0 else {}
        root = dist.get_global_rank(self.group, 0)
        leader = dist.get_rank() == root
        gathered: list[Any] = [None] * self.dims.world if leader else []
        dist.gather_object(mine, gathered if leader else None, dst=root, group=self.group)
        value = torch.zeros(1, dtype=torch.float64, device=self.device)  # the group may have no CPU backend
        if leader:
            assert self._eval_model is not None
            whole: dict[str, torch.Tensor] = {}
            for part in gathered:
                whole.update(part or {})
            for name, p in self._eval_model.named_parameters():
                p.copy_(whole[name])
            value[0] = self._mean_loss(self._eval_model, batches)
        dist.all_reduce(value, group=self.group)  # only rank 0 holds a value: a broadcast
        return float(value.item())

    def agreed(self, value: float) -> float:
        """(collective in a replica of several ranks) ``value`` as the replica's rank 0 has it, on every rank:
        a decision every rank must take alike from measurements that differ per rank."""
        if self.group is None:
            return value
        mine = value if dist.get_rank() == dist.get_global_rank(self.group, 0) else 0.0
        shared = torch.tensor([mine], dtype=torch.float64, device=self.device)  # the group may have no CPU backend
        dist.all_reduce(shared, group=self.group)  # only rank 0 holds a value: a broadcast
        return float(shared.item())

    def _mean_loss(self, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        was_training = model.training
        model.eval()
        with self.compute_dtype():
            losses = [float(lm_loss(model(x.to(self.device)), y.to(self.device))) for x, y in batches]
        model.train(was_training)
        return sum(losses) / len(losses)

    # ---- state ---------------------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """(collective) This stage's parameters as whole tensors, keyed by the whole model's names."""
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in zip(self.names, self.params, strict=True)}

    def transfer_state(self, counters: dict[str, int]) -> dict[str, torch.Tensor]:
        """This rank's parameter shards, optimizer state and ``counters`` as plain tensors, for a joiner
        (the same replica-local rank of an identically built replica takes them with :meth:`load_transfer_state`).
        Tensors only, in a deterministic order: no pickling over the network."""
        return transfer_tensors(self.names, self.params, self.optimizer, counters)

    def load_transfer_state(self, state: dict[str, torch.Tensor]) -> dict[str, int]:
        """Inverse of :meth:`transfer_state`; returns the counters.

        Raises:
            ValueError: ``state`` lacks parameters of this replica (built from another config).
        """
        return load_transferred(self.names, self.params, self.optimizer, state)


@torch.no_grad()
def fold_grad(buf: torch.Tensor, p: torch.Tensor) -> None:
    """Adds ``p``'s local gradient (if any) into ``buf`` in ``buf``'s dtype and clears ``p.grad``."""
    g = p.grad
    if g is None:
        return
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)  # e.g. a pending partial sum
    buf.add_(local(g).to(buf.dtype))
    p.grad = None


def shards(p: torch.Tensor) -> int:
    """Into how many distinct pieces ``p`` is cut over its mesh (1: every rank holds all of it)."""
    pieces = 1
    if isinstance(p, DTensor):
        for i, placement in enumerate(p.placements):
            if not placement.is_replicate():  # Shard and FSDP-over-TP's _StridedShard (not is_shard())
                pieces *= p.device_mesh.size(i)
    return pieces


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a local shard of ``p``'s shape) as a tensor of ``p``'s kind (DTensor with its layout)."""
    if isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return t


def transfer_tensors(names: list[str], tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                     counters: dict[str, int]) -> dict[str, torch.Tensor]:
    """``tensors`` (this rank's shards), their optimizer state and ``counters`` as plain tensors keyed by name,
    in a deterministic order (see :meth:`Replica.transfer_state`)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, tensors, strict=True):
        out[f"model.{name}"] = local(p.detach())
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out[f"optim.{name}.{key}"] = local(value) if torch.is_tensor(value) else torch.tensor(value)
    for key, value in sorted(counters.items()):
        out[f"counter.{key}"] = torch.tensor(int(value), dtype=torch.int64)
    return out


@torch.no_grad()
def load_transferred(names: list[str], tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                     state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Inverse of :func:`transfer_tensors`: copies the values into ``tensors``, puts the optimizer state where
    the optimizer keeps it (:func:`_state_value`); returns the counters. Raises ValueError: a tensor is missing."""
    missing = [n for n in names if f"model.{n}" not in state]
    if missing:
        raise ValueError(f"transferred state lacks parameters {missing[:3]} ({len(missing)} missing)")
    on_device = {id(p): bool(g.get("fused") or g.get("capturable"))
                 for g in optimizer.param_groups for p in g["params"]}
    for name, p in zip(names, tensors, strict=True):
        local(p).copy_(state[f"model.{name}"])
        prefix = f"optim.{name}."
        moments = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if moments:  # moments are shaped like the parameter; AdamW's "step" is a scalar
            optimizer.state[p] = {k: _state_value(p, v, on_device.get(id(p), False)) for k, v in moments.items()}
    return {k[len("counter."):]: int(v) for k, v in state.items() if k.startswith("counter.")}


def _state_value(p: torch.Tensor, v: torch.Tensor, scalars_on_device: bool) -> torch.Tensor:
    """A transferred optimizer state tensor where the optimizer keeps it (the payload lives on the group's
    device, the CPU over gloo): moments on the parameter's device, as its kind (DTensor); a scalar ("step")
    on the device for fused or capturable AdamW, else on the CPU."""
    if v.dim():
        return like(p, v.to(local(p).device, copy=True))
    return v.to(local(p).device if scalars_on_device else "cpu", copy=True)
