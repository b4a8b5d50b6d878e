"""Backend choice and raw process-group construction for one generation.

Contract: ``resolve_backend`` turns the user's ``"gloo" | "nccl" | "auto"`` into the backend to use
(pure: unit-tested without a GPU); ``make_process_group`` builds a backend object (not registered in
``torch.distributed``'s global world: no default-group singleton) on the generation's store.
The call blocks until every rank has joined (full-mesh connect), so the fault-tolerant group runs it
on a helper thread and watches for failure notices meanwhile.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from recover.errors import ConfigError

BACKENDS = ("gloo", "nccl", "auto")


def resolve_backend(requested: str, *, cuda_available: bool, nccl_available: bool) -> str:
    """The backend to use. Raises ConfigError for an unknown name or NCCL without CUDA/NCCL."""
    if requested not in BACKENDS:
        raise ConfigError(f"backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if cuda_available and nccl_available else "gloo"
    if requested == "nccl" and not (cuda_available and nccl_available):
        raise ConfigError(f"backend='nccl' needs CUDA and NCCL (cuda available: {cuda_available}, "
                          f"nccl available: {nccl_available}); use backend='gloo' on CPU")
    return requested


def detect_backend(requested: str) -> str:
    """``resolve_backend`` for this process's torch build."""
    import torch
    import torch.distributed as dist

    return resolve_backend(requested, cuda_available=torch.cuda.is_available(),
                           nccl_available=dist.is_nccl_available())


def default_device(backend: str) -> Any:
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_process_group(backend: str, store: Any, rank: int, size: int, timeout_s: float, device: Any) -> Any:
    """A gloo or NCCL backend object over ``store`` (already prefixed with the generation)."""
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    from recover.comm.nccl import make_nccl_group

    return make_nccl_group(store, rank, size, timeout_s, device)
