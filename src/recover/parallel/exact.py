"""Deterministic mode inside an FSDP2 replica: each pass's gradient shard, summed over the shard ranks in float64.

FSDP2 reduce-scatters a pass's gradient over the replica's shard ranks and leaves each rank its shard
in ``.grad``, in the parameters' dtype (float32). That rounding of a cross-rank sum depends on which
ids ran in which shard column, so it would tie a deterministic step to the plan. Instead:

- :func:`recover.parallel.apply.apply_fsdp` with ``exact=True`` gives ``fully_shard`` a
  ``MixedPrecisionPolicy(reduce_dtype=float64)``: each rank's float32 gradient of a pass is cast to
  float64 and the reduce-scatter SUMS in float64 (divide factor 1: nothing to undo), which is exact
  for the few float32 terms of one element (``docs/DESIGN.md`` §4.5), so it is the same whichever
  rank ran which id, and a zero-weight padding pass adds exactly zero.
- :class:`ExactShards` installs an all-reduce hook (``FSDPModule.set_all_reduce_hook``) on every FSDP
  module: FSDP2 calls it with the float64 reduce-scatter output of that module's parameters, before it
  casts the output to float32 ``.grad``. The hook keeps it (two reductions of one module before a take
  are summed, in float64).
- After the backward, :meth:`ExactShards.gradients` gives each parameter's float64 shard of the pass:
  the float32 ``.grad`` FSDP2 set is a view (shape, strides, offset) of the cast of that module's
  output, so the same view of the float64 output is the exact value. A ``.grad`` whose storage is not
  that output's size (another torch's layout) raises instead of folding a wrong value.
- The caller folds those shards into its float64 buffers, then calls :meth:`ExactShards.clear` and sets
  every ``.grad`` to None before the next backward (:meth:`recover.train.replicas.replica.Replica._fold`).

Under a pipeline schedule (PP x FSDP) FSDP2 accumulates a stage's unsharded gradients over the
microbatches in the float64 reduce dtype and reduce-scatters once: the same holds.

Cost: the reduce-scatter moves float64 (twice float32's bytes); the passes, their all-gathers and the
memory of the unsharded gradients are FSDP2's own. The default (float32) mode does none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


class ExactShards:
    """The float64 reduce-scatter outputs of a model's FSDP2 modules (``fully_shard`` with a float64
    ``reduce_dtype``), and each parameter's exact gradient shard of the pass read from them.

    Args:
        model: the FSDP2-sharded model (every module ``fully_shard`` wrapped, the root included).
        params: its trainable parameters, in the order :meth:`gradients` returns them.

    Raises:
        ValueError: a parameter belongs to no FSDP module.
    """

    def __init__(self, model: nn.Module, params: list[torch.Tensor]) -> None:
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        owner: dict[int, int] = {}
        for k in reversed(range(len(modules))):  # innermost first: a block's parameters are the root's too
            for p in modules[k].parameters():
                owner.setdefault(id(p), k)
            modules[k].set_all_reduce_hook(self._keeper(k))
        missing = [i for i, p in enumerate(params) if id(p) not in owner]
        if missing:
            raise ValueError(f"parameters {missing[:3]} belong to no FSDP module")
        self.params = params
        self.owners = [owner[id(p)] for p in params]
        self.outputs: dict[int, torch.Tensor] = {}  # module index -> its float64 reduce-scatter output
        self._taken: list[torch.Tensor | None] | None = None

    def _keeper(self, k: int) -> Callable[[torch.Tensor], None]:
        def keep(output: torch.Tensor) -> None:
            kept = self.outputs.get(k)
            self.outputs[k] = output if kept is None else kept + output
        return keep

    def gradients(self) -> list[torch.Tensor | None]:
        """Each parameter's float64 gradient shard of the pass just run (None: it has no ``.grad``); the
        same tensors until :meth:`clear` (a fault injected into them reaches the fold)."""
        if self._taken is None:
            self._taken = [self._shard(p, k) for p, k in zip(self.params, self.owners, strict=True)]
        return self._taken

    def _shard(self, p: torch.Tensor, k: int) -> torch.Tensor | None:
        if p.grad is None:
            return None
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        flat = self.outputs.get(k)
        if flat is None or g.untyped_storage().nbytes() != flat.numel() * g.element_size():
            raise RuntimeError("deterministic FSDP: a gradient is not a view of its module's reduce-scatter output "
                               "(a torch whose FSDP2 lays its gradients out otherwise); run without "
                               "--deterministic or with the tested torch")
        return flat.as_strided(g.size(), g.stride(), flat.storage_offset() + g.storage_offset())

    def clear(self) -> None:
        """Forgets the pass's outputs (after they were folded); on a GPU their memory is released only
        after the current stream's work that read them."""
        for flat in self.outputs.values():
            if flat.is_cuda:
                flat.record_stream(torch.cuda.current_stream(flat.device))
        self.outputs, self._taken = {}, None
