"""Tensor parallelism: the architecture's TP plan applied to a model or a pipeline stage.

Contract:
- The plan is the spec's (:attr:`recover.model.spec.ModelSpec.tp_plan`; Llama's:
  :mod:`recover.model.llama.tp`): its ``block`` styles are applied to every block of the spec's block
  container, then its ``outer`` styles to the root, skipping modules this pipeline stage does not
  hold. Nothing here names a module of a particular architecture.
- Apply before activation checkpointing and FSDP (see :func:`recover.parallel.apply.parallelize`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from recover.model.spec import spec_of


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Shards every block of ``model`` (a whole model or a pipeline stage) over ``tp_mesh`` in place."""
    spec = spec_of(model)
    for block in spec.block_dict(model).values():
        parallelize_module(block, tp_mesh, spec.tp_plan(sequence_parallel).block)
    outer = {name: style for name, style in spec.tp_plan(sequence_parallel).outer.items()
             if getattr(model, name, None) is not None}
    if outer:
        parallelize_module(model, tp_mesh, outer)
    return model
