"""One rank of a replica: forward/backward of the replica's microbatches under PP x FSDP x TP.

The engine is a drop-in for :class:`~recover.recovery.accumulator.GradAccumulator` (same
``reset``/``payload``/``apply``/``ledger``, ``GradAccumulator.totals`` reads its payload) plus a
``compute(step, ids, sampler)`` that the recovery loop calls with the replica's ids.

Contract (every method marked *collective* must be called by every rank of the replica, in the
same order, with the same arguments; the intra-replica groups have a bounded timeout, so a dead
peer surfaces as an exception within it, and the caller must then treat the whole replica as lost):

- ``compute(step, ids, sampler)`` (collective): the replica runs exactly ``ids``. FSDP shard
  column ``f`` takes block ``f`` of ``split_within_replica(ids, fsdp)``, padded with zero-weight
  passes so every rank runs the same number; with ``pp > 1`` the column's microbatches go
  through one pipeline schedule. Afterwards this rank's buffers hold its LOCAL part (TP shard,
  FSDP shard, pipeline stage) of ``sum over ids of d(mean loss of id)/d(params)``, the ledger holds
  ``ids`` and ``losses``/``loss_sum`` the replica's per-id mean losses (all ranks agree). It may be
  called several times in a step (orphans after a failure); ``reset()`` starts a step. An empty
  ``ids`` is a no-op on every rank (a replica with quota 0 still reduces a zero payload).
- ``payload()`` (local): this rank's gradient buffers, in ``model.parameters()`` order, then a
  float64 ``[loss_sum, count]`` of the WHOLE replica (equal on every rank of the replica). Sum it
  with the payloads of the SAME replica-local rank of the other replicas (one cross-replica group
  per replica-local rank): every such sum then holds the global gradient shard and ``[sum, M]``.
- ``apply(reduced, M, optimizer, clip)`` (collective): ``grad = reduced / M`` on the local shards,
  clipped by the global norm over the whole replica (squared norms all-reduced over the replica
  group, each shard counted once), then ``optimizer.step()``. Returns that norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from recover.config import ModelConfig
from recover.model import build_model, lm_loss
from recover.parallel.apply import clean_name, parallelize
from recover.parallel.dims import AXES, Coord, MeshAxis, ParallelDims
from recover.workload.policy import split_within_replica

if TYPE_CHECKING:
    from recover.parallel.pipeline import PipelineRunner

Hook = Callable[[int, str], Any]  # (step, phase) -> fault injection point


class MicrobatchSource(Protocol):
    """What the engine needs from :class:`~recover.data.sampler.Sampler`."""

    microbatch_size: int
    seq_len: int

    def microbatch(self, step: int, microbatch_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


class ReplicaEngine:
    """This rank's share of one replica's model, gradients and ledger.

    Args:
        model_cfg: the whole model.
        seed: initialisation seed (every rank builds the same whole-model values, then keeps its part).
        dims: the replica's degrees.
        mesh: the replica's mesh (:meth:`ParallelDims.build_mesh`); None for a one-process replica.
        group: a process group of all the replica's ranks with the intra-replica timeout (loss and
            grad-norm all-reduces); None only for a one-process replica.
        device: where this rank computes.
        deterministic: float64 gradient buffers (see the accumulator); exact order-independence
            holds per rank's own passes, not inside FSDP reduce-scatters or pipeline chunks.
        schedule: ``"1f1b"`` or ``"gpipe"`` when ``pp > 1``.
        activation_checkpointing: recompute each block in backward.
        sequence_parallel: sequence-parallel norms (tp > 1, pp = 1).

    Raises:
        ConfigError: the degrees do not fit the model or the mesh.
    """

    def __init__(self, model_cfg: ModelConfig, seed: int, dims: ParallelDims, mesh: DeviceMesh | None,
                 group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 deterministic: bool = False, schedule: str = "1f1b", activation_checkpointing: bool = False,
                 sequence_parallel: bool = False) -> None:
        dims.check_model(model_cfg)
        if dims.world > 1 and (mesh is None or group is None):
            raise ValueError(f"a replica of {dims.world} ranks needs its mesh and its process group")
        if mesh is not None:
            dims.check_world(mesh.size())
            if mesh.mesh_dim_names != tuple(a.value for a in AXES) or tuple(mesh.shape) != dims.shape:
                raise ValueError(f"mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} is not this replica's "
                                 f"(pp, fsdp, tp) = {dims.shape}; build it with ParallelDims.build_mesh")
        self.cfg, self.dims, self.mesh, self.group = model_cfg, dims, mesh, group
        self.device = torch.device(device)
        self.coord = Coord(*mesh.get_coordinate()) if mesh is not None else Coord(0, 0, 0)
        model = build_model(model_cfg, seed, self.device)  # whole model, same values on every rank
        if dims.pp > 1:
            from recover.parallel.pipeline import PipelineRunner, split_stage  # ~1 s import: only when used

            split_stage(model, dims, self.coord.pp)
        self.model = parallelize(model, dims, mesh, activation_checkpointing, sequence_parallel)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [clean_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.dtype = torch.float64 if deterministic else torch.float32
        self.buffers = [torch.zeros_like(local(p), dtype=self.dtype) for p in self.params]
        self._copies = [self._copies_of(p) for p in self.params]
        self.pipe: PipelineRunner | None = None
        if dims.pp > 1:
            self.pipe = PipelineRunner(self.model, self.coord.pp, dims.pp, mesh[MeshAxis.PP.value].get_group(),
                                       self.device, model_cfg.dim, model_cfg.vocab_size, schedule)
        self.ledger: list[int] = []
        self.losses: dict[int, float] = {}
        self.loss_sum = 0.0
        self._eval_model: torch.nn.Module | None = None  # the whole model, built on first evaluate (rank 0)

    @property
    def owns_loss(self) -> bool:
        """Whether this rank reports the losses of its column (last stage, TP index 0)."""
        return self.coord.pp == self.dims.pp - 1 and self.coord.tp == 0

    def _copies_of(self, p: torch.Tensor) -> int:
        """How many ranks of this pipeline stage hold the same values as this rank's shard of ``p``."""
        shards = 1
        if isinstance(p, DTensor):
            for i, placement in enumerate(p.placements):
                if not placement.is_replicate():  # Shard and FSDP-over-TP's _StridedShard (not is_shard())
                    shards *= p.device_mesh.size(i)
        return self.dims.tp * self.dims.fsdp // shards

    # ---- a step ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Starts a step: empty buffers and ledger."""
        for buf in self.buffers:
            buf.zero_()
        self.ledger, self.losses, self.loss_sum = [], {}, 0.0

    def compute(self, step: int, ids: list[int], sampler: MicrobatchSource, hook: Hook | None = None) -> None:
        """(collective) Forward and backward of the replica's microbatches ``ids`` of ``step``."""
        ids = [int(i) for i in ids]
        if not ids:
            return
        column = split_within_replica(ids, self.dims.fsdp)[self.coord.fsdp]
        if self.pipe is not None:
            mine = self._run_pipeline(step, column, sampler, hook)
        else:
            mine = self._run_passes(step, column, sampler, hook)
        self._record(ids, mine)

    def _batch(self, step: int, mb: int | None, sampler: MicrobatchSource) -> tuple[torch.Tensor, torch.Tensor]:
        if mb is None:  # zero-weight padding pass: any valid tokens will do
            zeros = torch.zeros(sampler.microbatch_size, sampler.seq_len, dtype=torch.long)
            return zeros, zeros
        return sampler.microbatch(step, mb)

    def _run_passes(self, step: int, column: list[int | None], sampler: MicrobatchSource,
                    hook: Hook | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for mb in column:
            inputs, targets = self._batch(step, mb, sampler)
            if hook:
                hook(step, "forward")
            loss = lm_loss(self.model(inputs.to(self.device)), targets.to(self.device))  # mean over B x T
            if hook:
                hook(step, "backward")
            (loss if mb is not None else loss * 0.0).backward()
            self._fold()
            if mb is not None:
                out[mb] = float(loss.detach())
        return out

    def _run_pipeline(self, step: int, column: list[int | None], sampler: MicrobatchSource,
                      hook: Hook | None) -> dict[int, float]:
        assert self.pipe is not None
        B, T, n = sampler.microbatch_size, sampler.seq_len, len(column)
        inputs = targets = None
        if self.pipe.is_first or self.pipe.is_last:
            batches = [self._batch(step, mb, sampler) for mb in column]
            inputs = torch.cat([x for x, _ in batches])  # (n*B, T)
            targets = torch.cat([y for _, y in batches])
        if hook:
            hook(step, "forward")
        by_position = self.pipe.run(n, B, T, inputs, targets, [0.0 if mb is None else 1.0 for mb in column])
        if hook:
            hook(step, "backward")
        self._fold()
        return {column[k]: v for k, v in by_position.items() if column[k] is not None}

    @torch.no_grad()
    def _fold(self) -> None:
        """Adds this rank's local gradients into the buffers and clears ``.grad``."""
        for buf, p in zip(self.buffers, self.params, strict=True):
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor) and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)  # e.g. a pending partial sum
            buf.add_(local(g).to(self.dtype))
            p.grad = None

    def _record(self, ids: list[int], mine: dict[int, float]) -> None:
        """Shares per-id losses over the replica (one owner per id) and extends the ledger."""
        values = torch.zeros(len(ids), dtype=torch.float64)
        if self.owns_loss:
            for k, mb in enumerate(ids):
                if mb in mine:
                    values[k] = mine[mb]
        if self.group is not None:
            dist.all_reduce(values, group=self.group)
        for mb, v in zip(ids, values.tolist(), strict=True):
            self.losses[mb] = v
        self.loss_sum += float(values.sum())
        self.ledger.extend(ids)

    # ---- the cross-replica interface -----------------------------------------------------------
    def payload(self) -> list[torch.Tensor]:
        """This rank's gradient buffers, then the replica's float64 ``[loss_sum, count]``."""
        stats = torch.tensor([self.loss_sum, float(len(self.ledger))], dtype=torch.float64,
                             device=self.buffers[0].device if self.buffers else "cpu")
        return [*self.buffers, stats]

    def global_norm(self, grads: list[torch.Tensor]) -> float:
        """(collective) The L2 norm of the replica's whole gradient from each rank's local shards."""
        sq = torch.zeros(1, dtype=torch.float64)
        for g, copies in zip(grads, self._copies, strict=True):
            sq += g.double().pow(2).sum().cpu() / copies
        if self.group is not None:
            dist.all_reduce(sq, group=self.group)
        return math.sqrt(float(sq))

    def apply(self, reduced: list[torch.Tensor], M: int, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
        """(collective) grad = reduced / M on the local shards, clip by the global norm, step; returns the norm."""
        grads = [(g / M).to(p.dtype) for g, p in zip(reduced[: len(self.params)], self.params, strict=True)]
        norm = self.global_norm(grads)
        if grad_clip > 0:
            coef = min(1.0, grad_clip / (norm + 1e-6))
            if coef < 1.0:
                grads = [g * coef for g in grads]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = self._like(p, g)
        optimizer.step()
        for p in self.params:
            p.grad = None
        return norm

    @staticmethod
    def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a local shard of ``p``'s shape) as a tensor of ``p``'s kind (DTensor with its layout)."""
        if isinstance(p, DTensor):
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return t

    # ---- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """(collective) Mean loss of ``batches`` under the replica's current parameters (same on every rank).

        The stages' whole parameters are gathered on the replica's rank 0, which evaluates a plain
        copy of the whole model (built once). Meant for the small periodic validation of a run;
        the gather is over the intra-replica group, so it is bounded by its timeout.
        """
        params = self.full_parameters()
        mine = params if self.coord.fsdp == 0 and self.coord.tp == 0 else {}
        value = torch.zeros(1, dtype=torch.float64)
        if self.group is None:
            gathered: list[Any] = [mine]
        else:
            root = dist.get_global_rank(self.group, 0)
            leader = dist.get_rank() == root
            gathered = [None] * self.dims.world if leader else []
            dist.gather_object(mine, gathered if leader else None, dst=root, group=self.group)
        if gathered:
            whole: dict[str, torch.Tensor] = {}
            for part in gathered:
                whole.update(part or {})
            if self._eval_model is None:
                self._eval_model = build_model(self.cfg, 0, self.device).eval()
            for name, p in self._eval_model.named_parameters():
                p.copy_(whole[name])
            losses = [float(lm_loss(self._eval_model(x.to(self.device)), y.to(self.device))) for x, y in batches]
            value[0] = sum(losses) / len(losses)
        if self.group is not None:
            dist.all_reduce(value, group=self.group)  # only rank 0 holds a value: a broadcast
        return float(value)

    # ---- state ---------------------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """(collective) This stage's parameters as whole tensors, keyed by the whole model's names."""
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in zip(self.names, self.params, strict=True)}

    def local_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This rank's parameter shards and optimizer state as plain tensors (for a same-rank transfer)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in zip(self.names, self.params, strict=True):
            out[f"model.{name}"] = local(p.detach())
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                out[f"optim.{name}.{key}"] = local(value) if torch.is_tensor(value) else torch.tensor(value)
        return out

    @torch.no_grad()
    def load_local_state(self, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`local_state` on the same replica-local rank of an identically built replica."""
        for name, p in zip(self.names, self.params, strict=True):
            local(p).copy_(state[f"model.{name}"])
            prefix = f"optim.{name}."
            moments = {k[len(prefix):]: v.clone() for k, v in state.items()
                       if k.startswith(prefix) and "." not in k[len(prefix):]}
            if moments:  # moments are shaped like the parameter; AdamW's "step" is a scalar
                optimizer.state[p] = {k: self._like(p, v) if v.dim() else v for k, v in moments.items()}
