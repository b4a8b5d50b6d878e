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
  * ``nccl_op_timeout_s(collective_timeout_s)``: NCCL's own per-operation timeout, well above layer
    1's deadline, so that layer 1 (which watches the coordinator too) always acts first.
A communicator is handed out READY (:func:`make_ready`): in non-blocking mode ``eager_connect`` and
``shrink`` only start ``ncclCommInitRankConfig`` / ``ncclCommShrink``, and c10d would finish the wait
inside the first collective (on the training thread, bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``).
So the build (on layer 1's watched helper thread) runs one 1-element all-reduce of ones, polls it to
completion, checks the sum, then polls ``_is_initialized()`` where the backend has it, all within
the group's timeout; it raises :class:`CommNotReady` otherwise. (c10d flips ``_is_initialized()``
only when something asks for the communicator, so it is checked after the all-reduce, not instead.)
Invariant: a communicator is aborted (never waited on) before it is dropped: the old one of a
generation, and one that never became ready; NCCL's watchdog is told to clean up, not to kill the
process, unless the user set otherwise.

Settings this layer relies on (:func:`env_defaults`; ``apply_env_defaults`` never overrides a value
the user set). NCCL and c10d read most of them ONCE per process (NCCL caches its parameters at first
use, c10d caches ``TORCH_NCCL_USE_COMM_NONBLOCKING`` / ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` in statics), so
a worker must call ``apply_env_defaults(collective_timeout_s=...)`` before its first NCCL process
group of any kind (intra-replica groups included); ``make_nccl_group`` calls it too, which is enough
only when layer 1's group is the process's first NCCL use:
  * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): a failed or timed-out collective aborts
    its communicator and the process lives on to join the next generation (1 would tear it down, 3
    and 0 leave it to us but skip the clean-up);
  * ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``: communicators are created and aborted in NCCL's
    non-blocking mode, so ``ncclCommAbort`` of a communicator whose peer died returns instead of
    waiting on the dead peer's proxy thread, and a rendezvous or a shrink that a failure interrupts
    can be abandoned (this module polls; it never blocks a stream or the host on NCCL);
  * ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` = the collective timeout (whole seconds, at least 1): bounds
    c10d's own waits on a non-blocking communicator (initialisation, abort), 30 min when unset;
  * ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``: a CUDA error seen by the watchdog fails the work instead of
    being rethrown on the watchdog thread, which would end the process;
  * ``NCCL_NVLS_ENABLE=0``: NVLink SHARP buffers cost extra device memory per communicator (layer 1
    builds one per generation), and nvidia-resiliency-ext's in-process restart needs NVLS off for
    ``ncclCommAbort`` to work;
  * ``NCCL_RUNTIME_CONNECT=0``: NCCL connects every peer while the communicator is built (inside the
    watched build), not lazily in the first large reduction after a recovery; costs init time and
    connection buffers up front;
  * left as they are: ``TORCH_NCCL_BLOCKING_WAIT`` (unset: ``wait()`` does not block the host; layer 1
    polls ``is_completed()`` and watches the coordinator's notices), the watchdog's heartbeat monitor
    (``TORCH_NCCL_ENABLE_MONITORING``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: it kills a process whose
    watchdog itself is stuck, the launcher then sees the replica lost).
The per-collective NCCL timeout is not an environment setting: ``make_nccl_group`` gives each
communicator ``nccl_op_timeout_s(timeout_s)`` (2 x the group's timeout + 60 s), so the watchdog's
timeout never races layer 1's deadline (``fault_tolerance.collective_timeout_s``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from datetime import timedelta
from typing import Any

from recover.errors import RecoverError

SHRINK_MIN_NCCL = (2, 27, 0)
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # abort communicators on error, keep the process alive
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",  # init, abort and shrink return instead of waiting on the dead
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",  # a CUDA error fails the work; the watchdog does not end the process
    "NCCL_NVLS_ENABLE": "0",  # no NVLS buffers per communicator; abort works
    "NCCL_RUNTIME_CONNECT": "0",  # connect every peer while the (watched) build runs
}
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
NCCL_OP_TIMEOUT_MARGIN_S = 60.0
READY_POLL_MIN_S, READY_POLL_MAX_S = 1e-4, 1e-2


class CommNotReady(RecoverError):
    """A new (or shrunk) NCCL communicator that did not become usable within its bound; it has been
    aborted. Raised on the build's helper thread; the rendezvous turns it into a failure report."""


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


def env_defaults(collective_timeout_s: float | None = None) -> dict[str, str]:
    """The settings of the module docstring; with ``collective_timeout_s``, also c10d's non-blocking
    timeout (whole seconds, rounded up, at least 1)."""
    env = dict(NCCL_ENV_DEFAULTS)
    if collective_timeout_s is not None:
        env[NONBLOCKING_TIMEOUT_ENV] = str(max(1, math.ceil(collective_timeout_s)))
    return env


def apply_env_defaults(env: MutableMapping[str, str] | None = None, *,
                       collective_timeout_s: float | None = None) -> dict[str, str]:
    """Sets :func:`env_defaults` in ``env`` (default ``os.environ``) without overriding the user's
    values; returns the values in effect. Call before the process's first NCCL use (module docstring)."""
    env = os.environ if env is None else env
    wanted = env_defaults(collective_timeout_s)
    for key, value in wanted.items():
        env.setdefault(key, value)
    return {k: env[k] for k in wanted}


def nccl_op_timeout_s(collective_timeout_s: float) -> float:
    """NCCL's per-operation timeout for a group whose own deadline is ``collective_timeout_s``: far
    enough above it that layer 1 always gives up first (and reports to the coordinator)."""
    return 2.0 * collective_timeout_s + NCCL_OP_TIMEOUT_MARGIN_S


def make_nccl_group(store: Any, rank: int, size: int, timeout_s: float, device: Any) -> Any:
    """A ProcessGroupNCCL whose communicator is connected and ready now (see :func:`make_ready`), not
    at the first collective. Raises CommNotReady (the communicator aborted) after ``timeout_s``."""
    from torch.distributed import ProcessGroupNCCL

    apply_env_defaults(collective_timeout_s=timeout_s)
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timedelta(seconds=nccl_op_timeout_s(timeout_s))  # private, as new_group sets it: loud if renamed
    return make_ready(ProcessGroupNCCL(store, rank, size, opts), device, timeout_s, connect=True)


def shrink_nccl_group(pg: Any, excluded: list[int], device: Any, timeout_s: float) -> Any:
    """``ncclCommShrink`` the survivors out of ``pg`` (aborting its pending work); returns the new
    backend once it is ready (:func:`make_ready`). ``pg`` itself is left to the caller to abort."""
    from torch.distributed.distributed_c10d import SHRINK_ABORT

    if not getattr(pg, "supports_shrinking", False):
        raise TypeError("this NCCL backend does not support shrinking")
    return make_ready(pg.shrink(sorted(excluded), SHRINK_ABORT, None), device, timeout_s)


def make_ready(pg: Any, device: Any, timeout_s: float, *, connect: bool = False) -> Any:
    """Returns ``pg`` once :func:`await_ready` says its communicator works (``connect``: after starting
    it with ``eager_connect_single_device``, which in non-blocking mode only starts it). Otherwise
    aborts it and raises CommNotReady whose traceback holds no reference to it, so that it is dropped
    here (on the build's helper thread), never on the thread that later handles the error. The caller
    passes ``pg`` as a temporary, not as a local variable that its own traceback frame would keep."""
    try:
        if connect:
            pg.eager_connect_single_device(device)
        await_ready(pg, device, pg.size(), timeout_s)
        return pg
    except CommNotReady as exc:
        failure = exc
    except RuntimeError as exc:
        failure = CommNotReady(f"NCCL communicator not ready: {_first_line(exc)}")
    _abort_quietly(pg)
    del pg
    failure.__context__ = None  # no traceback frame may keep the communicator alive
    raise failure.with_traceback(None)


def await_ready(pg: Any, device: Any, size: int, timeout_s: float) -> None:
    """Blocks (this thread only) until ``pg``'s communicator has summed a 1-element tensor of ones to
    ``size`` on ``device`` and, where the backend tells, reports itself initialised; all within
    ``timeout_s``. Raises CommNotReady otherwise."""
    import torch

    deadline = time.monotonic() + timeout_s
    probe = torch.ones(1, device=device)
    try:
        work = pg.allreduce([probe])  # in non-blocking mode c10d waits here for the init to finish
    except RuntimeError as exc:
        raise CommNotReady(f"NCCL communicator not ready: its first all-reduce failed: {_first_line(exc)}") from None
    _poll(work.is_completed, deadline, timeout_s, "its first all-reduce did not complete")
    try:
        work.wait()  # NCCL: orders the current stream after the all-reduce; raises if it failed
    except RuntimeError as exc:
        raise CommNotReady(f"NCCL communicator not ready: its first all-reduce failed: {_first_line(exc)}") from None
    del work
    initialized = getattr(pg, "_is_initialized", None)
    if initialized is not None:
        _poll(initialized, deadline, timeout_s, "_is_initialized() stayed False")
    total = float(probe.item())
    if total != size:
        raise CommNotReady(f"NCCL communicator not ready: its first all-reduce summed to {total:g}, not {size}")


def _poll(done: Callable[[], bool], deadline: float, timeout_s: float, what: str) -> None:
    pause = READY_POLL_MIN_S
    while not done():
        if time.monotonic() >= deadline:
            raise CommNotReady(f"NCCL communicator not ready after {timeout_s:g} s: {what}")
        time.sleep(pause)
        pause = min(pause * 1.5, READY_POLL_MAX_S)


def _abort_quietly(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - a communicator that never formed may refuse; it is dropped anyway
        pass


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]
