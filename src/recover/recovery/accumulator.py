"""The gradient accumulator and ledger of one step on one replica.

Contract:
- ``add(mb_id, loss)`` runs backward for one microbatch and folds its gradient into buffers that
  belong to the accumulator (never into a buffer a collective writes), then records ``mb_id`` in
  the ledger. A microbatch is in the ledger if and only if its gradient is in the buffers.
- ``payload()`` is what a replica contributes to the cross-replica reduction: the buffers plus a
  float64 ``[loss_sum, microbatch_count]`` tensor. Reducers work on copies; the accumulator is
  never modified by a reduction, so a failed reduction loses nothing.
- ``apply(reduced, M)`` divides the reduced sum by the constant M, clips and steps the optimizer.
- In deterministic mode the buffers are float64: a sum of float32 microbatch gradients in float64
  does not depend on the order (who computed which id), so the step is bitwise reproducible.
"""

from __future__ import annotations

import torch
from torch import nn


class GradAccumulator:
    """Local sum of microbatch gradients for one step, with the ledger of finished ids."""

    def __init__(self, model: nn.Module, deterministic: bool = False) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dtype = torch.float64 if deterministic else torch.float32
        self.buffers = [torch.zeros_like(p, dtype=self.dtype) for p in self.params]
        self.ledger: list[int] = []
        self.loss_sum = 0.0

    def reset(self) -> None:
        for buf in self.buffers:
            buf.zero_()
        self.ledger = []
        self.loss_sum = 0.0

    def add(self, mb_id: int, loss: torch.Tensor) -> None:
        """Backward of one microbatch's mean loss; its gradient joins the step's local sum."""
        for p in self.params:
            p.grad = None
        loss.backward()
        for buf, p in zip(self.buffers, self.params, strict=False):
            if p.grad is not None:
                buf.add_(p.grad.to(self.dtype))
        self.loss_sum += float(loss.detach())
        self.ledger.append(int(mb_id))

    def payload(self) -> list[torch.Tensor]:
        """Tensors to sum across replicas: gradient buffers, then ``[loss_sum, count]``."""
        stats = torch.tensor([self.loss_sum, float(len(self.ledger))], dtype=torch.float64,
                             device=self.buffers[0].device if self.buffers else "cpu")
        return [*self.buffers, stats]

    @staticmethod
    def totals(reduced: list[torch.Tensor]) -> tuple[float, int]:
        """(loss_sum, microbatch_count) from a reduced payload."""
        stats = reduced[-1]
        return float(stats[0]), int(round(float(stats[1])))

    def apply(self, reduced: list[torch.Tensor], M: int, optimizer: torch.optim.Optimizer,
              grad_clip: float) -> float:
        """Sets grad = reduced sum / M, clips to ``grad_clip`` (0: no clip), steps; returns the norm."""
        for p, g in zip(self.params, reduced[: len(self.params)], strict=False):
            p.grad = (g / M).to(p.dtype)
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        optimizer.step()
        for p in self.params:
            p.grad = None
        return float(norm)
