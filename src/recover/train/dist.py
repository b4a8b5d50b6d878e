"""Plain ``torch.distributed`` set-up for ``torchrun`` data parallelism (the failure-free path).

Contract: :func:`init_from_env` reads the ``torchrun`` environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), picks NCCL on GPU and gloo on CPU, and returns a :class:`DistContext`; with no
such environment it returns a single-process context and creates no process group.
:class:`DistReducer` sums tensors across the group on flattened copies (inputs are never changed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "none"
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(backend: str = "auto", timeout_s: float = 300.0) -> DistContext:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return DistContext(device=device)
    ctx = DistContext(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        backend=pick_backend(backend),
    )
    if ctx.backend == "nccl":
        ctx.device = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(ctx.device)
    dist.init_process_group(ctx.backend, timeout=timedelta(seconds=timeout_s))
    return ctx


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalReducer:
    """The reducer of a single process: the sum over one replica is its own payload (copied)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]


class DistReducer:
    """SUM all-reduce over the default group on one flattened copy per dtype."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def allreduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # a copy: inputs stay untouched
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset:offset + n].view_as(tensors[i])
                offset += n
        return out  # type: ignore[return-value]
