"""What the GPU paths need, checked on the CPU: the host reads of a step, where a joiner's optimizer
state lands, the compile warm-up before joining, and deterministic algorithms in deterministic mode.

A GPU drains its queue whenever the host reads a tensor's values (``.item()``, ``.cpu()``, ``float(t)``,
...), so the step counts those calls: on the CPU they cost nothing, but each one is a synchronisation
on a GPU. Device placement is checked with the ``meta`` device, which holds no values: a tensor left on
the CPU where the parameters live elsewhere shows as a device mismatch.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from test_parallel import CFG, _Sampler
from test_reduction import Recording

from recover.config import TrainingConfig
from recover.recovery.protocol import ResilientStep
from recover.train.replicas.dist import CommitAll, StaticMembership
from recover.train.replicas.replica import Replica

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class HostReads:
    """Counts (with where from) every call that reads a tensor's values to the host while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on, self.calls = False, []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))

    def _counting(self, name: str, method: Any) -> Any:
        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.on = False  # a read inside a read is the same read
                try:
                    where = traceback.extract_stack(limit=3)[0]
                    self.calls.append(f"{name} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}")
                    return method(t, *args, **kwargs)
                finally:
                    self.on = True
            return method(t, *args, **kwargs)
        return read

    @contextmanager
    def paused(self) -> Iterator[None]:
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was


class OneMember:
    """A group of one whose reduction is the streamed one (buckets launched from the last backward)."""

    generation, members, rank, device = 0, (0,), 0, torch.device("cpu")
    membership = StaticMembership(0, (0,))
    passed: tuple[StaticMembership, ...] = ()

    def reduction(self, tensors: list[torch.Tensor], order: Any = None) -> Recording:
        return Recording(tensors, order=order, bucket_bytes=4096, first_bucket_bytes=1024)

    def release(self, results: list[torch.Tensor]) -> None:
        """The recording's copies are its own: nothing to hand back."""


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_step_reads_the_device_at_most_twice(monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """One read after the microbatches (losses, finiteness) and one after the reduction (loss sum,
    count, gradient norm, fingerprint); none in the update. AdamW's own reads of its step counters are
    left out: they are CPU scalars beside GPU parameters, and the fused kernel a GPU uses has none."""
    tc = TrainingConfig(seed=3, global_microbatches=4, grad_clip=0.5, deterministic=deterministic)
    replica = Replica(CFG, tc, _Sampler())
    step = ResilientStep(replica, OneMember(), CommitAll(), 4, fingerprint_every=1, overlap=True)
    reads = HostReads(monkeypatch)
    update = replica.optimizer.step

    def step_without_counting(*args: Any, **kwargs: Any) -> Any:
        with reads.paused():
            return update(*args, **kwargs)

    monkeypatch.setattr(replica.optimizer, "step", step_without_counting)
    step.run()  # the first step builds the optimizer state
    reads.on = True
    outcome = step.run()
    reads.on = False
    assert outcome.microbatches == 4 and outcome.grad_norm > 0
    assert len(reads.calls) <= 2, reads.calls


class Collectives:
    """Stands in for the collectives of a replica of several ranks (a one-process run has no group):
    records the device of every tensor handed to one; the sums are those of a group of one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch.distributed as dist

        self.devices: list[str] = []
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: self.devices.append(str(t.device)))
        monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)

        def gather_object(obj: Any, out: list[Any] | None, dst: int = 0, group: Any = None) -> None:
            if out is not None:
                out[:] = [obj]
        monkeypatch.setattr(dist, "gather_object", gather_object)


def test_every_tensor_of_an_intra_replica_collective_is_on_the_replica_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NCCL group has no CPU backend: a tensor allocated without naming its device would land on the
    CPU beside GPU parameters. Here the default device is ``meta`` while the replica computes on the CPU,
    so any such tensor shows up as ``meta``."""
    from recover.model import build_model

    replica = Replica(CFG, TrainingConfig(seed=3), _Sampler())
    replica.compute(0, [0, 1])
    replica.group = object()  # from here on it acts as a replica of several ranks
    replica._eval_model = build_model(CFG, 0, replica.device)
    batch = _Sampler().microbatch(9, 0)
    seen = Collectives(monkeypatch)
    torch.set_default_device("meta")
    try:
        replica._record([2], {2: 1.5})
        replica.totals(replica.payload())
        replica.evaluate([batch])
    finally:
        torch.set_default_device(None)
    assert seen.devices == ["cpu"] * 3


def test_a_joiner_keeps_its_optimizer_state_on_its_parameters_device() -> None:
    """The transferred state arrives on the group's device (the CPU over gloo, also when GPUs are shared);
    the moments must move to the parameters' device. ``meta`` parameters stand in for GPU ones."""
    src = Replica(CFG, TrainingConfig(seed=3), _Sampler())
    src.compute(0, [0])
    src.apply(src.payload(), 1, 0, src.totals(src.payload()).sum_norm)
    state = src.transfer_state({"step": 1, "data_step": 1, "total_tokens": 16})
    dst = Replica(CFG, TrainingConfig(seed=3), _Sampler(), device="meta")
    assert dst.load_transfer_state(state)["step"] == 1
    for p in dst.params:
        moments = dst.optimizer.state[p]
        assert moments["exp_avg"].device == p.device and moments["exp_avg_sq"].device == p.device
        assert moments["step"].device == torch.device("cpu")  # AdamW without fused/capturable keeps it there


def test_the_warm_up_compiles_before_joining_and_leaves_nothing_behind() -> None:
    """A replacement compiles in :meth:`Replica.warm_up`, at start-up, not in its first step while the others
    wait in the reduction (a cold compile outlasts the hang rule); the step after it is unchanged."""
    from torch._dynamo.utils import counters

    tc = TrainingConfig(seed=3, compile=True, compile_backend="aot_eager")
    warm, cold = Replica(CFG, tc, _Sampler()), Replica(CFG, TrainingConfig(seed=3), _Sampler())
    counters.clear()
    warm.warm_up()
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0  # the blocks' forward and backward graphs were built here
    assert warm.ledger == [] and all(not b.any() for b in warm.buffers) and all(p.grad is None for p in warm.params)
    warm.compute(0, [0, 1])
    cold.compute(0, [0, 1])
    assert counters["stats"]["unique_graphs"] == compiled  # nothing left to compile in the step
    assert warm.ledger == cold.ledger
    for a, b in zip(warm.payload(), cold.payload(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_deterministic_mode_switches_on_deterministic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from recover.config import load_config
    from recover.train.processes.loop import configure_torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    threads = torch.get_num_threads()
    try:
        configure_torch(load_config("debug", []), 1)
        assert not torch.are_deterministic_algorithms_enabled()
        configure_torch(load_config("debug", ["--training.deterministic=true"]), 1)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before any cuBLAS handle exists
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def test_threads_per_process_follow_the_config_then_omp_num_threads_then_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from recover.config import load_config
    from recover.train.processes.loop import configure_torch

    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets, and what a shared machine's user sets
        configure_torch(load_config("debug", []), 1)
        assert torch.get_num_threads() == 1
        configure_torch(load_config("debug", ["--training.threads=2"]), 1)
        assert torch.get_num_threads() == 2  # the config's own count wins
        for unset in ("", "many"):
            monkeypatch.setenv("OMP_NUM_THREADS", unset)
            configure_torch(load_config("debug", []), 1)
            assert torch.get_num_threads() == cores  # one local process: every core
        monkeypatch.delenv("OMP_NUM_THREADS")
        configure_torch(load_config("debug", []), 2 * cores)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
