"""The inside of one replica: its (pp, fsdp, tp) rank grid, named mesh axes and a bounded mesh.

Contract:
- A replica is ``P = pp * fsdp * tp`` processes. Replica-local rank ``r`` sits at
  ``arange(P).view(pp, fsdp, tp)[s, f, t] == r``: tensor-parallel peers are adjacent ranks (the
  fastest links), pipeline stages are outermost. :meth:`ParallelDims.rank_grid`,
  :meth:`ParallelDims.coords` and :meth:`ParallelDims.groups` are plain arithmetic, checkable
  without a process group.
- The cross-replica data-parallel axis is NOT a mesh axis: layer 1 owns it (it must survive the
  loss of a replica; a DeviceMesh group cannot).
- :class:`ParallelDims` is validated once, at construction (sizes), and against the replica's
  process count and the model by :meth:`check_world` / :meth:`check_model` (the latter is
  :func:`recover.config.check_layout`, the rules a :class:`~recover.config.Config` already
  passed); every problem is a :class:`~recover.errors.ConfigError` naming the field, the value
  and the fix.
- :meth:`ParallelDims.build_mesh` gives every group of the mesh the intra-replica timeout, so a
  rank whose peer died never waits longer than that in a TP collective or a pipeline send.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from recover.config import ModelConfig, ParallelConfig, check_layout
from recover.errors import ConfigError


class MeshAxis(str, Enum):
    """Named axes of a replica's mesh, outermost first."""

    PP = "pp"
    FSDP = "fsdp"
    TP = "tp"


AXES: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.FSDP, MeshAxis.TP)


class Coord(NamedTuple):
    """Where a replica-local rank sits: pipeline stage, FSDP shard index, TP index."""

    pp: int
    fsdp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline, FSDP-shard and tensor-parallel degrees inside one replica."""

    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel degree (heads and MLP columns split over this many ranks)."""
    fsdp: int = 1
    """FSDP2 shard degree; each shard rank runs its own microbatches (HSDP across replicas)."""

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis.value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{axis.value} = {value!r} is not allowed: a positive integer")

    @classmethod
    def from_config(cls, cfg: ParallelConfig) -> ParallelDims:
        return cls(pp=cfg.pp, tp=cfg.tp, fsdp=cfg.fsdp)

    # ---- the grid ------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Processes in one replica."""
        return self.pp * self.fsdp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.fsdp, self.tp)

    def size(self, axis: MeshAxis) -> int:
        return getattr(self, MeshAxis(axis).value)

    def rank_grid(self) -> torch.Tensor:
        """Replica-local ranks as a ``(pp, fsdp, tp)`` integer tensor."""
        return torch.arange(self.world).view(self.shape)

    def coords(self, rank: int) -> Coord:
        """The (stage, shard, tp) coordinates of replica-local ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside this replica's {self.world} ranks (pp x fsdp x tp)")
        return Coord(rank // (self.fsdp * self.tp), rank // self.tp % self.fsdp, rank % self.tp)

    def rank_of(self, pp: int, fsdp: int, tp: int) -> int:
        return (pp * self.fsdp + fsdp) * self.tp + tp

    def groups(self, axis: MeshAxis) -> list[list[int]]:
        """The rank lists along ``axis`` (one list per combination of the other coordinates)."""
        dim = AXES.index(MeshAxis(axis))
        grid = self.rank_grid().movedim(dim, -1)
        return grid.reshape(-1, grid.shape[-1]).tolist()

    # ---- validation ----------------------------------------------------------------------
    def check_world(self, world: int) -> None:
        """Raises ConfigError unless the replica has exactly ``pp * fsdp * tp`` processes."""
        if world != self.world:
            raise ConfigError(
                f"parallel.pp x parallel.fsdp x parallel.tp = {self.pp} x {self.fsdp} x {self.tp} = {self.world} "
                f"does not match the replica's {world} processes; launch {self.world} processes per replica "
                f"(--procs-per-replica {self.world}) or change the degrees")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raises ConfigError if the model cannot be split this way (its architecture's rules: heads and
        MLP width for Llama; layers and tied embeddings for every one): :func:`recover.config.check_layout`,
        the one implementation."""
        check_layout(cfg, pp=self.pp, tp=self.tp)

    def stage_layers(self, n_layers: int, stage: int) -> list[int]:
        """Block indices of pipeline ``stage``: contiguous, even split, earlier stages take the extra ones."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} is outside 0..{self.pp - 1}")
        base, extra = divmod(n_layers, self.pp)
        start = stage * base + min(stage, extra)
        return list(range(start, start + base + (stage < extra)))

    # ---- the mesh ------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu", timeout_s: float = 30.0,
                   ranks: list[int] | None = None) -> DeviceMesh:
        """A ``(pp, fsdp, tp)`` DeviceMesh named by :class:`MeshAxis`, every group bounded by ``timeout_s``.

        Collective over the default process group: every rank of it must call this, in the same
        order, with the same arguments (``new_group`` semantics).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``.
            timeout_s: backend timeout of each of the mesh's groups (the intra-replica timeout).
            ranks: the global ranks of this replica in replica-local order; default all ranks of
                the default group (one replica = one ``torchrun`` job). Tests that hold several
                replicas in one job pass each replica's ranks (and build every replica's mesh).

        Raises:
            ConfigError: the number of ranks is not ``pp * fsdp * tp``.
        """
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        self.check_world(len(ranks))
        backend = dist.get_backend()
        options = _options(backend, timedelta(seconds=timeout_s))
        mesh = torch.tensor(ranks, dtype=torch.int).view(self.shape)
        return DeviceMesh(device_type, mesh, mesh_dim_names=tuple(a.value for a in AXES),
                          backend_override=((backend, options),) * len(AXES))

    def build_group(self, timeout_s: float = 30.0, ranks: list[int] | None = None) -> dist.ProcessGroup:
        """A process group of all the replica's ranks with the intra-replica timeout (collective like
        :meth:`build_mesh`); the engine's loss and grad-norm all-reduces run on it."""
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        self.check_world(len(ranks))
        return dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))


def _options(backend: str, timeout: timedelta) -> Any:
    """Backend options that carry the timeout (DeviceMesh reads ``options._timeout``, the private attribute
    torch's own ``new_group`` sets too: a torch that renamed it fails here, loudly). ``ProcessGroupGloo.Options``
    is c10d's generic ``Backend.Options(backend, timeout)`` under a public name."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return opts
    return dist.ProcessGroupGloo.Options(backend, timeout)
