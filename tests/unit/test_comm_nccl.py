"""The NCCL paths of layer 1 without a GPU: settings, readiness of a new communicator and the order in
which ``next_generation`` aborts the old one, against fakes of the NCCL backend and of the coordinator
client (their ``_is_initialized()``, works and ``abort()`` are driven by the test)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from recover.comm import FaultTolerantGroup, Graveyard, nccl
from recover.comm import group as group_mod
from recover.comm.nccl import CommNotReady
from recover.comm.watch import run_watched
from recover.coord.protocol import Membership
from recover.errors import PeerFailure

CPU = torch.device("cpu")


class FakeWork:
    def __init__(self, done_after: int | None) -> None:
        self.polls, self.done_after = 0, done_after

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def wait(self) -> bool:
        return True


class FakeNccl:
    """A ProcessGroupNCCL stand-in: its all-reduce sums over ``size`` ranks holding the same tensor (its
    work completes after ``work_after`` polls), ``_is_initialized()`` turns True after ``ready_after``
    polls (never with None, unless ``release`` is set); ``abort()`` is logged."""

    alive: list[weakref.ref[FakeNccl]] = []

    def __init__(self, name: str = "pg", *, size: int = 2, ready_after: int | None = 0, work_after: int | None = 0,
                 log: list[str] | None = None, on_poll: Callable[[int], None] | None = None) -> None:
        self.name, self._size, self.ready_after, self.work_after = name, size, ready_after, work_after
        self.log = log if log is not None else []
        self.on_poll = on_poll
        self.polls, self.aborted, self.connected = 0, False, None
        self.release = threading.Event()
        FakeNccl.alive.append(weakref.ref(self))

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.connected = device

    def allreduce(self, tensors: list[torch.Tensor]) -> FakeWork:
        for t in tensors:
            t.mul_(self._size)
        return FakeWork(self.work_after)

    def _is_initialized(self) -> bool:
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll(self.polls)
        return self.release.is_set() or (self.ready_after is not None and self.polls > self.ready_after)

    def abort(self) -> None:
        self.aborted = True
        self.log.append(f"abort {self.name}")


class FakeClient:
    """The parts of CoordinatorClient that group forming uses; ``next`` is the coordinator's next generation."""

    replica_id, rank, ranks, lost = 0, 0, 1, None

    def __init__(self, nxt: Membership, dead: tuple[int, ...] = ()) -> None:
        self.next, self.dead = nxt, dead
        self.notice = threading.Event()
        self.reports: list[int] = []

    def failure_notice(self, generation: int) -> bool:
        return self.notice.is_set()

    def report_failure(self, generation: int, suspects: Any = (), timed_out: bool = False) -> None:
        self.reports.append(generation)

    def wait_for_generation(self, after: int, timeout: float) -> Membership:
        return self.next

    def dead_since(self, generation: int) -> tuple[int, ...]:
        return self.dead

    def entering(self, generation: int) -> None:
        pass

    def probe_address(self) -> str:
        return "127.0.0.1:1"

    def unreachable(self, peers: dict[int, str]) -> list[int]:
        return []  # every peer's probe answers: a failure here names nobody

    @contextmanager
    def activity(self, kind: str) -> Iterator[None]:
        yield


def membership(generation: int, members: tuple[int, ...], port: int = 1) -> Membership:
    return Membership(generation=generation, members=members, store_host="127.0.0.1", store_port=port, step=0)


# ------------------------------------------------------------------ settings


