"""The end of a step, shared by every kind of replica: what the reduced payload holds, and the update.

Contract (the payload is gradient buffers then a float64 ``[loss_sum, count]``, see
:mod:`recover.train.replicas.replica`):
- :func:`read_totals` reads, in ONE host read, the loss sum, the microbatch count, the L2 norm of the
  summed gradient (each tensor divided by how many ranks hold a copy of it, then summed over the ranks
  of ``group`` when a replica has several) and, when given, a fingerprint tensor.
- :func:`apply_sum` is the optimizer update from that sum: ``grad = sum / divisor``, clipped by the norm
  ``sum_norm / divisor`` against ``clip``, then ``optimizer.step()``. It consumes the sum (scaled in
  place where its dtype is the parameters') and reads nothing from the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from recover.recovery.interfaces import Totals
from recover.train.replicas.bits import MASK, to_host


def read_totals(reduced: list[torch.Tensor], grads: int, copies: torch.Tensor, fingerprint: torch.Tensor | None,
                group: dist.ProcessGroup | None = None) -> Totals:
    """(collective over ``group``) See the module docstring; ``grads``: how many payload tensors are gradients."""
    norms = torch._foreach_norm(reduced[:grads], 2, dtype=torch.float64)
    sq = (torch.stack(norms).square() / copies).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    parts = [reduced[-1], sq] + ([fingerprint] if fingerprint is not None else [])
    (loss_sum, count), (sq_sum,), *fp = to_host(*parts)
    return Totals(loss_sum, int(round(count)), math.sqrt(sq_sum), f"{fp[0][0] & MASK:016x}" if fp else None)


@torch.no_grad()
def apply_sum(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], reduced: list[torch.Tensor],
              divisor: int, sum_norm: float, clip: float,
              like: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda p, g: g) -> float:
    """See the module docstring; ``like(p, g)`` makes a local gradient ``p``'s kind (a DTensor). Returns the
    step's gradient norm."""
    grads = [g.div_(divisor).to(p.dtype) for g, p in zip(reduced[: len(params)], params, strict=True)]
    norm = sum_norm / divisor
    if clip > 0 and norm + 1e-6 > clip:
        torch._foreach_mul_(grads, clip / (norm + 1e-6))
    for p, g in zip(params, grads, strict=True):
        p.grad = like(p, g)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
