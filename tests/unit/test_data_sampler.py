"""The sampler is a pure function of (seed, step, microbatch id): never of rank, world size or process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from recover.data.mixture import Mixture
from recover.data.sampler import EvalSampler, Sampler
from recover.data.shards import TokenDataset, write_shard
from recover.data.shuffle import Shuffle
from recover.errors import DataError

SEQ_LEN = 16
SHARD0 = np.arange(0, 1000)  # (1000 - 1) // 16 = 62 windows
SHARD1 = np.arange(5000, 5700)  # (700 - 1) // 16 = 43 windows; a jump of 4000 marks the shard boundary
W = 62 + 43


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
    np.testing.assert_array_equal(epoch0, Shuffle(W, (3, 0, 0))(np.arange(W)))  # seed 3, source 0, epoch 0
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


# ---------------------------------------------------------------- the keyed shuffle


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65_537])
def test_shuffle_is_a_bijection(n: int) -> None:
    image = Shuffle(n, (11, 0, 2))(np.arange(n))
    assert image.dtype == np.int64 and np.array_equal(np.sort(image), np.arange(n))


def test_shuffle_is_well_mixed() -> None:
    n = 200_003  # not a power of two: cycle walking is exercised
    x = np.arange(n)
    y = Shuffle(n, (0, 0, 0))(x)
    # neighbours in the epoch are not neighbours on disk: |y[i+1] - y[i]| == 1 has probability ~2/n per pair,
    # so about 2 such pairs are expected; a sequential or block-wise order would give ~n
    assert int((np.abs(np.diff(y)) == 1).sum()) < 20
    # no linear trend, and a 10 x 10 table of (input decile, output decile) is flat (chi-square, 81 d.o.f.:
    # mean 81, sd ~13; a failing order is in the thousands)
    assert abs(np.corrcoef(x, y)[0, 1]) < 0.01
    table = np.histogram2d(x * 10 // n, y * 10 // n, bins=10)[0]
    expected = n / 100
    assert ((table - expected) ** 2 / expected).sum() < 200
    # different keys give unrelated orders
    z = Shuffle(n, (0, 0, 1))(x)
    assert abs(np.corrcoef(y, z)[0, 1]) < 0.01 and int((y == z).sum()) < 20


def test_shuffle_memory_and_cost_do_not_grow_with_n() -> None:
    big = Shuffle(10**10, (1, 0, 0))
    rows = big(np.arange(5_000_000_000, 5_000_000_016))
    assert len(set(rows.tolist())) == 16 and rows.min() >= 0 and rows.max() < 10**10
    assert big.keys.nbytes == small_keys_bytes() and big.bits == 34  # 2**34 >= 1e10


def small_keys_bytes() -> int:
    return Shuffle(5, (0,)).keys.nbytes


def test_shuffle_refuses_outside_inputs() -> None:
    with pytest.raises(ValueError):
        Shuffle(10, (0,))([10])
    with pytest.raises(ValueError):
        Shuffle(0, (0,))


# ---------------------------------------------------------------- mixtures


def test_mixture_counts_are_exact_monotone_and_stratified() -> None:
    mix = Mixture([0.5, 0.2, 0.3])
    n = np.arange(0, 50_000)
    counts = mix.counts(n)
    assert np.array_equal(counts.sum(axis=1), n)
    steps = np.diff(counts, axis=0)
    assert ((steps == 0) | (steps == 1)).all() and np.array_equal(steps.sum(axis=1), np.ones(len(n) - 1))
    assert np.abs(counts - n[:, None] * mix.weights).max() <= len(mix)
    source, index = mix.assign(np.arange(1000))
    for k in range(3):  # each source's own stream is 0, 1, 2, ... in order
        assert index[source == k].tolist() == list(range(int((source == k).sum())))
    huge = mix.counts(10**15)
    assert int(huge.sum()) == 10**15 and np.abs(huge - 10**15 * mix.weights).max() <= 3


def test_mixture_refuses_bad_weights() -> None:
    for weights in ([], [1.0, 0.0], [1.0, -2.0], [float("nan")]):
        with pytest.raises(ValueError):
            Mixture(weights)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenDataset, TokenDataset]:
    root = tmp_path_factory.mktemp("mix")
    write_shard(root / "a.bin", np.arange(0, 3000) % 1000, "llmc")  # ids < 1000
    write_shard(root / "b.bin", 2000 + np.arange(0, 1000) % 1000, "llmc")  # ids 2000..2999: tells b's rows apart
    return TokenDataset(root / "a.bin"), TokenDataset(root / "b.bin")


def test_mixture_rows_follow_the_weights_with_per_source_epochs(two_sources: tuple[TokenDataset, ...]) -> None:
    s = Sampler(list(two_sources), SEQ_LEN, 4, 8, seed=5, weights=[0.7, 0.3], names=["a", "b"])
    from_b = 0
    seen: dict[int, list[int]] = {0: [], 1: []}
    steps = 40
    for step in range(steps):
        for mb in range(8):
            x, _ = s.microbatch(step, mb)
            source, windows = s.rows(step, mb)
            assert ((x[:, 0] >= 2000) == torch.from_numpy(source == 1)).all()  # rows come from their source
            from_b += int((source == 1).sum())
            for k in (0, 1):
                seen[k] += windows[source == k].tolist()
    total = steps * 8 * 4
    assert abs(from_b - 0.3 * total) <= 2
    tokens = s.source_tokens(steps - 1)
    assert tokens == {"a": (total - from_b) * SEQ_LEN, "b": from_b * SEQ_LEN}
    W_b = s.sources[1].count  # 62 windows: several epochs of b, each a permutation of all of them
    for e in range(len(seen[1]) // W_b):
        assert sorted(seen[1][e * W_b:(e + 1) * W_b]) == list(range(W_b))
    assert s.epoch_of(steps - 1) == pytest.approx(from_b / W_b)


def test_microbatch_ids_beyond_the_vocabulary_are_named(data_dir: Path) -> None:
    s = Sampler(TokenDataset(data_dir), SEQ_LEN, 4, 8, seed=0, vocab_size=5000)  # SHARD1 holds 5000..5699
    with pytest.raises(DataError) as err:
        for step in range(4):
            for mb in range(8):
                s.microbatch(step, mb)
    message = str(err.value)
    assert "train_000001.bin" in message and "vocab_size 5000" in message and "token id 5" in message
    position = int(message.split("at position ")[1].split()[0])
    token = int(message.split("token id ")[1].split()[0])
    assert SHARD1[position] == token >= 5000  # the position is the token's offset in that file
