"""One ordered ``parallelize``: tensor parallel, then activation checkpointing, then compile, then FSDP2.

Contract:
- Input: a whole model or a pipeline stage (:func:`recover.parallel.pipeline.split_stage`) whose
  parameters already hold their initial values (every rank built the same values from the seed).
- The unit of activation checkpointing, compile and FSDP is a block of the model's spec
  (:meth:`recover.model.spec.ModelSpec.block_dict`); TP follows the spec's plan (:mod:`recover.parallel.tp`).
- Order (torchtitan's): TP over the ``tp`` mesh axis, then per-block activation checkpointing, then
  ``torch.compile`` of each block in place (parameter names unchanged), then ``fully_shard`` of every
  block and of the root over the ``fsdp`` axis ONLY. FSDP2 never gets a
  replicate axis: the cross-replica reduction is layer 1's, interruptible and fault tolerant,
  whereas FSDP2's own replicate all-reduce cannot be interrupted (docs/DESIGN.md §11).
- FSDP2's gradient reduce-scatter SUMS over the shard ranks (divide factor 1), because each shard
  rank runs its own microbatches and the replica must contribute the sum of microbatch gradients;
  with ``exact`` (deterministic mode) it sums in float64 (:mod:`recover.parallel.exact`).
- Degrees of 1 are skipped, so ``ParallelDims()`` leaves the model a plain module.

``checkpoint_wrapper`` comes from a private module path (no public twin; torchtitan imports it too): a
torch that moved it fails at this module's import, loudly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from recover.errors import ConfigError
from recover.model.spec import spec_of
from recover.parallel.dims import MeshAxis, ParallelDims
from recover.parallel.tp import apply_tp

WRAPPED = "_checkpoint_wrapped_module."
"""What activation checkpointing adds to parameter names; :func:`clean_name` removes it."""


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None,
                activation_checkpointing: bool = False, sequence_parallel: bool = False,
                compile_blocks: str | None = None, exact: bool = False) -> nn.Module:
    """Applies TP, then activation checkpointing, then compile, then FSDP2 to ``model`` in place; returns it.

    Args:
        model: a model a :class:`~recover.model.spec.ModelSpec` built, or a stage of one.
        dims: the replica's degrees (``dims.check_model`` has passed).
        mesh: the replica's mesh from :meth:`ParallelDims.build_mesh` (None only when tp = fsdp = 1).
        activation_checkpointing: recompute each block in backward instead of storing activations.
        sequence_parallel: shard norms and the residual stream along the sequence (needs tp > 1, pp = 1).
        compile_blocks: ``torch.compile`` every transformer block with this backend (``training.compile``).
        exact: FSDP2 reduce-scatters in float64 (deterministic mode, :mod:`recover.parallel.exact`).

    Raises:
        ConfigError: sequence parallelism asked for with tp = 1 or pp > 1.
    """
    if sequence_parallel and (dims.tp == 1 or dims.pp > 1):
        raise ConfigError(f"sequence parallelism needs parallel.tp > 1 and parallel.pp = 1, got tp = {dims.tp}, "
                          f"pp = {dims.pp}: turn it off or change the degrees")
    if (dims.tp > 1 or dims.fsdp > 1) and mesh is None:
        raise ValueError("parallelize: a mesh is required when tp > 1 or fsdp > 1")
    if dims.tp > 1:
        apply_tp(model, mesh[MeshAxis.TP.value], sequence_parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_blocks:
        for block in spec_of(model).block_dict(model).values():
            block.compile(backend=compile_blocks)  # in place: the module and its parameter names stay
    if dims.fsdp > 1:
        apply_fsdp(model, mesh[MeshAxis.FSDP.value], exact)
    return model


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Wraps every block so its activations are recomputed in backward (full per-block AC)."""
    blocks = spec_of(model).block_dict(model)
    for key in list(blocks.keys()):
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=False)
    return model


def apply_fsdp(model: nn.Module, fsdp_mesh: DeviceMesh, exact: bool = False) -> nn.Module:
    """``fully_shard`` each block, then the root, over ``fsdp_mesh``; reduce-scatter sums (no average), in
    float64 when ``exact``."""
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64) if exact else MixedPrecisionPolicy()
    for block in spec_of(model).block_dict(model).values():
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=True, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped model spells it (activation checkpointing prefix removed)."""
    return name.replace(WRAPPED, "")