def test_env_defaults_keep_the_users_values_and_carry_the_nonblocking_timeout() -> None:
    env = {"NCCL_NVLS_ENABLE": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "900"}
    got = nccl.apply_env_defaults(env, collective_timeout_s=60.0)
    assert got["NCCL_NVLS_ENABLE"] == "1" and got["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "900"  # the user's
    assert got["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0" and got["NCCL_RUNTIME_CONNECT"] == "0"
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and got["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"
    assert env == got
    assert nccl.apply_env_defaults({}, collective_timeout_s=0.2)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1"
    assert nccl.apply_env_defaults({}, collective_timeout_s=60.5)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "61"
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in nccl.apply_env_defaults({})  # no timeout given: left alone


def test_nccls_own_timeout_is_well_above_the_collective_deadline() -> None:
    assert nccl.nccl_op_timeout_s(60.0) == 180.0
    for deadline in (0.5, 5.0, 60.0, 600.0):
        assert nccl.nccl_op_timeout_s(deadline) >= 2 * deadline + 60


# ------------------------------------------------------------------ a communicator is handed out ready


def test_the_build_waits_until_the_communicator_says_it_is_initialised() -> None:
    pg = FakeNccl(ready_after=5, work_after=3)
    assert nccl.make_ready(pg, CPU, 5.0, connect=True) is pg
    assert pg.connected == CPU and pg.polls == 6 and not pg.aborted


def test_a_backend_without_the_flag_is_ready_once_its_first_all_reduce_completes() -> None:
    pg = FakeNccl()
    pg._is_initialized = None  # type: ignore[assignment,method-assign]  # older backends lack it
    assert nccl.make_ready(pg, CPU, 5.0) is pg


@pytest.mark.parametrize(("kw", "match"), [
    ({"ready_after": None}, "_is_initialized"),
    ({"work_after": None}, "first all-reduce did not complete"),
])
def test_a_communicator_that_never_gets_ready_is_aborted_and_raises_after_the_bound(kw: dict[str, Any],
                                                                                       match: str) -> None:
    FakeNccl.alive.clear()
    log: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(CommNotReady, match=match) as info:
        nccl.make_ready(FakeNccl(**kw, log=log), CPU, 0.05)
    assert 0.05 <= time.monotonic() - t0 < 2.0
    assert "after 0.05 s" in str(info.value) and log == ["abort pg"]
    assert FakeNccl.alive[0]() is None  # dropped on the build's thread: the error keeps no reference to it


def test_a_communicator_whose_first_sum_is_wrong_is_not_ready() -> None:
    class Wrong(FakeNccl):
        def allreduce(self, tensors: list[torch.Tensor]) -> FakeWork:
            return FakeWork(0)  # leaves the ones as they are: a sum over one rank, not two

    pg = Wrong()
    with pytest.raises(CommNotReady, match="summed to 1, not 2"):
        nccl.make_ready(pg, CPU, 5.0)
    assert pg.aborted


class Witness:
    """Records the thread that drops it."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def __del__(self) -> None:
        self.seen.append(threading.current_thread().name)


def test_the_readiness_wait_runs_in_the_watched_build_and_a_notice_interrupts_it() -> None:
    client = FakeClient(membership(4, (0,)), dead=(1,))
    pg = FakeNccl(ready_after=None, on_poll=lambda n: n == 3 and client.notice.set())
    yard, seen = Graveyard(), []
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerFailure) as info:
            run_watched(client, 3, yard, 30.0, lambda: (nccl.make_ready(pg, CPU, 30.0), Witness(seen)), "rendezvous")
        assert time.monotonic() - t0 < 5.0  # not the 30 s bound
        assert info.value.dead == (1,) and yard.parked == 1  # the abandoned build went to the graveyard
    finally:
        pg.release.set()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    assert seen == ["recover-graveyard"]  # the late result reached the parked box, released off the caller


def test_a_rendezvous_whose_communicator_never_gets_ready_becomes_a_failure_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNccl.alive.clear()
    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    m = membership(3, (0, 1), server.port)
    client = FakeClient(membership(4, (0,)), dead=(1,))
    monkeypatch.setattr(group_mod, "make_process_group",
                        lambda backend, store, rank, size, timeout_s, device:
                        nccl.make_ready(FakeNccl(ready_after=None), device, 0.05, connect=True))
    with pytest.raises(PeerFailure, match="not ready after 0.05 s") as info:
        group_mod._rendezvous(client, m, "nccl", CPU, 10.0, Graveyard())
    assert client.reports == [3] and info.value.dead == (1,)
    assert FakeNccl.alive[0]() is None


# ------------------------------------------------------------------ the old communicator goes first


@pytest.fixture
def logged_create(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``FaultTolerantGroup.create`` replaced by one that logs the generation it builds."""
    log: list[str] = []

    def create(cls: type, client: Any, m: Membership, *args: Any, **kwargs: Any) -> SimpleNamespace:
        log.append(f"create {m.generation}")
        return SimpleNamespace(name=f"group {m.generation}")

    monkeypatch.setattr(FaultTolerantGroup, "create", classmethod(create))
    return log


def nccl_group(client: FakeClient, members: tuple[int, ...], log: list[str], yard: Graveyard) -> FaultTolerantGroup:
    return FaultTolerantGroup(client, membership(1, members), FakeNccl("old", log=log), backend="nccl", device=CPU,
                              timeout_s=5.0, bucket_bytes=64, graveyard=yard, store=None)


@pytest.mark.parametrize("broken", [True, False])  # after a failed collective / a join into a healthy group
def test_rebuild_aborts_the_old_communicator_before_the_next_one_forms(logged_create: list[str],
                                                                       broken: bool) -> None:
    nxt = membership(2, (0, 1) if broken else (0, 1, 2, 3))
    group = nccl_group(FakeClient(nxt), (0, 1, 2), logged_create, Graveyard())
    if broken:
        group._retire(True)  # what a failed collective does
    assert group.next_generation().name == "group 2"
    assert logged_create == ["abort old", "create 2"]


def test_a_failed_shrink_falls_back_to_abort_then_rebuild(logged_create: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_mod, "_shrink_possible", lambda: True)
    monkeypatch.setattr(group_mod, "_try_shrink", lambda old, pg, m: logged_create.append("shrink") or None)
    group = nccl_group(FakeClient(membership(2, (0, 1))), (0, 1, 2), logged_create, Graveyard())
    group._retire(True)  # kept for the shrink: not aborted yet
    assert logged_create == []
    assert group.next_generation().name == "group 2"
    assert logged_create == ["shrink", "abort old", "create 2"]


def test_a_shrunk_communicators_parent_is_aborted_after_the_shrink(logged_create: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_mod, "_shrink_possible", lambda: True)
    monkeypatch.setattr(group_mod, "_try_shrink",
                        lambda old, pg, m: logged_create.append("shrink") or FakeNccl("new", log=logged_create))
    yard = Graveyard()
    group = nccl_group(FakeClient(membership(2, (0, 1))), (0, 1, 2), logged_create, yard)
    group._retire(True)
    new = group.next_generation()
    assert new.generation == 2 and new.members == (0, 1) and new.process_group.name == "new"
    deadline = time.monotonic() + 10
    while yard.aborted < 1 and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    assert logged_create == ["shrink", "abort old"]
    new.close()
