"""Deterministic samples: ``(seed, step, microbatch_id) -> token ids``, never a function of rank.

Contract (the data half of recover's invariant: a step's M microbatches are the same sample sets
whichever replica computes them, in a failure-free run or after any number of re-assignments):

    * A *window* is ``seq_len + 1`` consecutive tokens starting at a multiple of ``seq_len`` inside
      one shard (windows never cross shards). ``W`` windows make one epoch.
    * Row ``b`` of microbatch ``mb`` at ``step`` is global sample ``i = (step * M + mb) * B + b``;
      it reads window ``perm_e[i % W]`` with ``e = i // W`` and
      ``perm_e = np.random.default_rng([seed, e]).permutation(W)``. So every epoch visits every
      window exactly once, and each epoch has its own (reproducible) order.
    * :meth:`Sampler.microbatch` is pure: no cursor, no state besides a cache of two permutations,
      no dependence on rank, world size, call order or process. Replaying ``(step, id)`` after a
      failure yields the very same tensors.

:class:`EvalSampler` gives fixed, unshuffled validation batches; :func:`open_samplers` opens both
from a shard directory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from recover.config import DataConfig
from recover.data.shards import TokenDataset, check_data
from recover.errors import DataError

_PERM_CACHE = 2  # epochs of permutations kept (a microbatch spans at most two epochs)


def _positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class _Windows:
    """Window index ``0..W-1`` -> ``seq_len + 1`` tokens, over all shards of a dataset in order."""

    def __init__(self, dataset: TokenDataset, seq_len: int, microbatch_size: int) -> None:
        self.dataset = dataset
        self.seq_len = _positive("seq_len", seq_len)
        counts = np.array([max(0, (n - 1) // self.seq_len) for n in dataset.lengths], dtype=np.int64)
        self.ends = np.cumsum(counts)  # window g lives in the first shard whose end > g
        self.starts = self.ends - counts
        self.count = int(self.ends[-1]) if len(self.ends) else 0
        if self.count < microbatch_size:
            raise DataError(
                f"{dataset.source}: {dataset.num_tokens} tokens in {len(dataset.paths)} shard(s) give only "
                f"{self.count} windows of seq_len+1={self.seq_len + 1} tokens, fewer than "
                f"microbatch_size={microbatch_size}; use a shorter seq_len, a smaller microbatch or more data"
            )

    def gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack ``windows`` into ``(inputs, targets)``, both ``(len(windows), seq_len)`` int64."""
        T = self.seq_len
        shard_ids = np.searchsorted(self.ends, windows, side="right")
        rows = np.empty((len(windows), T + 1), dtype=np.int64)  # (B, T+1)
        for r, (g, s) in enumerate(zip(windows.tolist(), shard_ids.tolist(), strict=True)):
            start = (g - int(self.starts[s])) * T
            rows[r] = self.dataset.shard(s)[start : start + T + 1]
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()  # (B, T), (B, T)


class Sampler:
    """Training microbatches as a pure function of ``(seed, step, microbatch_id)``.

    Args:
        dataset: the training shards.
        seq_len: tokens per row (T).
        microbatch_size: rows per microbatch (B).
        microbatches_per_step: microbatches per optimizer step (M), fixed for the whole run.
        seed: the data seed.

    Raises:
        ValueError: a non-positive size.
        DataError: the dataset has fewer than ``microbatch_size`` windows.
    """

    def __init__(
        self, dataset: TokenDataset, seq_len: int, microbatch_size: int, microbatches_per_step: int, seed: int
    ) -> None:
        self.microbatch_size = _positive("microbatch_size", microbatch_size)
        self.microbatches_per_step = _positive("microbatches_per_step", microbatches_per_step)
        self.windows = _Windows(dataset, seq_len, self.microbatch_size)
        self.seq_len = self.windows.seq_len
        self.seed = int(seed)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_windows(self) -> int:
        """W: windows (samples) per epoch."""
        return self.windows.count

    @property
    def tokens_per_microbatch(self) -> int:
        return self.microbatch_size * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens in the training shards."""
        return self.windows.dataset.num_tokens

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches_per_step * self.tokens_per_microbatch

    def epoch_of(self, step: int) -> float:
        """Epochs consumed once ``step`` has finished (1.0 = every window seen once)."""
        return (step + 1) * self.microbatches_per_step * self.microbatch_size / self.num_windows

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            if len(self._perms) >= _PERM_CACHE:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def window_ids(self, step: int, microbatch_id: int) -> np.ndarray:
        """The B window indices read by ``(step, microbatch_id)``, one per row."""
        self._check(step, microbatch_id)
        B, M, W = self.microbatch_size, self.microbatches_per_step, self.num_windows
        first = (step * M + microbatch_id) * B
        samples = np.arange(first, first + B, dtype=np.int64)  # global sample indices
        out = np.empty(B, dtype=np.int64)
        for epoch in np.unique(samples // W).tolist():
            rows = samples // W == epoch
            out[rows] = self._perm(epoch)[samples[rows] % W]
        return out

    def microbatch(self, step: int, microbatch_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both ``(B, T)`` torch.long; targets are inputs shifted by one token."""
        return self.windows.gather(self.window_ids(step, microbatch_id))

    def _check(self, step: int, microbatch_id: int) -> None:
        if int(step) != step or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        M = self.microbatches_per_step
        if int(microbatch_id) != microbatch_id or not 0 <= microbatch_id < M:
            raise ValueError(
                f"microbatch_id must be in 0..{M - 1} (microbatches_per_step={M}), got {microbatch_id!r}"
            )


