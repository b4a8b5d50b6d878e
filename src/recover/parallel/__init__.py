"""Inside a replica: ParallelDims, the TP plan, pipeline stages and schedules, FSDP2 shard groups.

A replica (the failure unit) is any group of ``pp * fsdp * tp`` ranks running PyTorch's own
parallelism; the data-parallel axis ACROSS replicas is not a mesh axis here, it is layer 1's
fault-tolerant reduction. Typical use on every rank of a replica::

    dims = ParallelDims.from_config(cfg.parallel)          # pp x fsdp x tp = this torchrun job's world
    timeout = cfg.fault_tolerance.intra_replica_timeout_s
    mesh, group = dims.build_mesh("cpu", timeout), dims.build_group(timeout)
    replica = Replica(cfg.model, cfg.training, sampler, dims, mesh, group)   # recover.train.replicas.replica

Nothing here names a module of a particular model: the blocks, the pipeline split and the TP plan
come from the model's :class:`~recover.model.spec.ModelSpec` (``model.cfg.arch``).

Names are imported lazily (``torch.distributed.pipelining`` is loaded only for ``pp > 1``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AXES": "recover.parallel.dims",
    "Coord": "recover.parallel.dims",
    "MeshAxis": "recover.parallel.dims",
    "ParallelDims": "recover.parallel.dims",
    "apply_activation_checkpointing": "recover.parallel.apply",
    "apply_fsdp": "recover.parallel.apply",
    "parallelize": "recover.parallel.apply",
    "SCHEDULES": "recover.parallel.pipeline",
    "PipelineRunner": "recover.parallel.pipeline",
    "split_stage": "recover.parallel.pipeline",
    "apply_tp": "recover.parallel.tp",
}

__all__ = [
    "AXES",
    "SCHEDULES",
    "Coord",
    "MeshAxis",
    "ParallelDims",
    "PipelineRunner",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_tp",
    "parallelize",
    "split_stage",
]

if TYPE_CHECKING:
    from recover.parallel.apply import apply_activation_checkpointing, apply_fsdp, parallelize
    from recover.parallel.dims import AXES, Coord, MeshAxis, ParallelDims
    from recover.parallel.pipeline import SCHEDULES, PipelineRunner, split_stage
    from recover.parallel.tp import apply_tp


def __getattr__(name: str) -> Any:
    """Imports lazily: ``torch.distributed.pipelining`` alone costs ~1 s, so only a user pays for it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recover.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
