"""Read-ahead of microbatches (recover.data.prefetch): the same batches as synchronous reads, the wait
hidden behind compute, errors where they belong, no thread left behind; and a replica trains the same."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from recover.config import load_config
from recover.data.prefetch import Prefetcher
from recover.data.sampler import Sampler
from recover.data.shards import TokenDataset, write_shard
from recover.errors import DataError
from recover.recovery.protocol import ResilientStep
from recover.train.replicas.dist import CommitAll, StaticGroup
from recover.train.replicas.replica import Replica

M, B, T = 8, 2, 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prefetch")
    rng = np.random.default_rng(0)
    write_shard(out / "train_000.bin", rng.integers(0, 320, 3000))
    write_shard(out / "train_001.bin", rng.integers(0, 320, 2000))
    return out


def sampler(shards: Path) -> Sampler:
    return Sampler(TokenDataset(str(shards)), T, B, M, seed=7)


def until(ok: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def share(step: int) -> list[int]:
    """A plan that changes every step: 3 of the M ids, shifted by the step."""
    return [(step + k) % M for k in range(3)]


def test_prefetched_batches_equal_synchronous_reads_bitwise(shards: Path) -> None:
    reads, sync = Prefetcher(sampler(shards).microbatch, steps=2), sampler(shards)
    try:
        for step in range(6):
            reads.ahead(step, share(step))
            reads.ahead(step + 1, share(step))  # a speculative guess: wrong, the plan moves on
            until(lambda: reads.pending == 0)  # (for exact counts: everything scheduled is read)
            orphans = [(step + 5) % M]  # never scheduled: read on demand
            for mb in share(step) + orphans:
                x, y = reads.get(step, mb)
                x0, y0 = sync.microbatch(step, mb)
                assert torch.equal(x, x0) and torch.equal(y, y0) and x.dtype == x0.dtype
        stats = reads.take()
        assert stats.hits + stats.misses == 6 * 4
        assert stats.hits == 6 * 3 and stats.misses == 6  # every share was read ahead, every orphan was not
        assert reads.take().hits == 0  # counting starts again
    finally:
        reads.close()


def test_memory_stays_bounded_to_the_window_of_steps(shards: Path) -> None:
    reads = Prefetcher(sampler(shards).microbatch, steps=1)
    try:
        reads.ahead(0, range(M))
        reads.ahead(1, range(M))
        reads.get(0, 0)  # step 0 is current: steps 0, 1 and 2 are kept
        reads.ahead(2, range(M))
        until(lambda: reads.pending == 0)
        assert {step for step, _ in reads._reads.ready} == {0, 1, 2}
        reads.get(1, 0)  # step 1 is current: step 0's batches are dropped
        held = reads._reads.ready
        assert held and all(step in (1, 2) for step, _ in held)
        reads.ahead(0, range(M))  # an old step: ignored
        reads.ahead(9, [0])  # a jump ahead (a joiner): the window moves there, the rest is dropped
        until(lambda: reads.pending == 0)
        assert set(reads._reads.ready) == {(9, 0)}
    finally:
        reads.close()


def test_the_wait_is_hidden_when_compute_takes_longer_than_the_read() -> None:
    def slow(step: int, mb: int) -> torch.Tensor:
        time.sleep(0.02)  # storage: 20 ms per microbatch
        return torch.full((4,), step * M + mb)

    def train(prefetch: int) -> tuple[float, int, int]:
        reads = Prefetcher(slow, steps=prefetch)
        try:
            for step in range(5):
                reads.ahead(step, range(4))
                reads.ahead(step + 1, range(4))  # the steady-state plan: the same ids next step
                for mb in range(4):
                    assert int(reads.get(step, mb)[0]) == step * M + mb
                    time.sleep(0.05)  # the device: 50 ms per microbatch
            stats = reads.take()
            return stats.wait_s, stats.hits, stats.misses
        finally:
            reads.close()

    sync_wait, sync_hits, sync_misses = train(0)
    wait, hits, misses = train(1)
    assert (sync_hits, sync_misses) == (0, 20) and sync_wait >= 20 * 0.02 * 0.9
    assert misses <= 2 and hits >= 18  # only the first step's first read can be on demand
    assert wait < sync_wait / 3, (wait, sync_wait)  # ~0.02-0.04 s against 0.4 s (shared cores: a wide margin)


def test_an_error_in_a_background_read_surfaces_at_get_of_that_key_unchanged() -> None:
    raised: list[BaseException] = []

    def read(step: int, mb: int) -> torch.Tensor:
        if (step, mb) == (1, 2):
            exc = DataError("shard train_001.bin: cut short at byte 1234; prepare the data again")
            raised.append(exc)
            raise exc
        return torch.tensor([step, mb])

    reads = Prefetcher(read, steps=2)
    try:
        reads.ahead(1, range(4))
        until(lambda: reads.pending == 0)
        assert raised  # read in the background, and nothing raised yet
        assert reads.get(1, 0).tolist() == [1, 0] and reads.get(1, 1).tolist() == [1, 1]
        with pytest.raises(DataError) as bg:
            reads.get(1, 2)
        assert bg.value is raised[0]
        assert reads.get(1, 3).tolist() == [1, 3]  # the others are unaffected
        assert reads.alive
    finally:
        reads.close()
    with pytest.raises(DataError) as direct:  # as read synchronously
        Prefetcher(read, steps=0).get(1, 2)
    assert type(direct.value) is type(bg.value) and str(direct.value) == str(bg.value)


def test_close_leaves_no_thread_and_reads_go_on_synchronously() -> None:
    before = set(threading.enumerate())
    reads = Prefetcher(lambda step, mb: torch.tensor([step, mb]), steps=2, name="prefetch-under-test")
    assert not reads.alive  # started on the first read scheduled
    reads.ahead(0, range(8))
    assert reads.alive
    reads.close()
    assert not reads.alive and set(threading.enumerate()) <= before
    assert reads.get(0, 5).tolist() == [0, 5]
    reads.ahead(1, range(8))  # closed: nothing is scheduled
    assert not reads.alive and reads.pending == 0
    with pytest.raises(ValueError, match="integer >= 0"):
        Prefetcher(lambda step, mb: None, steps=-1)


def replica_run(shards: Path, prefetch: int) -> tuple[list[dict[int, float]], str, int, int]:
    """4 steps of a one-process replica called directly: a share that moves every step, then an orphan."""
    cfg = load_config("debug", [f"--data.prefetch={prefetch}"])
    replica = Replica(cfg.model, dataclasses.replace(cfg.training, deterministic=True), sampler(shards),
                      prefetch=cfg.data.prefetch)
    losses = []
    for step in range(4):
        replica.reset()
        replica.compute(step, share(step))
        replica.compute(step, [(step + 5) % M])  # an orphan after a failure
        reduced = [t.clone() for t in replica.payload()]
        replica.apply(reduced, M, step, replica.totals(reduced).sum_norm)
        losses.append(dict(replica.losses))
    stats = replica.reads.take()
    replica.reads.close()
    return losses, replica.fingerprint(), stats.hits, stats.misses


def test_a_replica_trains_bitwise_the_same_with_and_without_read_ahead(shards: Path) -> None:
    sync, prefetched = replica_run(shards, 0), replica_run(shards, 2)
    assert sync[:2] == prefetched[:2]  # losses of every id, and the parameters, bit for bit
    assert sync[2:] == (0, 16)
    assert prefetched[2] + prefetched[3] == 16 and prefetched[2] >= 6  # later steps' shares read ahead (2 of 3)


def test_the_step_protocol_tells_the_replica_its_coming_shares(shards: Path) -> None:
    cfg = load_config("debug", ["--data.prefetch=1"])
    tc = dataclasses.replace(cfg.training, deterministic=True, assignment="shuffled")
    runs = {}
    for prefetch in (0, 1):
        replica = Replica(cfg.model, tc, sampler(shards), prefetch=prefetch)
        protocol = ResilientStep(replica, StaticGroup(), CommitAll(), M, assignment="shuffled", seed=3)
        assert replica.upcoming == protocol.share and protocol.share(5) == protocol.plan(5)[0]
        runs[prefetch] = [protocol.run().loss_sum for _ in range(3)], replica.reads.take()
        replica.reads.close()
    assert runs[0][0] == runs[1][0]
    assert runs[1][1].hits >= 2 * M - 1  # steps 1 and 2 were read during the step before


def test_a_job_reads_its_samples_ahead_with_the_same_result_and_errors_where_they_were() -> None:
    import recover

    def samples(step: int, i: int) -> torch.Tensor:
        if (step, i) == (2, 1):
            raise DataError("samples: step 2 id 1 is damaged")
        return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(100 * step + i))

    def train(prefetch: int) -> tuple[list[float], list[tuple[int, int]], Prefetcher]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
        job = recover.Job(model, torch.optim.AdamW(model.parameters()), samples=samples, microbatches=4,
                          prefetch=prefetch)  # (not deterministic=True: it switches on global torch flags)
        losses, seen = [], []
        with pytest.raises(DataError, match="step 2 id 1 is damaged"):
            for step in job.steps(4):
                for mb in step:
                    seen.append((mb.step, mb.id))
                    mb.backward(torch.nn.functional.cross_entropy(model(mb.batch).flatten(0, 1), mb.batch.flatten()))
                losses.append(step.loss)
        return losses, seen, job.reads

    (sync, seen0, _), (ahead, seen2, reads) = train(0), train(2)
    assert sync == ahead and len(sync) == 2 and seen0 == seen2 and seen2[-1] == (2, 0)  # raised at (2, 1)
    assert reads.steps == 2 and reads.take().hits >= 4  # step 1 (at least) was read during step 0
    reads.close()
