"""Plain ``torch.distributed`` set-up for ``torchrun`` data parallelism (the failure-free path).

Contract: :func:`init_from_env` reads the ``torchrun`` environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), picks NCCL on GPU and gloo on CPU, and returns a :class:`DistContext`; with no
such environment it returns a single-process context and creates no process group.
:class:`StaticGroup` and :class:`CommitAll` are what the step protocol runs on without a coordinator:
one membership for good, sums on flattened copies (inputs are never changed), every vote commits.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recover.comm.backends import detect_backend
from recover.comm.reduction import DeferredReduction


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


def init_from_env(backend: str = "auto", timeout_s: float = 300.0) -> DistContext:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return DistContext(device=device)
    ctx = DistContext(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        backend=detect_backend(backend),  # the one chooser: the replica's group and its cross-replica group agree
    )
    if ctx.backend == "nccl" or torch.cuda.is_available():  # a launcher that gave each rank its own GPU
        ctx.device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())  # shows it as cuda:0
        torch.cuda.set_device(ctx.device)
    if "MASTER_ADDR" in os.environ:  # a replica that spans hosts: bind what reaches its rendezvous
        from recover.comm.netaddr import bind_gloo_towards

        bind_gloo_towards(os.environ["MASTER_ADDR"])
    dist.init_process_group(ctx.backend, timeout=timedelta(seconds=timeout_s))
    return ctx


SHUTDOWN_TIMEOUT_S = 30.0
"""How long tearing down the process group may take at the end of a run."""
abandoned: str | None = None
"""Where a teardown that did not return was waiting (see :func:`shutdown`); None: none was abandoned."""


def shutdown(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Destroys the process group, bounded: gloo's teardown can wait for good on peers that already
    exited (its threads in futex waits). One that has not returned after ``timeout_s`` is abandoned with
    one warning line naming where it waits; :data:`abandoned` says so, and ``recover``'s entry point
    then ends the process with its status at once (:func:`recover.cli.main`), never waiting on it."""
    global abandoned
    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    thread = threading.Thread(target=destroy, name="destroy-process-group", daemon=True)
    thread.start()
    if done.wait(timeout_s):
        return
    frame = sys._current_frames().get(thread.ident or -1)
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                        for f in reversed(traceback.extract_stack(frame)[-3:])) if frame else "unknown"
    abandoned = where
    print(f"recover: warning: rank {dist.get_rank() if dist.is_initialized() else '?'}: tearing down the process "
          f"group did not finish in {timeout_s:g} s (waiting in {where}; a peer that exited first?): the process "
          "ends without it", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class StaticMembership:
    """The one membership of a job without a coordinator: every process, from the start, for good."""

    generation: int
    members: tuple[int, ...]
    joined: tuple[int, ...] = ()
    speeds: None = None  # no coordinator measures speeds: the even split
    resync: bool = False


class StaticGroup:
    """The :class:`~recover.recovery.interfaces.Group` of ``recover train``: the ranks of a plain
    ``torch.distributed`` group (or this process alone), generation 0 for good.

    Collectives of several ranks work on copies (SUM over one flattened buffer per dtype); a failure is the
    backend's error, not a :class:`~recover.errors.PeerFailure`: there is no fault tolerance here
    (``recover launch`` has it), so there is never a next generation.
    """

    def __init__(self, world_size: int = 1, rank: int = 0, group: dist.ProcessGroup | None = None) -> None:
        self.membership = StaticMembership(0, tuple(range(world_size)))
        self.passed: tuple[Any, ...] = ()  # no rendezvous of another generation ever passes it by
        self.generation, self.members, self.rank = 0, self.membership.members, rank
        self._group = group
        self.device = torch.device("cpu")

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """SUM over the ranks, as new tensors; with one member the sum is the input itself (no copy: a
        committed step's update consumes it, and the next step starts from ``reset()``)."""
        if len(self.members) == 1:
            return list(tensors)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # a copy: inputs stay untouched
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset:offset + n].view_as(tensors[i])
                offset += n
        return out  # type: ignore[return-value]

    def reduction(self, tensors: Sequence[torch.Tensor], order: Sequence[int] | None = None) -> DeferredReduction:
        """Everything reduced in ``result()`` (no overlap: this is the plain trainer)."""
        return DeferredReduction(self.allreduce, tensors)

    def release(self, results: Sequence[torch.Tensor]) -> None:
        """Nothing to hand back: each reduction's copy is its own."""

    def barrier(self) -> None:
        if len(self.members) > 1:
            dist.barrier(group=self._group)

    def broadcast_into(self, buffers: Sequence[torch.Tensor], src_rank: int) -> None:
        if len(self.members) > 1:
            for b in buffers:
                dist.broadcast(b, group=self._group, group_src=src_rank)

    def next_generation(self) -> StaticGroup:
        raise RuntimeError("a static group has no next generation: membership changes need `recover launch`")

    def close(self) -> None:
        return None


class CommitAll:
    """The :class:`~recover.recovery.interfaces.Coordinator` of a job without one: every vote commits.

    Stop: ``stop_requested`` (this process got SIGTERM or SIGINT) is agreed on at every vote by a
    one-element MAX all-reduce over all the torchrun processes, so they all stop after the same step.
    """

    speeds = None  # no one measures: the even split
    left = False  # no replica leaves a job without a coordinator: a signal stops every process

    def __init__(self) -> None:
        self.stop_requested = False
        self.stopping = False
        self.committed_step = -1

    def vote_commit(self, generation: int, step: int, ids: list[int] | tuple[int, ...],
                    mb_s: float | None = None, fp: str | None = None, audit: dict[str, Any] | None = None,
                    comp_s: float | None = None, comm_s: float | None = None) -> None:
        self.stopping = self.stop_requested
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if self.stop_requested else 0.0])
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.stopping = bool(flag.item() > 0)
        self.committed_step = step
        return None

    def report_nonfinite(self, generation: int, step: int, ids: list[int]) -> None:
        """No other replica can recompute them here: the training diverged."""
        from recover.coord.client import Diverged

        raise Diverged("nonfinite", f"microbatches {ids} of step {step} have a loss or gradient that is not finite; "
                                    "the training diverged (lower the learning rate, check the data)")

    def wait_for_generation(self, after: int, timeout: float) -> None:
        raise RuntimeError("a static group has no next generation")
