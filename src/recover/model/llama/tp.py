"""Tensor parallelism of the Llama blocks (Megatron-style), as a plan :func:`recover.parallel.tp.apply_tp` applies.

Contract:
- In every block, ``wq``/``wk``/``wv`` and ``w1``/``w3`` are split column-wise (each TP rank holds
  ``n_heads / tp`` heads and ``hidden / tp`` MLP columns), ``wo`` and ``w2`` row-wise; a block's
  output is all-reduced, so the residual stream, the norms, the embedding and the output
  projection stay whole (replicated) on every TP rank and their gradients are equal on all of them.
  Attention infers its local head count from the weights, so the model code is unchanged.
  The block input enters attention and the MLP as one replicated DTensor, so the input gradients
  of wq/wk/wv (and w1/w3) add up as partial sums and are all-reduced once per sub-block, not once
  per linear (4 collectives per block instead of 7: 2.3x faster steps on CPU/gloo).
- Optional sequence parallelism: the norms and the residual stream between blocks are sharded
  along the sequence (``Shard(1)``); a block all-gathers its input and reduce-scatters its
  output; outside the blocks the embedding output is sharded and gathered again before ``output``.
  The residual stream is then a DTensor, so it needs ``pp == 1`` (a pipeline stage boundary
  carries plain tensors) and ``seq_len % tp == 0``.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from recover.model.spec import TPPlan


def tp_plan(sequence_parallel: bool = False) -> TPPlan:
    """The block plan and, with sequence parallelism, the plan of the modules around the blocks."""
    return TPPlan(block=block_plan(sequence_parallel), outer=outer_plan() if sequence_parallel else {})


def block_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of one transformer block, keyed by submodule path."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        # The block input enters attention and the MLP as one replicated DTensor, so the gradients of
        # wq/wk/wv (and w1/w3) add up as partial sums and are all-reduced ONCE, not once per linear.
        rep = Replicate()
        plan["attention"] = PrepareModuleInput(input_layouts=(rep, None), desired_input_layouts=(rep, None))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,))
        plan["attention.wo"] = RowwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel()
        return plan
    seq = Shard(1)
    plan.update({
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attention.wo": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq, use_local_output=False),
    })
    return plan


def outer_plan() -> dict[str, ParallelStyle]:
    """Sequence parallelism outside the blocks: shard the embedding output, gather before ``output``."""
    return {
        "tok_embeddings": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                              use_local_output=False),
        "norm": SequenceParallel(),
        "output": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                     use_local_output=True),
    }
