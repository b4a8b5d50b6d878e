"""Fault-tolerant collectives over one membership generation (LAYER 1).

Contract: a :class:`FaultTolerantGroup` wraps the c10d process group of exactly one generation g.
Every collective
  1. works on a COPY (flattened into per-dtype buckets of buffers lent by the chain's pool until the
     caller hands the results back with ``release``): the caller's tensors are never written, so a
     collective that fails half-way (gloo had already modified 20-80% of an in-place buffer) corrupts
     nothing;
  2. is launched async and waited on while watching ``client.failure_notice(g)`` (gloo: a helper
     thread blocks in ``work.wait()``; NCCL: ``work.is_completed()`` is polled): a gloo rank blocked
     on a dead peer that is not its ring neighbour would otherwise wait for the backend timeout;
  3. on a coordinator notice or a backend error, stops waiting at once, reports to the coordinator
     (naming the members whose link probe does not answer; a failed rendezvous too),
     waits for its decision and raises ``PeerFailure(g, dead)`` naming exactly the replicas that
     are not in the next generation. The broken group is parked in a :class:`Graveyard`.
Call order after a failure: ``group = group.next_generation()``; every collective of a broken group
raises. ``next_generation`` survives further failures while the new group forms by moving on to the
generation after (the returned group's ``members`` say who is left).

Invariants: one process group per generation, rendezvoused on the coordinator's store under
``membership.prefix()`` (``gen{g}``), every entry sealed with the generation's secret
(:class:`~recover.comm.store.SealedStore`: nobody without the token can find, forge or alter them); no
global default group; nothing blocks for a backend timeout on the hot path. A group is used by one
thread at a time (the training loop's).

Replicas of several ranks (``client.ranks`` = P > 1): rank k of every member forms *lane* k, its
own group of ``len(members)`` processes (rank ``membership.rank_of(replica)`` as for P = 1),
rendezvoused under ``gen{g}/lane{k}`` (:meth:`Membership.prefix`), sealed alike: the P lanes of a
generation are independent groups.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from recover.comm.backends import default_device, detect_backend, make_process_group
from recover.comm.buffers import BufferPool
from recover.comm.graveyard import Graveyard
from recover.comm.reduction import (
    DEFAULT_BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Reduction,
    flatten_into,
    plan_buckets,
    unflatten,
)
from recover.comm.watch import POLL_MAX_S, POLL_MIN_S, Waiter, peer_failure, run_watched
from recover.coord.client import CoordinatorClient, CoordinatorLost
from recover.coord.protocol import Membership
from recover.errors import PeerFailure


class FaultTolerantGroup:
    """Collectives over generation ``membership.generation`` (see the module docstring)."""

    def __init__(self, client: CoordinatorClient, membership: Membership, pg: Any, *, backend: str,
                 device: torch.device, timeout_s: float, bucket_bytes: int, graveyard: Graveyard,
                 store: Any, pool: BufferPool | None = None) -> None:
        self.client = client
        self.membership = membership
        self.generation = membership.generation
        self.members = membership.members
        self.rank = membership.rank_of(client.replica_id)
        self.size = len(membership.members)
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.graveyard = graveyard
        self.store = store
        self.pool = pool if pool is not None else BufferPool()
        self._pg = pg
        self._shrinkable: Any = None  # NCCL: a broken communicator kept for next_generation's shrink
        self._waiter = Waiter(membership.generation)
        self._broken = False
        self._aborting: threading.Event | None = None  # set once this group's communicator is aborted
        self.passed: tuple[Membership, ...] = ()
        """Generations of the same step that failed while this replica's rendezvous formed (its first group):
        the other members may have planned the step over the first of them (see the step protocol)."""

    # ------------------------------------------------------------- forming

    @classmethod
    def create(cls, client: CoordinatorClient, membership: Membership, backend: str = "auto",
               timeout_s: float = 60.0, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               graveyard: Graveyard | None = None, device: torch.device | None = None,
               pool: BufferPool | None = None) -> FaultTolerantGroup:
        """Builds the process group of ``membership`` on its sealed store (``membership.prefix(...)``).

        If that generation fails while forming (a member died during the rendezvous), follows on
        to the coordinator's next one: the returned group's ``membership`` may be newer than the
        one passed in (its ``members`` and ``joined`` are what count).

        Raises:
            ValueError: this replica is not a member. QuorumLost, Expelled, CoordinatorLost.
        """
        if client.replica_id not in membership.members:
            raise ValueError(f"replica {client.replica_id} is not in generation {membership.generation} "
                             f"(members {list(membership.members)})")
        resolved = detect_backend(backend)
        dev = device if device is not None else default_device(resolved)
        yard = graveyard if graveyard is not None else Graveyard()
        m, deadline = membership, time.monotonic() + timeout_s
        passed: list[Membership] = []
        while True:
            try:
                client.entering(m.generation)
                with client.activity("wait"):
                    pg, store = _rendezvous(client, m, resolved, dev, timeout_s, yard)
                break
            except PeerFailure:  # bounded: each retry needs a newer generation within the deadline
                passed.append(m)
                m = client.wait_for_generation(m.generation, max(0.0, deadline - time.monotonic()))
        group = cls(client, m, pg, backend=resolved, device=dev, timeout_s=timeout_s,
                    bucket_bytes=bucket_bytes, graveyard=yard, store=store, pool=pool)
        group.passed = tuple(p for p in passed if p.step == m.step)
        return group

    def next_generation(self, timeout_s: float | None = None) -> FaultTolerantGroup:
        """Retires this group and returns one for the coordinator's next generation.

        Waits for a generation newer than this one; if that one fails while forming, moves on to
        the next (see :meth:`create`). On NCCL, a direct successor with no joiners is made by
        shrinking this group's communicator where supported (see :mod:`recover.comm.nccl`), else
        by a new communicator, which is built only once the old one is aborted (its kernels and
        buffers would compete with the new one's); a shrunk one's parent is aborted after the shrink.
        Raises QuorumLost, Expelled, CoordinatorLost or TimeoutError (no group can form).
        """
        parent, self._shrinkable = self._shrinkable, None
        if parent is None and self.backend == "nccl":
            parent, self._pg = self._pg, None
        self._retire()
        wait_s = timeout_s if timeout_s is not None else self.timeout_s
        if parent is not None and not _shrink_possible():
            self._abort(parent)  # nothing can be shrunk: abort now, while the coordinator decides
            parent = None
        try:
            m = self.client.wait_for_generation(self.generation, wait_s)
            if parent is not None and m.generation == self.generation + 1:
                try:
                    self.client.entering(m.generation)
                    pg = _try_shrink(self, parent, m)
                except PeerFailure:
                    pg, m = None, self.client.wait_for_generation(m.generation, wait_s)
                if pg is not None:
                    return FaultTolerantGroup(self.client, m, pg, backend=self.backend, device=self.device,
                                              timeout_s=self.timeout_s, bucket_bytes=self.bucket_bytes,
                                              graveyard=self.graveyard, store=self.store, pool=self.pool)
            if parent is not None:
                self._abort(parent)  # rebuilding: the old communicator goes first
                parent = None
            self._await_abort(wait_s)
            group = FaultTolerantGroup.create(self.client, m, self.backend, self.timeout_s,
                                              bucket_bytes=self.bucket_bytes, graveyard=self.graveyard,
                                              device=self.device, pool=self.pool)
            group.passed = ()  # a survivor's in-step recovery plans from its own plan, not from these
            return group
        finally:
            if parent is not None:  # shrunk (every rank aborts the parent), or an error on the way
                self.graveyard.park(self.generation, parent, abort=True)

    def close(self) -> None:
        """Retires the group (released on the graveyard's thread). Idempotent."""
        self._retire()
        old, self._shrinkable = self._shrinkable, None
        if old is not None:
            self._abort(old)

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def process_group(self) -> Any:
        """The raw c10d backend of this generation (None once retired). For measurements and
        debugging only: work issued on it directly has none of this class's guarantees."""
        return self._pg

    # ------------------------------------------------------------- collectives

    def allreduce(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """SUM over members of each tensor, returned as new tensors (views into reduced buckets).

        The inputs are never modified. The results' buffers are lent by the chain's pool: hand them back
        with :meth:`release` once consumed, so that a later collective reuses them; results never
        released are simply never reused. Raises PeerFailure if a member fails.
        """
        if not tensors:
            self._check("all-reduce")
            return []
        return self.reduction(tensors).result()  # its first launch checks the group

    def reduction(self, tensors: Sequence[Tensor], order: Sequence[int] | None = None) -> Reduction:
        """An all-reduce of a copy of ``tensors`` whose buckets (planned along ``order``) are launched as
        the caller marks their tensors final (:mod:`recover.comm.reduction`): launched from autograd
        hooks, it overlaps a backward. Nothing is launched until then; ``result()`` raises PeerFailure
        if a member fails, as :meth:`allreduce` does; its results are released as :meth:`allreduce`'s are."""
        return _GroupReduction(self, tensors, order)

    def broadcast(self, tensors: Sequence[Tensor], src_rank: int) -> list[Tensor]:
        """Copies of rank ``src_rank``'s ``tensors`` on every rank (others pass tensors of the same
        shapes and dtypes; their values are ignored and never modified)."""
        self._check("broadcast")
        if not 0 <= src_rank < self.size:
            raise ValueError(f"src_rank {src_rank} is outside 0..{self.size - 1}")
        if not tensors:
            return []
        buckets = plan_buckets(tensors, self.bucket_bytes)
        flats: list[Tensor] = []
        for idx in buckets:
            ts = [tensors[i] for i in idx]
            flat = self.pool.take(sum(t.numel() for t in ts), ts[0].dtype, ts[0].device)
            flats.append(flatten_into(flat, ts) if self.rank == src_rank else flat)
        self.broadcast_into(flats, src_rank)
        return unflatten(tensors, buckets, flats)

    def broadcast_into(self, buffers: Sequence[Tensor], src_rank: int) -> None:
        """In-place broadcast of caller-owned contiguous buffers (no copy; for bulk state transfer).
        On failure the buffers hold garbage and PeerFailure is raised."""
        self._check("broadcast")
        works = []
        for buf in buffers:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank = src_rank
            works.append(self._launch("broadcast", lambda b=buf, o=opts: self._pg.broadcast([b], o), buffers))
        self._wait(works, "broadcast", buffers)

    def release(self, results: Sequence[Tensor]) -> None:
        """The caller is done with ``results`` of a collective of this group chain (:meth:`allreduce`,
        :meth:`broadcast`, a reduction's ``result()``) and with every view of them: their buffers may be
        reused. Call it once, after the last use (see :mod:`recover.comm.buffers`)."""
        self.pool.release(results)

    def barrier(self) -> None:
        """Returns once every member reached it; raises PeerFailure if one fails first."""
        self.release(self.allreduce([torch.zeros(1, device=self.device)]))

    # ------------------------------------------------------------- internals

    def _check(self, what: str) -> None:
        if self._pg is None or self._broken:
            raise RuntimeError(f"{what} on a retired or broken group of generation {self.generation}; "
                               "call next_generation() after a PeerFailure")
        if self.client.failure_notice(self.generation):
            raise self._fail(f"generation {self.generation} was declared failed before the {what}", False)

    def _launch(self, what: str, start: Any, buffers: Sequence[Tensor]) -> Any:
        try:
            return start()
        except RuntimeError as exc:
            self.pool.evict(buffers)
            raise self._fail(f"backend error launching {what}: {exc}", True) from None

    def _wait(self, works: list[Any], what: str, buffers: Sequence[Tensor]) -> None:
        with self.client.activity("wait"):  # blocked for the others: not a hang of ours
            self._wait_works(works, what, buffers)

    def _wait_works(self, works: list[Any], what: str, buffers: Sequence[Tensor]) -> None:
        """Waits for ``works`` while watching for notices; on a notice or an error, evicts
        ``buffers`` from the pool (the parked work may still write into them), raises PeerFailure.

        gloo: a helper thread blocks in ``work.wait()`` and sets an event that the coordinator
        client also sets on every notice, so this thread sleeps until one of them happens (no
        polling wake-ups competing with gloo for the CPU). NCCL, whose ``wait()`` does not block the
        host, is polled with ``is_completed()`` at 50 us .. 1 ms intervals.
        """
        deadline = time.monotonic() + self.timeout_s
        pause = POLL_MIN_S
        pending = list(works)
        wake = threading.Event() if self.backend == "gloo" else None
        if wake is not None:
            self.client.add_waker(wake)
            self._waiter.watch(works, wake)
        try:
            while True:
                if wake is not None:
                    wake.clear()
                pending = [w for w in pending if not w.is_completed()]
                if not pending:
                    break
                if self.client.failure_notice(self.generation):
                    self.pool.evict(buffers)
                    raise self._fail(f"coordinator notice during {what}", False, works, pending)
                if self.client.lost is not None:
                    self.pool.evict(buffers)
                    self._retire(True, works, pending)
                    raise CoordinatorLost(f"coordinator lost during {what}: {self.client.lost}")
                left = deadline - time.monotonic()
                if left < 0:
                    self.pool.evict(buffers)
                    raise self._fail(f"{what} exceeded {self.timeout_s:g} s", True, works, pending, timed_out=True)
                if wake is not None:
                    wake.wait(min(left, 0.5))
                else:
                    time.sleep(pause)
                    pause = min(pause * 1.5, POLL_MAX_S)
        finally:
            if wake is not None:
                self.client.remove_waker(wake)
        for w in works:
            try:
                w.wait()
            except RuntimeError as exc:
                first = str(exc).splitlines()[0][:200]
                del w
                self.pool.evict(buffers)
                raise self._fail(f"backend error during {what}: {first}", True, works,
                                 timed_out=_is_timeout(first)) from None

    def _fail(self, reason: str, report: bool, *work_lists: list[Any], timed_out: bool = False) -> PeerFailure:
        """Retires this broken group, waits for the coordinator's decision, builds the PeerFailure.

        A failed collective it reports names the members this replica cannot reach (:meth:`unreachable`), so
        that when every member is alive the coordinator can tell which links broke (:mod:`recover.coord.links`)."""
        suspects = self.unreachable() if report and not self.client.failure_notice(self.generation) else []
        self._retire(True, *work_lists)
        return peer_failure(self.client, self.generation, reason, report, self.timeout_s, timed_out, suspects)

    def unreachable(self) -> list[int]:
        """The other members whose probe listener (address in this generation's store) does not answer."""
        return _unreachable(self.client, self.store, self.members)

    def _withhold(self, what: str) -> None:
        """Fault injection (``--cut``): the link to a member is broken, so this collective never
        completes; wait as a member whose data cannot get through would, until a notice or the timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self.client.activity("wait"):
            while time.monotonic() < deadline:
                if self.client.failure_notice(self.generation) or self.client.lost is not None:
                    raise self._fail(f"coordinator notice during {what}", False)
                time.sleep(0.05)
        cut = [r for r in self.members if self.client.perturb.unreachable(r)]
        raise self._fail(f"{what} exceeded {self.timeout_s:g} s (link to {cut} cut)", True, timed_out=True)

    def _retire(self, broken: bool = False, *work_lists: list[Any]) -> None:
        """Parks the process group and any pending work (emptying the caller's lists): a group
        with a stuck operation must be released on the graveyard's thread, never on ours. A broken
        NCCL communicator is aborted at once, or kept aside for ``next_generation`` to shrink where
        NCCL can shrink it."""
        self._broken = self._broken or broken
        pg, self._pg = self._pg, None
        self._waiter.stop()
        works = [w for ws in work_lists for w in ws]
        for ws in work_lists:
            ws.clear()
        if pg is not None and self.backend == "nccl" and broken and _shrink_possible():
            self._shrinkable, pg = pg, None
        if pg is not None or works:
            abort = self.backend == "nccl" and self._broken
            aborting = self.graveyard.park(self.generation, *([pg] if pg is not None else []), *works, abort=abort)
            if abort and pg is not None:
                self._aborting = aborting

    def _abort(self, pg: Any) -> None:
        """Parks communicator ``pg`` for abort now (the caller drops its reference); see :meth:`_await_abort`."""
        self._aborting = self.graveyard.park(self.generation, pg, abort=True)

    def _await_abort(self, bound_s: float) -> None:
        """Waits (at most ``bound_s``) until this group's communicator, parked for abort, is aborted."""
        if self._aborting is not None:
            self._aborting.wait(bound_s)


class _GroupReduction(Reduction):
    """A :class:`~recover.comm.reduction.Reduction` on one generation's group: pooled copies, launches
    that turn a backend error into PeerFailure (kept for ``result()``), a wait that watches notices."""

    def __init__(self, group: FaultTolerantGroup, tensors: Sequence[Tensor], order: Sequence[int] | None) -> None:
        first = min(FIRST_BUCKET_BYTES, group.bucket_bytes) if order is not None else None  # streamed: start early
        super().__init__(tensors, order, group.bucket_bytes, first)
        self.group = group
        self.withheld = any(group.client.perturb.unreachable(r) for r in group.members)  # an injected broken link

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.group.pool.take(numel, dtype, device)

    def _start(self, flat: Tensor) -> Any:
        g = self.group
        if not self.works:  # the first bucket: the group may have failed since the reduction began
            g._check("all-reduce")
        if self.withheld:
            return None
        return g._launch("all-reduce", lambda: g._pg.allreduce([flat]), self.flats)

    def _finish(self, works: list[Any], flats: list[Tensor]) -> None:
        if self.withheld:
            self.group._withhold("all-reduce")
        self.group._wait(works, "all-reduce", flats)


def _is_timeout(error: str) -> bool:
    """Whether a backend error says the operation ran out of time (gloo: "Timed out waiting ...", or
    "Application timeout caused pair closure" when another operation on the pair timed out first)."""
    text = error.lower()
    return "timed out" in text or "timeout" in text


def _shrink_possible() -> bool:
    """Whether this process's torch and NCCL can shrink a communicator at all."""
    from recover.comm import nccl

    return nccl.shrink_supported(nccl.nccl_version(), nccl.has_shrink_api())


def _try_shrink(old: FaultTolerantGroup, old_pg: Any, m: Membership) -> Any | None:
    """NCCL only: the shrunk communicator for ``m`` (ready: :func:`recover.comm.nccl.make_ready`), or
    None to rebuild instead."""
    from recover.comm import nccl

    if nccl.choose_strategy(old.members, m.members, backend=old.backend, shrink_ok=_shrink_possible()) != "shrink":
        return None
    excluded = nccl.excluded_ranks(old.members, m.members)
    pg = run_watched(old.client, m.generation, old.graveyard, old.timeout_s,
                     lambda: nccl.shrink_nccl_group(old_pg, excluded, old.device, old.timeout_s), "shrink")
    if pg is not None and (pg.rank() != m.rank_of(old.client.replica_id) or pg.size() != m.size):
        old.graveyard.park(m.generation, pg, abort=True)
        return None
    return pg


def _check_descriptors(client: CoordinatorClient, g: int, timeout_s: float) -> None:
    """A process that cannot open one more socket (out of file descriptors) cannot join generation ``g``: it
    reports the failure at once (the store client would retry its connection for ``timeout_s``); its
    reports then find nobody, and the coordinator fences it as the fault (:mod:`recover.coord.barren`)."""
    try:
        socket.socket().close()
    except OSError as exc:
        raise peer_failure(client, g, f"rendezvous of generation {g} impossible here: {exc.strerror or exc} "
                                      f"(errno {exc.errno})", True, timeout_s) from None


def _rendezvous(client: CoordinatorClient, m: Membership, backend: str, device: torch.device,
                timeout_s: float, yard: Graveyard) -> tuple[Any, Any]:
    """Builds generation ``m``'s process group on a helper thread while watching for notices."""
    from torch.distributed import TCPStore

    from recover.comm.store import SealedStore

    g = m.generation
    _check_descriptors(client, g, timeout_s)
    # A fresh store client per generation: a construction abandoned mid-rendezvous keeps its own.
    prefix = m.prefix(getattr(client, "rank", 0), getattr(client, "ranks", 1))
    try:
        tcp = TCPStore(m.store_host, m.store_port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        reason = f"rendezvous of generation {g} failed: {first}"
        raise peer_failure(client, g, reason, True, timeout_s) from None
    store = SealedStore(tcp, prefix, m.secret)
    rank = m.rank_of(client.replica_id)
    err: list[BaseException] = []

    def build() -> Any:
        try:
            store.set(f"probe/{client.replica_id}", client.probe_address())  # see FaultTolerantGroup.unreachable
            return make_process_group(backend, store, rank, m.size, timeout_s, device)
        except BaseException as exc:
            err.append(exc)
            raise

    pg = run_watched(client, g, yard, timeout_s, build, "rendezvous")
    if pg is None:
        first = str(err[0]).strip().splitlines()[0][:200] if err and str(err[0]).strip() else "unknown error"
        reason = f"rendezvous of generation {g} failed: {first}"
        # whom it could not connect to: the members that published a probe address and do not answer it
        suspects = [] if client.failure_notice(g) else _unreachable(client, store, m.members)
        raise peer_failure(client, g, reason, True, timeout_s, _is_timeout(first), suspects)
    return pg, store


def _unreachable(client: CoordinatorClient, store: Any, members: Sequence[int]) -> list[int]:
    """The other ``members`` whose probe listener (its address under ``probe/R`` in ``store``) does not answer."""
    peers: dict[int, str] = {}
    for r in members:
        key = f"probe/{r}"
        if r != client.replica_id and store is not None and store.check([key]):
            peers[r] = store.get(key).decode()
    return client.unreachable(peers)
