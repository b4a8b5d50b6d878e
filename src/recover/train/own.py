"""The user's own model and optimizer as a replica of one process (what :mod:`recover.api` trains).

Contract: :class:`OwnReplica` is a :class:`~recover.recovery.interfaces.StepReplica` whose microbatches
are computed by the user's loop, not by the replica: the step protocol yields the ids to compute
(:meth:`~recover.recovery.protocol.ResilientStep.run_iter`), and for each one the user's code runs
the forward and ``loss.backward()``, after which :meth:`fold` adds the gradient into the replica's
buffers (float32, or float64 in deterministic mode) and clears ``.grad``. At the end of each yielded
batch of ids :meth:`settle` reads the losses and the per-microbatch finiteness flags in one host read
and extends the ledger: as for the built-in replica, a microbatch is in the ledger if and only if its
gradient is in the buffers, and a reduction never writes them.

The rest is the built-in replica's, shared: the totals and the update (:mod:`recover.train.update`:
divide by M, clip by the global norm, the user's optimizer), the exact parameter fingerprint, and the
state a joiner receives (parameters, persistent buffers, optimizer state, counters: tensors only; the
joiner's own construction of the model provides the rest, e.g. non-persistent buffers).
The learning rate, when the user gives ``lr(step)``, is set from the committed step before each update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recover.recovery.interfaces import Totals
from recover.train.bits import bit_sum, flip_bit, to_host
from recover.train.optim import set_lr
from recover.train.replica import load_transferred, transfer_tensors
from recover.train.update import apply_sum, read_totals


class OwnReplica:
    """``model`` and ``optimizer`` of one process as a replica (see the module docstring).

    Args:
        model: any ``nn.Module``; its trainable parameters are the gradient.
        optimizer: any optimizer over those parameters.
        lr: the learning rate of a committed step (None: the optimizer's own, untouched).
        clip: the global gradient-norm bound (0: none).
        deterministic: float64 gradient buffers (a step's sum does not depend on who computed what).
        device: where the buffers live (the parameters' device).
        tokens_per_microbatch: for the step records' token counts.
    """

    reduce_order = None
    audits = False  # a microbatch's gradient is the user's code: it is not recomputed for audits
    audit_id: int | None = None
    audit_value: dict[str, Any] | None = None

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, lr: Callable[[int], float] | None,
                 clip: float, deterministic: bool, device: torch.device, tokens_per_microbatch: int = 0) -> None:
        self.model, self.optimizer, self.lr, self.clip = model, optimizer, lr, clip
        self.device = device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        state = [*model.named_parameters(), *persistent_buffers(model)]
        self._state_names, self._state_tensors = [n for n, _ in state], [t for _, t in state]
        self.dtype = torch.float64 if deterministic else torch.float32
        self.buffers = [torch.zeros_like(p, dtype=self.dtype) for p in self.params]
        self.stats = torch.zeros(2, dtype=torch.float64, device=device)
        self._ones = torch.ones(len(self.params), dtype=torch.float64, device=device)
        self.tokens_per_microbatch = tokens_per_microbatch
        self.ledger: list[int] = []
        self.nonfinite: list[int] = []
        self.loss_sum = 0.0
        self._folded: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (id, loss, gradient finite) on the device
        self.poison: set[int] = set()  # ids of the current step whose gradient becomes NaN (--nan injection)

    def reset(self) -> None:
        for buf in self.buffers:
            buf.zero_()
        self.stats.zero_()
        self.ledger, self.nonfinite, self.loss_sum, self._folded = [], [], 0.0, []

    def payload(self) -> list[torch.Tensor]:
        return [*self.buffers, self.stats]

    def compute(self, step: int, ids: list[int], hook: Any, final: Any = None) -> None:
        raise TypeError("the user's loop computes an OwnReplica's microbatches: drive ResilientStep.run_iter()")

    @torch.no_grad()
    def fold(self, mb: int, loss: torch.Tensor) -> None:
        """Microbatch ``mb``'s gradient (its ``loss.backward()`` just ran) into the buffers; ``.grad`` cleared."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            raise RuntimeError(f"microbatch {mb}: no parameter has a gradient (call mb.backward(loss) with a loss "
                               "computed from the model)")
        if mb in self.poison:  # fault injection (--nan): this microbatch's gradient is not finite
            self.poison.discard(mb)
            grads[0].mul_(float("nan"))
        finite = torch.stack(torch._foreach_norm(grads)).sum().isfinite()
        for buf, p in zip(self.buffers, self.params, strict=True):
            if p.grad is not None:
                buf.add_(p.grad.to(self.dtype))
                p.grad = None
        self._folded.append((mb, loss.detach().double().reshape(()), finite))

    def settle(self, ids: list[int]) -> None:
        """The end of a batch of ``ids``: every one must have been folded; one host read of their losses and
        finiteness; the ledger and the stats grow by the finite ones, the others go to ``nonfinite``.

        Raises:
            RuntimeError: an id was not folded (the loop skipped ``mb.backward``) or folded twice.
        """
        folded = [mb for mb, _, _ in self._folded]
        if sorted(folded) != sorted(ids):
            missing = sorted(set(ids) - set(folded))
            raise RuntimeError(f"microbatches {missing} were handed out but not backwarded (call mb.backward(loss) "
                               "once for each microbatch of the step)" if missing
                               else f"microbatches {folded} were backwarded more than once or not handed out")
        if not self._folded:
            return
        losses = torch.stack([loss for _, loss, _ in self._folded])
        finite = torch.stack([ok for _, _, ok in self._folded]) & losses.isfinite()
        values, oks = to_host(losses, finite)
        bad = [mb for mb, ok in zip(folded, oks, strict=True) if not ok]
        self.nonfinite += bad
        good = [(mb, v) for mb, v in zip(folded, values, strict=True) if mb not in bad]
        self.loss_sum += sum(v for _, v in good)
        self.ledger.extend(mb for mb, _ in good)
        self.stats[0].fill_(self.loss_sum)
        self.stats[1].fill_(float(len(self.ledger)))
        self._folded = []

    def totals(self, reduced: list[torch.Tensor], fingerprint: bool = False) -> Totals:
        return read_totals(reduced, len(self.params), self._ones, self._fingerprint() if fingerprint else None)

    def apply(self, reduced: list[torch.Tensor], divisor: int, step: int, sum_norm: float) -> float:
        if self.lr is not None:
            set_lr(self.optimizer, float(self.lr(step)))
        return apply_sum(self.optimizer, self.params, reduced, divisor, sum_norm, self.clip)

    def _fingerprint(self) -> torch.Tensor:
        return bit_sum([p.detach() for p in self.params], self.device)

    def transfer_state(self, counters: dict[str, int]) -> dict[str, torch.Tensor]:
        """Every parameter (frozen ones too), the persistent buffers, the optimizer state and ``counters``."""
        return transfer_tensors(self._state_names, self._state_tensors, self.optimizer, counters)

    def load_transfer_state(self, state: dict[str, torch.Tensor]) -> dict[str, int]:
        return load_transferred(self._state_names, self._state_tensors, self.optimizer, state)

    def corrupt(self) -> None:
        """Fault injection (``--corrupt``): one bit of the first parameter flips in memory."""
        flip_bit(self.params[0])


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module tree's persistent buffers (running statistics), each once. Not the state dict's other entries:
    what state-dict hooks derive (e.g. torchtitan's fused QKV saved as ``wq``/``wk``/``wv``: copies, stale the
    moment they are taken) and ``get_extra_state()`` values (any object) are no state of the module in memory.
    Non-persistent buffers (RoPE caches, masks) are left out too: the joiner's own construction rebuilds them."""
    out = []
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            out.append((name, buf))
    return out
