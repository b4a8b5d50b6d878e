"""The contracts of :mod:`recover.api` checked, not trusted: a script that breaks one is refused in one line
naming the fix (:class:`~recover.errors.ContractError`), before it trains a wrong result without a word.

Contract:
- :func:`check_optimizer`: every parameter the optimizer steps is one of the model's (by identity). An
  optimizer built over another model, or over the parameters a later ``fully_shard`` or ``to_empty``
  replaced, would step tensors the gradient never reaches: the model would train nothing.
- :func:`check_same_weights` (collective over the replica's group): the ranks of a replica hold the same
  values of the parameters that are not sharded over its mesh (the initial weights of plain ``torchrun``
  ranks); across replicas the first commit vote's parameter fingerprints do the same
  (:mod:`recover.coord.integrity` names the fix at step 0).
- :class:`PureSamples` wraps a user's ``samples(step, id)``: the first microbatch it is asked for in each
  step is read twice and the two batches compared bitwise (tensors, and tuples, lists and dicts of them;
  other values by ``==``). A ``samples`` that draws from the global RNG or keeps a running cursor returns
  something else the second time and is refused at that step. One extra read per step and replica: a
  cost where reads are cheap (``check=False`` turns it off).
- Across replicas (a launched job of one-rank replicas): every replica reads the step's probe microbatch
  (:func:`probe_id`, one more read per step where it is not its own) and its :func:`digest` goes with the
  commit vote, as an audit of the batch (``samples``: True); the coordinator compares them
  (:mod:`recover.coord.integrity`) and names the replicas that disagree on the same id: a ``samples``
  that reads the replica, the rank or the environment is pure in each process, but not the same function
  everywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recover.errors import ContractError
from recover.train.replicas.bits import bit_sum

SEED_FIX = ("seed the RNG the same way before building the model (e.g. torch.manual_seed(0) before constructing "
            "it), on every rank and replica")
PURE_FIX = ("derive the batch from (step, id) alone: a generator of its own, e.g. "
            "torch.Generator().manual_seed(step * 1_000_003 + id), or recover.data.tokens/indexed; no global RNG "
            "(torch, numpy, random), no cursor that advances with each call")


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises ContractError unless every parameter ``optimizer`` steps is one of ``model``'s."""
    own = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in stepped if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ContractError(
            f"the optimizer steps {len(foreign)} of its {len(stepped)} parameters that are not the model's (shapes "
            f"{shapes}{', ...' if len(foreign) > 3 else ''}): the model would train nothing; build the optimizer "
            "from model.parameters() after the model is moved and sharded (fully_shard and to_empty replace "
            "the parameters)")


def check_same_weights(params: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None,
                       device: torch.device) -> None:
    """(collective over ``group``) Raises ContractError unless every rank holds the same ``params`` (name,
    tensor: those every rank holds whole)."""
    if group is None or not params:
        return
    fp = bit_sum([p.detach() for _, p in params], device)
    low, high = fp.clone(), fp.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if int(low) != int(high):
        names = ", ".join(n for n, _ in params[:3])
        raise ContractError(
            f"the ranks of this replica built different initial weights for the {len(params)} parameters not "
            f"sharded over rt.mesh ({names}{', ...' if len(params) > 3 else ''}): {SEED_FIX}")


def same(a: Any, b: Any) -> bool:
    """Whether two batches are bitwise the same (tensors by their bytes, shapes and dtypes; containers walked)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return a.numel() == 0 or torch.equal(a.detach().contiguous().view(-1).view(torch.uint8),
                                             b.detach().contiguous().view(-1).view(torch.uint8))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value (a numpy array): compare what it says it is
        return repr(a) == repr(b)


def probe_id(step: int, M: int) -> int:
    """The microbatch of ``step`` whose batch every replica digests for the vote (a pure function of the two)."""
    return step % M


def digest(batch: Any) -> str:
    """A hex digest of a batch: every tensor's dtype, shape and bytes (containers walked in order, dict keys
    included), other values by ``repr``."""
    h = hashlib.blake2b(digest_size=16)

    def walk(b: Any) -> None:
        if torch.is_tensor(b):
            t = b.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(b, (tuple, list)):
            h.update(f"{type(b).__name__}{len(b)}".encode())
            for x in b:
                walk(x)
        elif isinstance(b, dict):
            h.update(f"dict{len(b)}".encode())
            for k in b:
                h.update(repr(k).encode())
                walk(b[k])
        else:
            h.update(repr(b).encode())

    walk(batch)
    return h.hexdigest()


class PureSamples:
    """``samples(step, id)``, with the first read of each step done twice and compared, and the digest of each
    step's ``probe`` microbatch kept (see the module docstring). Called by one thread at a time, as the
    prefetcher does."""

    def __init__(self, samples: Callable[[int, int], Any], check: bool = True,
                 probe: Callable[[int], int] | None = None) -> None:
        self.samples, self.check, self.probe = samples, check, probe
        self.checked: set[int] = set()
        self.digests: dict[int, str] = {}
        """step -> the digest of its probe microbatch's batch (:func:`probe_id`), once read (``probe`` given)."""

    def __call__(self, step: int, mb: int) -> Any:
        batch = self.samples(step, mb)
        if self.probe is not None and mb == self.probe(step):
            self.digests[step] = digest(batch)
            for old in [s for s in self.digests if s < step - 64]:
                del self.digests[old]
        if self.check and step not in self.checked:
            self.checked.add(step)
            if len(self.checked) > 64:  # the recent steps are enough to tell a step already checked
                self.checked = {s for s in self.checked if s > step - 32}
            if not same(batch, self.samples(step, mb)):
                raise ContractError(f"samples({step}, {mb}) returned a different batch when called again: it is "
                                    f"not a pure function of (step, id), so a replica that recomputes this "
                                    f"microbatch after a failure would train on other data; {PURE_FIX}")
        return batch
