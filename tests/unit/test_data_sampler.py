"""The sampler is a pure function of (seed, step, microbatch id): never of rank, world size or process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recover.data.sampler import EvalSampler, Sampler
from recover.data.shards import TokenDataset, write_shard
from recover.errors import DataError

SEQ_LEN = 16
SHARD0 = np.arange(0, 1000)  # (1000 - 1) // 16 = 62 windows
SHARD1 = np.arange(5000, 5700)  # (700 - 1) // 16 = 43 windows; a jump of 4000 marks the shard boundary
W = 62 + 43
SRC = str(Path(__file__).resolve().parents[2] / "src")

HASH_SCRIPT = """
import hashlib, sys
from recover.data.sampler import Sampler
from recover.data.shards import TokenDataset
s = Sampler(TokenDataset(sys.argv[1]), 16, 4, 8, seed=1234)
h = hashlib.sha256()
for step in (0, 3, 26):
    for mb in range(8):
        x, y = s.microbatch(step, mb)
        h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())
print(h.hexdigest())
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    write_shard(root / "train_000000.bin", SHARD0, "llmc")
    write_shard(root / "train_000001.bin", SHARD1, "nanogpt")
    return root


def digest(sampler: Sampler, steps: tuple[int, ...]) -> str:
    h = hashlib.sha256()
    for step in steps:
        for mb in range(sampler.microbatches_per_step):
            x, y = sampler.microbatch(step, mb)
            h.update(x.numpy().tobytes())
            h.update(y.numpy().tobytes())
    return h.hexdigest()


def test_microbatch_shapes_targets_and_windows(data_dir: Path) -> None:
    s = Sampler(TokenDataset(data_dir), SEQ_LEN, 4, 8, seed=0)
    assert s.num_windows == W and s.tokens_per_microbatch == 4 * SEQ_LEN
    x, y = s.microbatch(2, 5)
    assert x.shape == y.shape == (4, SEQ_LEN) and x.dtype == y.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    row = torch.cat([x, y[:, -1:]], dim=1)  # the whole window, (B, T+1)
    assert bool((row.diff(dim=1) == 1).all()), "a window crossed a shard boundary"
    for window, first in zip(s.window_ids(2, 5).tolist(), row[:, 0].tolist(), strict=True):
        expected = window * SEQ_LEN if window < 62 else 5000 + (window - 62) * SEQ_LEN
        assert first == expected


def test_same_tokens_in_two_fresh_processes(data_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HASH_SCRIPT, str(data_dir)], stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    here = digest(Sampler(TokenDataset(data_dir), SEQ_LEN, 4, 8, seed=1234), (0, 3, 26))
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize(
    "assignment",
    [
        [[0, 1, 2, 3, 4, 5, 6, 7]],  # 1 replica x 8 ids
        [[0, 1, 2, 3], [4, 5, 6, 7]],  # 2 x 4
        [[0, 1], [2, 3], [4, 5], [6, 7]],  # 4 x 2
        [[5, 2, 7], [0], [6, 1, 3, 4]],  # uneven, permuted (as after a re-assignment)
    ],
)
def test_batch_is_independent_of_world_size_and_assignment(
    data_dir: Path, assignment: list[list[int]]
) -> None:
    reference = Sampler(TokenDataset(data_dir), SEQ_LEN, 4, 8, seed=7)
    for step in (0, 3, 13):  # step 3 straddles epochs 0 and 1 (W = 105, 32 samples per step)
        got: dict[int, torch.Tensor] = {}
        for ids in assignment:  # every "rank" has its own dataset and sampler, and asks in its own order
            rank_sampler = Sampler(TokenDataset(data_dir), SEQ_LEN, 4, 8, seed=7)
            for mb in reversed(ids):
                got[mb] = rank_sampler.microbatch(step, mb)[0]
        assert sorted(got) == list(range(8))
        for mb in range(8):
            torch.testing.assert_close(got[mb], reference.microbatch(step, mb)[0], rtol=0, atol=0)


def test_different_seeds_differ(data_dir: Path) -> None:
    ds = TokenDataset(data_dir)
    assert digest(Sampler(ds, SEQ_LEN, 4, 8, seed=0), (0,)) != digest(
        Sampler(ds, SEQ_LEN, 4, 8, seed=1), (0,)
    )


def test_each_epoch_covers_every_window_once_in_a_new_order(data_dir: Path) -> None:
    s = Sampler(
        TokenDataset(data_dir), SEQ_LEN, 4, 3, seed=3
    )  # 12 samples per step; W = 105 is not a multiple
    order = np.concatenate([s.window_ids(step, mb) for step in range(18) for mb in range(3)])
    epoch0, epoch1 = order[:W], order[W : 2 * W]
    assert sorted(epoch0.tolist()) == list(range(W)) and sorted(epoch1.tolist()) == list(range(W))
    assert not np.array_equal(epoch0, epoch1)
    np.testing.assert_array_equal(epoch0, np.random.default_rng([3, 0]).permutation(W))
    assert s.epoch_of(0) == pytest.approx(12 / W) and s.epoch_of(17) == pytest.approx(18 * 12 / W)


def test_invalid_arguments(data_dir: Path) -> None:
    ds = TokenDataset(data_dir)
    s = Sampler(ds, SEQ_LEN, 4, 8, seed=0)
    for step, mb in ((0, 8), (0, -1), (-1, 0)):
        with pytest.raises(ValueError):
            s.microbatch(step, mb)
    with pytest.raises(DataError) as err:
        Sampler(ds, 1024, 4, 8, seed=0)
    assert "seq_len+1=1025" in str(err.value) and "1700 tokens" in str(err.value)


def test_eval_sampler_is_fixed_and_unshuffled(data_dir: Path) -> None:
    e = EvalSampler(TokenDataset(data_dir), SEQ_LEN, 10)
    assert e.num_batches == 11  # ceil(105 / 10)
    x, y = e.batch(0)
    assert x[:, 0].tolist() == [i * SEQ_LEN for i in range(10)]
    last, _ = e.batch(10)  # windows 100..104 then wraps to 0..4
    assert last[5:, 0].tolist() == [i * SEQ_LEN for i in range(5)]
    torch.testing.assert_close(e.batch(3)[1], EvalSampler(TokenDataset(data_dir), SEQ_LEN, 10).batch(3)[1])
