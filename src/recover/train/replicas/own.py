"""The user's own model and optimizer as a replica of one process (what :mod:`recover.api` trains).

Contract: :class:`OwnReplica` is a :class:`~recover.recovery.interfaces.StepReplica` whose microbatches
are computed by the user's loop, not by the replica: the step protocol yields the ids to compute
(:meth:`~recover.recovery.protocol.ResilientStep.run_iter`), and for each one the user's code runs
the forward and ``loss.backward()``, after which :meth:`fold` adds the gradient into the replica's
buffers (float32, or float64 in deterministic mode) and clears ``.grad``. At the end of each yielded
batch of ids :meth:`settle` reads the losses and the per-microbatch finiteness flags in one host read
and extends the ledger: as for the built-in replica, a microbatch is in the ledger if and only if its
gradient is in the buffers, and a reduction never writes them.

A replica of several ranks (``fsdp x tp`` processes, the user's FSDP2 / TP over ``recover.init().mesh``)
holds this rank's shards: the buffers are the local shards of the gradients, which FSDP2 has already
summed over the shard ranks in each backward (its divide factor set to 1 here, so each shard holds a
SUM). The ranks of an fsdp column compute different ids (:func:`column`, zero-weight padding passes so
every rank runs as many backwards); :meth:`settle` shares every id's loss and finiteness over the
replica's group, so every rank holds the replica's whole ledger and stats. A parameter that is not sharded
over the fsdp axis (a plain tensor: the model of a plain ``torchrun`` of a one-process script, or what the
user's plan left unwrapped) is data parallel inside the replica, as under DDP: :meth:`totals` sums its
reduced gradient over the fsdp ranks (``dp_group``) before anything reads it, so every rank applies the
same update and the ranks stay equal; they must start equal (:func:`~recover.train.replicas.contract.check_same_weights`
at construction), and the optimizer must step the model's own parameters
(:func:`~recover.train.replicas.contract.check_optimizer`).

The rest is the built-in replica's, shared: the totals and the update (:mod:`recover.train.replicas.update`:
divide by M, clip by the global norm, the user's optimizer), the exact parameter fingerprint, and the
state a joiner receives (parameters, persistent buffers, optimizer state, counters: tensors only; this
rank's shards, from the same rank of a live replica; the joiner's own construction of the model provides
the rest, e.g. non-persistent buffers), to which the user's extra state (``extra``:
:mod:`recover.train.checkpoints.extra`) and the optimizer's param-group settings (an LR scheduler's ``lr``) are
added as tensors and a JSON skeleton in a tensor of bytes. The learning rate, when the user gives
``lr(step)``, is set from the committed step before each update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from recover.errors import ContractError
from recover.faults.perturb import NONE
from recover.recovery.interfaces import Totals
from recover.train.checkpoints.extra import (
    from_tensors,
    hyperparameters,
    load_into,
    parts,
    set_hyperparameters,
    state_of,
    to_tensors,
)
from recover.train.replicas.bits import bit_sum, flip_bit, to_host
from recover.train.replicas.contract import check_optimizer, check_same_weights
from recover.train.replicas.optim import set_lr
from recover.train.replicas.replica import like, load_transferred, local, shards, transfer_tensors
from recover.train.replicas.scaling import LossScale
from recover.train.replicas.update import apply_sum, read_totals
from recover.workload.policy import split_within_replica

LOSS_SCALE = "loss_scale"
"""The name of the loss scale (``scaler``, :mod:`recover.train.replicas.scaling`) among the extra state."""
SCHEDULER = "lr_scheduler"
"""The name of an LR scheduler given as ``lr`` among the extra state (joiners and checkpoints carry it)."""


def column(ids: list[int], fsdp: int, index: int) -> list[int | None]:
    """The ids rank ``index`` of an fsdp group of ``fsdp`` computes, padded with None (a zero-weight pass)."""
    return split_within_replica(ids, fsdp)[index] if fsdp > 1 else list(ids)


def sum_gradients(model: nn.Module) -> None:
    """Makes every FSDP2 module of ``model`` SUM its gradient over the shard ranks (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


class OwnReplica:
    """``model`` and ``optimizer`` of one process as a replica (see the module docstring).

    Args:
        model: any ``nn.Module``; its trainable parameters are the gradient.
        optimizer: any optimizer over those parameters.
        lr: the learning rate of a committed step, or a torch LR scheduler over ``optimizer`` stepped after each
            committed update (None: the optimizer's own, untouched).
        clip: the global gradient-norm bound (0: none).
        deterministic: float64 gradient buffers (a step's sum does not depend on who computed what).
        device: where the buffers live (the parameters' device).
        tokens_per_microbatch: for the step records' token counts.
        group: the replica's process group when it has several ranks (None: one process).
        fsdp, fsdp_index, tp_index: the replica's fsdp degree and this rank's coordinates.
        extra: state that travels with the model (``state_dict()``/``load_state_dict()``, or a dict of such).
        scaler: a torch ``GradScaler`` whose dynamic loss scale this replica applies (float16:
            :mod:`recover.train.replicas.scaling`); None: no loss scaling.
        dp_group: the process group of this rank's fsdp ranks (``mesh["fsdp"]``), when ``fsdp > 1``: the
            gradients of parameters not sharded over it are summed over it.

    Raises:
        ContractError: the optimizer steps parameters that are not the model's; the ranks hold different
            values of a parameter none of them shards.
    """

    reduce_order = None
    audits = False  # a microbatch's gradient is the user's code: it is not recomputed for audits
    audit_id: int | None = None
    audit_value: dict[str, Any] | None = None
    upcoming: Callable[[int], list[int]] | None = None  # its data is the user's: nothing is read ahead

    def audit(self, step: int, mb: int) -> dict[str, Any]:
        raise RuntimeError("a replica of a user's own loop takes no part in audits (audits is False)")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 lr: Callable[[int], float] | LRScheduler | None, clip: float, deterministic: bool,
                 device: torch.device, tokens_per_microbatch: int = 0,
                 group: dist.ProcessGroup | None = None, fsdp: int = 1, fsdp_index: int = 0,
                 tp_index: int = 0, extra: Any = None, dp_group: dist.ProcessGroup | None = None,
                 scaler: Any = None) -> None:
        check_optimizer(model, optimizer)
        self.model, self.optimizer, self.clip = model, optimizer, clip
        self.scheduler = lr if isinstance(lr, LRScheduler) else None
        self.lr = None if self.scheduler is not None else lr
        self.extra = parts(extra)
        if self.scheduler is not None:
            if self.scheduler.optimizer is not optimizer:
                raise ContractError("the LR scheduler given as lr steps another optimizer: build it over the Job's")
            self.extra = {**self.extra, SCHEDULER: self.scheduler}  # to joiners and checkpoints with the rest
        self.loss_scale = LossScale(scaler) if scaler is not None else None
        if self.loss_scale is not None:
            self.extra = {**self.extra, LOSS_SCALE: self.loss_scale}
        self.applied_lr = float(optimizer.param_groups[0]["lr"])
        """The learning rate of the last update (a scheduler has moved the optimizer's on since)."""
        self.device, self.group = device, group
        self.fsdp, self.fsdp_index, self.tp_index = fsdp, fsdp_index, tp_index
        sum_gradients(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        check_same_weights([(n, local(p)) for n, p in model.named_parameters() if shards(p) == 1], group, device)
        self._dp = [k for k, p in enumerate(self.params) if fsdp > 1 and not over_fsdp(p)]
        self.dp_group = dp_group if self._dp else None
        if self._dp and dp_group is None:
            raise ValueError("fsdp > 1 and parameters not sharded over it: give dp_group (the mesh's fsdp group)")
        state = [*model.named_parameters(), *persistent_buffers(model)]
        self._state_names, self._state_tensors = [n for n, _ in state], [t for _, t in state]
        self.dtype = torch.float64 if deterministic else torch.float32
        self.buffers = [torch.zeros_like(local(p), dtype=self.dtype) for p in self.params]
        self.stats = torch.zeros(2, dtype=torch.float64, device=device)
        ranks = dist.get_world_size(group) if group is not None else 1
        self._copies = torch.tensor([float(ranks // shards(p)) for p in self.params], dtype=torch.float64,
                                    device=device)  # each shard of the whole gradient counted once
        self.tokens_per_microbatch = tokens_per_microbatch
        self.ledger: list[int] = []
        self.nonfinite: list[int] = []
        self.loss_sum = 0.0
        self._folded: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (id, loss, gradient finite) on the device
        self.perturb = NONE  # injected faults (the session installs this process's)

    def reset(self) -> None:
        for buf in self.buffers:
            buf.zero_()
        self.stats.zero_()
        self.ledger, self.nonfinite, self.loss_sum, self._folded = [], [], 0.0, []
        self.audit_id, self.audit_value = None, None  # a launched Job's probe digest, set again after the step

    def payload(self) -> list[torch.Tensor]:
        return [*self.buffers, self.stats]

    def compute(self, step: int, ids: list[int], hook: Any, final: Any = None) -> None:
        raise TypeError("the user's loop computes an OwnReplica's microbatches: drive ResilientStep.run_iter()")

    @torch.no_grad()
    def fold(self, step: int, mb: int | None, loss: torch.Tensor) -> None:
        """Microbatch ``mb``'s gradient (its ``loss.backward()`` just ran; ``mb`` None: a zero-weight padding
        pass) into the buffers; ``.grad`` cleared."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            raise RuntimeError(f"microbatch {mb}: no parameter has a gradient (call mb.backward(loss) with a loss "
                               "computed from the model)")
        perturb = self.perturb.gradient(step, mb)  # injected faults
        if perturb is not None:
            for grad in grads:
                perturb(grad)
        finite = (torch.stack(torch._foreach_norm(grads)).sum().isfinite() if self.loss_scale is None
                  else torch.ones((), dtype=torch.bool, device=grads[0].device))  # an overflow: the update decides
        for buf, p in zip(self.buffers, self.params, strict=True):
            if p.grad is not None:
                buf.add_(local(p.grad).to(self.dtype))
                p.grad = None
        if mb is not None:
            self._folded.append((mb, loss.detach().double().reshape(()), finite))

    def settle(self, ids: list[int], mine: list[int]) -> None:
        """The end of a batch of ``ids`` of which this rank computed ``mine``: each must have been folded
        once; one host read of every id's loss and finiteness (shared over the replica's ranks); the ledger
        and the stats grow by the finite ones, the others go to ``nonfinite``.

        Raises:
            RuntimeError: an id was not folded (the loop skipped ``mb.backward``) or folded twice.
        """
        folded = [mb for mb, _, _ in self._folded]
        if sorted(folded) != sorted(mine):
            missing = sorted(set(mine) - set(folded))
            raise RuntimeError(f"microbatches {missing} were handed out but not backwarded (call mb.backward(loss) "
                               "once for each microbatch of the step)" if missing
                               else f"microbatches {folded} were backwarded more than once or not handed out")
        if not ids:
            return
        at = {mb: k for k, mb in enumerate(ids)}
        shared = torch.zeros(2, len(ids), dtype=torch.float64, device=self.device)  # [loss; not finite] per id
        for mb, loss, ok in self._folded:
            if self.tp_index == 0:  # one owner per id: its fsdp column's first TP rank
                shared[0, at[mb]] = loss
            shared[1, at[mb]] = (~ok).double()
        if self.group is not None:
            dist.all_reduce(shared, group=self.group)
        values, flags = to_host(shared[0], shared[1])
        bad = [mb for mb, v, f in zip(ids, values, flags, strict=True) if f > 0 or not math.isfinite(v)]
        self.nonfinite += bad
        good = [(mb, v) for mb, v in zip(ids, values, strict=True) if mb not in bad]
        self.loss_sum += sum(v for _, v in good)
        self.ledger.extend(mb for mb, _ in good)
        self.stats[0].fill_(self.loss_sum)
        self.stats[1].fill_(float(len(self.ledger)))
        self._folded = []

    def totals(self, reduced: list[torch.Tensor], fingerprint: bool = False) -> Totals:
        """The reduced payload's totals (:func:`~recover.train.replicas.update.read_totals`), after the gradients of the
        parameters not sharded over the fsdp axis were summed over it in place (data parallel inside the
        replica: see the module docstring)."""
        if self.dp_group is not None:
            flat = torch.cat([reduced[k].reshape(-1) for k in self._dp])
            dist.all_reduce(flat, group=self.dp_group)
            for k, part in zip(self._dp, flat.split([reduced[k].numel() for k in self._dp]), strict=True):
                reduced[k].copy_(part.view_as(reduced[k]))
        return read_totals(reduced, len(self.params), self._copies, self._fingerprint() if fingerprint else None,
                           self.group)

    def apply(self, reduced: list[torch.Tensor], divisor: int, step: int, sum_norm: float) -> float:
        """The update of committed step ``step``: with ``lr(step)`` set first, or an LR scheduler stepped after
        it (once per committed step, as a plain loop steps it after ``optimizer.step()``)."""
        if self.lr is not None:
            set_lr(self.optimizer, float(self.lr(step)))
        self.applied_lr = float(self.optimizer.param_groups[0]["lr"])
        scale = self.loss_scale
        if scale is not None and not math.isfinite(sum_norm):  # the scaled gradient overflowed: no update
            scale.update(overflow=True)
            norm = sum_norm
        else:
            norm = apply_sum(self.optimizer, self.params, reduced, divisor * (scale.scale if scale else 1), sum_norm,
                             self.clip, like)
            if scale is not None:
                scale.update(overflow=False)
        if self.scheduler is not None:
            self.scheduler.step()
        return norm

    @property
    def grad_scale(self) -> float:
        """What each microbatch's loss is multiplied by before its backward (1: no loss scaling)."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def _fingerprint(self) -> torch.Tensor:
        return bit_sum([local(p.detach()) for p in self.params], self.device)

    def transfer_state(self, counters: dict[str, int]) -> dict[str, torch.Tensor]:
        """Every parameter (frozen ones too), the persistent buffers, the optimizer state and ``counters``;
        the extra state and the param groups' settings under ``extra.``."""
        carried = {"parts": state_of(self.extra), "param_groups": hyperparameters(self.optimizer)}
        return {**transfer_tensors(self._state_names, self._state_tensors, self.optimizer, counters),
                **to_tensors("extra", carried)}

    def load_transfer_state(self, state: dict[str, torch.Tensor]) -> dict[str, int]:
        counters = load_transferred(self._state_names, self._state_tensors, self.optimizer, state)
        carried = from_tensors("extra", state)
        if carried is not None:
            load_into(self.extra, carried["parts"], "the transferred state")
            set_hyperparameters(self.optimizer, carried["param_groups"])
        return counters

    def corrupt(self) -> None:
        """Fault injection (``--corrupt``): one bit of this rank's shard of the first parameter flips in memory."""
        flip_bit(local(self.params[0].detach()))


def over_fsdp(p: torch.Tensor) -> bool:
    """Whether ``p`` is sharded over a mesh axis named ``fsdp`` (FSDP2's ``fully_shard(..., mesh=rt.mesh["fsdp"])``,
    or FSDP over TP)."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(name == "fsdp" and not placement.is_replicate()
               for name, placement in zip(names, p.placements, strict=False))


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
