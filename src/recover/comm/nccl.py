"""NCCL path of layer 1: shrink the communicator where NCCL can, else abort and build a new one.

Contract: this module imports on a CPU-only torch (NCCL symbols are imported inside functions) and
its decisions are pure functions, unit-tested without a GPU:
  * ``shrink_supported(version, has_api)``: ``ncclCommShrink`` needs NCCL >= 2.27 and a torch whose
    NCCL backend exposes ``shrink`` (``torch.distributed.shrink_group`` in 2.10+).
  * ``choose_strategy(...)``: ``"shrink"`` only when the new generation is a strict, non-empty subset
    of the old one (no joiners: a shrunk communicator cannot grow) and shrinking is supported;
    otherwise ``"rebuild"`` (abort the old communicator, create a new one on ``gen{g}``).
  * ``excluded_ranks(old, new)``: old-group ranks to drop; survivors keep their relative order, so
    the shrunk ranks equal the new generation's ranks (members are sorted replica ids).
Invariant: the old communicator is aborted (never waited on) before it is dropped; NCCL's watchdog
is told to clean up, not to kill the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) unless the user
set it.

Settings this layer relies on (:data:`NCCL_ENV_DEFAULTS`, set in each process before its first
communicator unless the user set them):
  * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): a failed or timed-out collective aborts
    its communicator and the process lives on to join the next generation (1 would tear it down, 3
    and 0 leave it to us but skip the clean-up);
  * ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``: communicators are created and aborted in NCCL's
    non-blocking mode, so ``ncclCommAbort`` of a communicator whose peer died returns instead of
    waiting on the dead peer's proxy thread, and a rendezvous or a shrink that a failure interrupts
    can be abandoned (this module polls; it never blocks a stream or the host on NCCL);
  * left as they are: ``TORCH_NCCL_BLOCKING_WAIT`` (unset: ``wait()`` does not block the host; layer 1
    polls ``is_completed()`` and watches the coordinator's notices), the watchdog's heartbeat monitor
    (``TORCH_NCCL_ENABLE_MONITORING``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: it kills a process whose
    watchdog itself is stuck, the launcher then sees the replica lost), and the per-collective timeout,
    which is the group's ``timeout_s`` (``fault_tolerance.collective_timeout_s``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

SHRINK_MIN_NCCL = (2, 27, 0)
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # abort communicators on error, keep the process alive
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",  # init, abort and shrink return instead of waiting on the dead
}


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch was built with, or None on a build without NCCL."""
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
    except Exception:  # noqa: BLE001 - CPU-only builds raise various errors here
        return None
    if isinstance(v, int):  # old torch: 2xxyy or 2xxxyy encoded
        major = v // 10000 if v >= 10000 else v // 1000
        return (major, (v % 10000) // 100 if v >= 10000 else (v % 1000) // 100, v % 100)
    return tuple(int(x) for x in v)[:3]  # type: ignore[return-value]


def has_shrink_api() -> bool:
    import torch.distributed as dist

    return hasattr(dist, "shrink_group")


def shrink_supported(version: tuple[int, int, int] | None, has_api: bool) -> bool:
    return bool(has_api and version is not None and tuple(version) >= SHRINK_MIN_NCCL)


def excluded_ranks(old_members: Sequence[int], new_members: Sequence[int]) -> list[int]:
    keep = set(new_members)
    return [rank for rank, replica in enumerate(old_members) if replica not in keep]


def choose_strategy(old_members: Sequence[int], new_members: Sequence[int], *, backend: str,
                    shrink_ok: bool, old_group_usable: bool = True) -> str:
    """``"shrink"`` or ``"rebuild"`` for going from ``old_members`` to ``new_members``."""
    old, new = set(old_members), set(new_members)
    if backend == "nccl" and shrink_ok and old_group_usable and new and new < old:
        return "shrink"
    return "rebuild"


def apply_env_defaults(env: dict[str, str] | None = None) -> dict[str, str]:
    """Sets the NCCL environment this layer relies on, without overriding the user's choices."""
    env = os.environ if env is None else env
    for key, value in NCCL_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return {k: env[k] for k in NCCL_ENV_DEFAULTS}


def make_nccl_group(store: Any, rank: int, size: int, timeout_s: float, device: Any) -> Any:
    """A ProcessGroupNCCL whose communicator is connected now (eagerly), not at the first collective."""
    from torch.distributed import ProcessGroupNCCL

    apply_env_defaults()
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroupNCCL(store, rank, size, opts)
    pg.eager_connect_single_device(device)
    return pg


def shrink_nccl_group(pg: Any, excluded: list[int]) -> Any:
    """``ncclCommShrink`` the survivors out of ``pg`` (aborting its pending work); returns the new backend."""
    from torch.distributed.distributed_c10d import SHRINK_ABORT

    if not getattr(pg, "supports_shrinking", False):
        raise TypeError("this NCCL backend does not support shrinking")
    return pg.shrink(sorted(excluded), SHRINK_ABORT, None)
