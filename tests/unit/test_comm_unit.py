"""Layer-1 pieces without killing anything: buckets, backend/NCCL strategy choice, the graveyard,
and a 2-replica gloo group in one process (threads) for dtypes, broadcast and state transfer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from recover.comm import (
    BufferPool,
    FaultTolerantGroup,
    Graveyard,
    StateTransferError,
    graveyard,
    nccl,
    plan_buckets,
    receive_state,
    send_state,
)
from recover.comm.backends import resolve_backend
from recover.comm.transfer import FORMAT, _broadcast_bytes, checksum
from recover.coord import Coordinator, CoordinatorClient
from recover.errors import ConfigError


def test_plan_buckets_groups_by_dtype_and_size() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(100), torch.zeros(1)]
    assert plan_buckets(ts, bucket_bytes=80) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(ts, bucket_bytes=1 << 20) == [[0, 1], [2], [3, 4]]
    assert plan_buckets([], 10) == []


CPU = torch.device("cpu")


def test_buffer_pool_lends_a_buffer_again_only_once_released() -> None:
    pool = BufferPool(per_key=2)
    a = pool.take(8, torch.float32, CPU)
    results = [a[:4].view(2, 2), a[4:]]  # a collective's outputs: views into its buffer
    b = pool.take(8, torch.float32, CPU)
    assert b.data_ptr() != a.data_ptr()
    pool.release(results)
    assert pool.take(8, torch.float32, CPU) is a  # released: lent again
    assert pool.take(8, torch.float32, CPU) is not a  # and to one borrower at a time
    assert pool.take(8, torch.float64, CPU).dtype == torch.float64


def test_buffer_pool_never_lends_evicted_or_foreign_tensors() -> None:
    pool = BufferPool(per_key=2)
    a = pool.take(8, torch.float32, CPU)
    pool.evict([a])  # a broken collective may still write into ``a``
    mine = torch.zeros(8)
    pool.release([a, mine])
    taken = [pool.take(8, torch.float32, CPU) for _ in range(3)]
    assert all(t is not a and t is not mine for t in taken)


def test_buffer_pool_forgets_its_oldest_loan_when_a_key_is_full() -> None:
    pool = BufferPool(per_key=1)
    a = pool.take(8, torch.float32, CPU)  # never released
    b = pool.take(8, torch.float32, CPU)  # the key is full: ``a`` is forgotten, never lent again
    pool.release([a])
    c = pool.take(8, torch.float32, CPU)  # ``b`` still lent: a fresh one, and ``b`` is forgotten
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    pool.release([b, c[1:3]])
    assert pool.take(8, torch.float32, CPU) is c


def test_resolve_backend() -> None:
    assert resolve_backend("auto", cuda_available=False, nccl_available=False) == "gloo"
    assert resolve_backend("auto", cuda_available=True, nccl_available=True) == "nccl"
    assert resolve_backend("gloo", cuda_available=True, nccl_available=True) == "gloo"
    with pytest.raises(ConfigError, match="backend='nccl' needs CUDA"):
        resolve_backend("nccl", cuda_available=False, nccl_available=False)
    with pytest.raises(ConfigError, match="not one of"):
        resolve_backend("mpi", cuda_available=False, nccl_available=False)


def test_nccl_strategy_selection_without_a_gpu() -> None:
    assert nccl.shrink_supported((2, 27, 3), True) and nccl.shrink_supported((2, 28, 0), True)
    assert not nccl.shrink_supported((2, 26, 5), True)
    assert not nccl.shrink_supported((2, 27, 3), False) and not nccl.shrink_supported(None, True)
    kw: dict[str, Any] = {"backend": "nccl", "shrink_ok": True}
    assert nccl.choose_strategy([0, 1, 2, 3], [0, 2, 3], **kw) == "shrink"
    assert nccl.choose_strategy([0, 1, 2], [0, 1, 2, 5], **kw) == "rebuild"  # a joiner: cannot shrink
    assert nccl.choose_strategy([0, 1, 2], [0, 1, 2], **kw) == "rebuild"  # same members (vote disagreement)
    assert nccl.choose_strategy([0, 1], [], **kw) == "rebuild"
    assert nccl.choose_strategy([0, 1, 2], [0, 2], backend="nccl", shrink_ok=False) == "rebuild"
    assert nccl.choose_strategy([0, 1, 2], [0, 2], backend="gloo", shrink_ok=True) == "rebuild"
    assert nccl.excluded_ranks([2, 5, 7, 9], [2, 7]) == [1, 3]
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl.apply_env_defaults(env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's choice wins
    assert nccl.apply_env_defaults({}) == nccl.NCCL_ENV_DEFAULTS  # more in test_comm_nccl.py
    assert nccl.nccl_version() is None or len(nccl.nccl_version() or ()) == 3
    assert isinstance(nccl.has_shrink_api(), bool)


class _Probe:
    """Records which thread ran its destructor."""

    ran_on: list[str] = []

    def __del__(self) -> None:
        _Probe.ran_on.append(threading.current_thread().name)


class _SlowToDie:
    """A destructor that blocks until ``gate`` is set (a gloo group with a stuck operation)."""

    def __init__(self, entered: threading.Event, gate: threading.Event) -> None:
        self.entered, self.gate = entered, gate

    def __del__(self) -> None:
        self.entered.set()
        self.gate.wait(30)


class _Communicator:
    aborted_on: str | None = None

    def abort(self) -> None:
        self.aborted_on = threading.current_thread().name


def _until(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    return bool(predicate())


def _stuck_thread(gate: threading.Event) -> threading.Thread:
    t = threading.Thread(target=gate.wait, daemon=True)  # like an abandoned rendezvous
    t.start()
    return t


def test_graveyard_releases_off_the_callers_thread_and_never_waits_for_a_parked_thread() -> None:
    yard, gate = Graveyard(), threading.Event()
    try:
        yard.park(1, _stuck_thread(gate))
        yard.park(2, _Probe())  # its last reference is the caller's until park() returns
        assert yard.parked == 2
        assert _until(lambda: yard.released == 2)  # while the parked thread still runs: never joined
        assert _Probe.ran_on == ["recover-graveyard"]
    finally:
        gate.set()


def test_graveyard_aborts_wait_for_no_parked_thread_and_no_blocking_destructor() -> None:
    yard, gate, entered = Graveyard(), threading.Event(), threading.Event()
    try:
        yard.park(1, _stuck_thread(gate))
        yard.park(1, _SlowToDie(entered, gate))
        assert entered.wait(10)  # the releaser is now blocked in that destructor
        comm = _Communicator()
        assert yard.park(2, comm, abort=True).wait(10)  # returns long before the gate opens
        assert comm.aborted_on == "recover-graveyard-abort" and yard.aborted == 1
        assert not gate.is_set() and yard.released == 1  # the thread's batch; the destructor still blocks
        del comm
    finally:
        gate.set()
    assert _until(lambda: yard.released == 3)


def test_settle_waits_for_a_release_but_skips_a_batch_held_past_the_moment() -> None:
    """A process's exit waits for its retired groups' release, but not for a batch something else still holds
    past ``MOMENT_S`` (here a parked thread and the box it fills, as ``run_watched`` parks them)."""
    yard, gate = Graveyard(), threading.Event()
    try:
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda out: gate.wait(), args=(box,), daemon=True)
        t.start()
        yard.park(1, t, box)
        del t, box
        kept = _Communicator()
        yard.park(2, kept)  # the caller still holds it: neither released nor skipped yet
        assert not yard.settle(0.2)
        del kept
        start = time.monotonic()
        assert yard.settle(10) and time.monotonic() - start < graveyard.MOMENT_S + 2
        assert yard.released == 1  # the box is skipped while its thread runs...
    finally:
        gate.set()
    assert _until(lambda: yard.released == 2)  # ...and released once it ends
    assert yard.settle(0)


@pytest.fixture
def pair() -> Iterator[list[FaultTolerantGroup]]:
    """Two replicas of one generation, each a thread of this process, on a real gloo group."""
    coord = Coordinator(token="t", expected_replicas=2).start()
    cs = [CoordinatorClient("127.0.0.1", coord.port, "t", r) for r in (0, 1)]
    groups = run_pair([lambda c=c: FaultTolerantGroup.create(c, c.register(), backend="gloo", timeout_s=20,
                                                              bucket_bytes=64) for c in cs])
    try:
        yield groups
    finally:
        for g in groups:
            g.close()
        for c in cs:
            c.close()
        coord.stop()


def run_pair(fns: list[Any]) -> list[Any]:
    out: list[Any] = [None, None]

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[i] = exc

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
        assert not t.is_alive()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def test_allreduce_broadcast_barrier_on_copies(pair: list[FaultTolerantGroup]) -> None:
    def inputs(r: int) -> list[torch.Tensor]:
        return [torch.full((4, 5), float(r + 1)), torch.arange(30, dtype=torch.float64).view(2, 15) * (r + 1),
                torch.tensor([r, 10 * r]), torch.ones(3).t()]

    ins = [inputs(0), inputs(1)]
    copies = [[t.clone() for t in x] for x in ins]
    outs = run_pair([lambda g=g, x=x: g.allreduce(x) for g, x in zip(pair, ins, strict=True)])
    for out in outs:
        for got, a, b in zip(out, ins[0], ins[1], strict=True):
            assert got.shape == a.shape and got.dtype == a.dtype and torch.equal(got, a + b)
    for x, c in zip(ins, copies, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(x, c, strict=True))  # inputs untouched
    outs = run_pair([lambda g=g, x=x: g.broadcast(x, src_rank=1) for g, x in zip(pair, ins, strict=True)])
    assert all(torch.equal(o, s) for out in outs for o, s in zip(out, ins[1], strict=True))
    run_pair([g.barrier for g in pair])
    assert pair[0].rank == 0 and pair[1].rank == 1 and pair[0].size == 2 and pair[0].generation == 1


def test_results_held_are_never_overwritten_and_released_ones_are_reused(pair: list[FaultTolerantGroup]) -> None:
    """The invariant the pool keeps for a reduction: a later collective never writes into results still in
    use (here: a view of them, as ``p.grad`` would be); once released, their memory serves the next one."""
    def reduce(value: float) -> list[list[torch.Tensor]]:
        return run_pair([lambda g=g: g.allreduce([torch.full((6,), value)]) for g in pair])

    held = [out[0][2:] for out in reduce(1.0)]  # the outputs are dropped; a view of each lives on
    again = reduce(5.0)
    assert all(torch.equal(h, torch.full((4,), 2.0)) for h in held)  # not overwritten by the second
    assert all(a[0].data_ptr() != h.untyped_storage().data_ptr() for a, h in zip(again, held, strict=True))
    for g, h in zip(pair, held, strict=True):
        g.release([h])
    third = reduce(7.0)
    assert all(torch.equal(t[0], torch.full((6,), 14.0)) for t in third)
    assert [t[0].data_ptr() for t in third] == [h.untyped_storage().data_ptr() for h in held]  # reused


def test_state_transfer_is_bitwise_and_checked(pair: list[FaultTolerantGroup]) -> None:
    state = {"w": torch.randn(17, 3), "h": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7),
             "m": torch.tensor([True, False, True]), "e": torch.empty(0, 2), "c": torch.randn(2, dtype=torch.complex64)}
    digest, got = run_pair([lambda: send_state(pair[0], state), lambda: receive_state(pair[1], 0)])
    assert list(got) == list(state) and len(digest) == 16
    for k in state:
        assert got[k].dtype == state[k].dtype and got[k].shape == state[k].shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8))

    def bad_sender(header: dict[str, Any], payload: torch.Tensor | None) -> None:
        _broadcast_bytes(pair[0], json.dumps(header).encode(), 0)
        if payload is not None:
            pair[0].broadcast_into([payload], 0)

    entry = {"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    header = {"format": FORMAT, "total_bytes": 16, "checksum": "0123456789abcdef", "tensors": [entry]}
    with pytest.raises(StateTransferError, match="checksum mismatch"):
        run_pair([lambda: bad_sender(header, torch.zeros(16, dtype=torch.uint8)), lambda: receive_state(pair[1], 0)])
    evil = {**header, "tensors": [{**entry, "dtype": "object"}]}
    with pytest.raises(StateTransferError, match="bad state header entry"):
        run_pair([lambda: bad_sender(evil, None), lambda: receive_state(pair[1], 0)])
    lying = {**header, "tensors": [{**entry, "nbytes": 4000}]}
    with pytest.raises(StateTransferError, match="inconsistent size"):
        run_pair([lambda: bad_sender(lying, None), lambda: receive_state(pair[1], 0)])
    ragged = {**header, "total_bytes": 17}  # the payload is read as 8-byte words
    with pytest.raises(StateTransferError, match="multiple of 16"):
        run_pair([lambda: bad_sender(ragged, None), lambda: receive_state(pair[1], 0)])


def test_state_checksum_is_position_weighted_and_chunked_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    def reference(payload: torch.Tensor) -> str:
        words = payload.view(torch.int64).tolist()
        return f"{sum(x * (2 * i + 1) for i, x in enumerate(words)) % 2**64:016x}"

    payload = torch.randint(0, 256, (8 * 37,), dtype=torch.uint8)
    payload[:8] = 255  # a word of -1 and large words: the sum wraps modulo 2**64
    want = reference(payload)
    assert checksum(payload) == want and checksum(torch.empty(0, dtype=torch.uint8)) == "0" * 16
    monkeypatch.setattr("recover.comm.transfer.CHECKSUM_CHUNK_WORDS", 5)  # 37 words: 8 chunks, the last short
    assert checksum(payload) == want
    for byte, bit in ((0, 0), (100, 7), (8 * 37 - 1, 7)):  # any single flipped bit, sign bit included
        flipped = payload.clone()
        flipped[byte] ^= 1 << bit
        assert checksum(flipped) != want
    swapped = payload.view(torch.int64).clone()
    swapped[[3, 30]] = swapped[[30, 3]]
    assert checksum(swapped.view(torch.uint8)) != want or swapped[3] == swapped[30]