class EvalSampler:
    """Fixed, unshuffled validation batches: batch ``i`` reads windows ``i*B .. i*B+B-1`` (mod W)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, microbatch_size: int) -> None:
        self.microbatch_size = _positive("microbatch_size", microbatch_size)
        self.windows = _Windows(dataset, seq_len, self.microbatch_size)
        self.seq_len = self.windows.seq_len

    @property
    def num_windows(self) -> int:
        return self.windows.count

    @property
    def num_batches(self) -> int:
        """Batches needed to see every window once (the last one wraps around)."""
        return math.ceil(self.num_windows / self.microbatch_size)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of validation batch ``i`` (``i >= 0``), both ``(B, T)`` torch.long."""
        if int(i) != i or i < 0:
            raise ValueError(f"eval batch index must be an integer >= 0, got {i!r}")
        B = self.microbatch_size
        windows = np.arange(i * B, i * B + B, dtype=np.int64) % self.num_windows
        return self.windows.gather(windows)


def open_samplers(cfg: DataConfig, data_dir: Path, vocab_size: int, microbatches: int,
                  seed: int) -> tuple[Sampler, EvalSampler]:
    """The training sampler and the validation batches of a prepared shard directory.

    Raises:
        DataError: a shard is unreadable or holds a token id ``>= vocab_size``.
    """
    train, val = check_data(cfg, data_dir, vocab_size)
    return (Sampler(train, cfg.seq_len, cfg.microbatch_size, microbatches, seed),
            EvalSampler(val, cfg.seq_len, cfg.microbatch_size))


def tokens(path: str | Path, *, seq_len: int, microbatch_size: int, microbatches: int,
           seed: int = 0, vocab_size: int | None = None) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """Token shards as ``samples(step, id) -> (inputs, targets)`` for :class:`recover.api.Job`: the training
    split of a directory of recover's, nanoGPT's or llm.c's shards (or ``builtin:stdlib``, prepared on
    first use), windows of ``seq_len`` + 1 tokens drawn by (seed, step, id) as for the built-in trainer.
    Every shard is checked first: token ids below ``vocab_size`` (default: the data's recorded vocabulary).

    Raises:
        DataError: no training split, a damaged shard, or an id beyond the vocabulary (one line, named).
    """
    from recover.data.layout import check_vocab_fits, data_vocab, split_format, split_pattern
    from recover.data.prepare import resolve_data_dir

    data = DataConfig(path=str(path), seq_len=seq_len, microbatch_size=microbatch_size)
    directory = resolve_data_dir(data, prepare=True, quiet=True)
    recorded = data_vocab(data, directory)
    vocab = vocab_size or (recorded[0] if recorded else None)
    train = TokenDataset(str(directory / split_pattern(data, directory, "train")),
                         fmt=split_format(data, directory, "train"))
    if vocab is not None:
        check_vocab_fits(vocab, recorded)
        train.check_vocab(vocab)
    return Sampler(train, seq_len, microbatch_size, microbatches, seed).microbatch
