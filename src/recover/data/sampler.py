"""Deterministic samples: ``(seed, step, microbatch_id) -> token ids``, never a function of rank.

Contract (the data half of recover's invariant: a step's M microbatches are the same sample sets
whichever replica computes them, in a failure-free run or after any number of re-assignments):

    * A *window* is ``seq_len + 1`` consecutive tokens starting at a multiple of ``seq_len`` inside
      one shard (windows never cross shards). A source's ``W`` windows make one of its epochs.
    * Row ``b`` of microbatch ``mb`` at ``step`` is global sample ``i = (step * M + mb) * B + b``.
      With several sources (a mixture, :mod:`recover.data.mixture`) sample ``i`` is sample ``j`` of
      source ``k`` by a stratified rule of the weights; with one, ``k = 0`` and ``j = i``. It reads
      window ``Shuffle(W_k, (seed, k, e))(j % W_k)`` of source ``k``, with ``e = j // W_k``
      (:mod:`recover.data.shuffle`: a keyed bijection in O(1) memory). So every epoch of a source
      visits each of its windows exactly once, each in its own reproducible order.
    * :meth:`Sampler.microbatch` is pure: no cursor, no state besides two cached round-key sets, no
      dependence on rank, world size, call order or process. Replaying ``(step, id)`` after a failure
      yields the very same tensors. Memory and start-up do not grow with the number of windows.
    * With ``vocab_size``, every microbatch's largest id is checked on the host before it is returned:
      an id out of range is a :class:`~recover.errors.DataError` naming the file, the offset, the id
      and the fix (never an index error deep in the embedding).

:class:`EvalSampler` gives fixed, unshuffled validation batches over all sources' validation windows;
:func:`open_samplers` opens both from a run's data directories.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from recover.config import DataConfig
from recover.data.mixture import Mixture
from recover.data.shards import TokenDataset
from recover.data.shuffle import Shuffle
from recover.data.verify import check_data, check_windows, shard_windows
from recover.errors import DataError

_SHUFFLE_CACHE = 4  # (source, epoch) orders kept: a microbatch spans at most two epochs of each source


def _positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class _Windows:
    """Window index ``0..W-1`` -> ``seq_len + 1`` tokens, over all shards of some datasets in order."""

    def __init__(self, datasets: Sequence[TokenDataset], seq_len: int, microbatch_size: int,
                 vocab_size: int | None = None, split: str = "train") -> None:
        self.datasets = list(datasets)
        self.seq_len = _positive("seq_len", seq_len)
        self.vocab_size = vocab_size
        self.shards = [(ds, i) for ds in self.datasets for i in range(len(ds.lengths))]
        check_windows(self.datasets, self.seq_len, microbatch_size, split)
        counts = np.concatenate([shard_windows(ds, self.seq_len) for ds in self.datasets])
        self.ends = np.cumsum(counts)  # window g lives in the first shard whose end > g
        self.starts = self.ends - counts
        self.count = int(self.ends[-1])

    def gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack ``windows`` into ``(inputs, targets)``, both ``(len(windows), seq_len)`` int64."""
        T = self.seq_len
        where = np.searchsorted(self.ends, windows, side="right")
        rows = np.empty((len(windows), T + 1), dtype=np.int64)  # (B, T+1)
        for r, (g, s) in enumerate(zip(windows.tolist(), where.tolist(), strict=True)):
            ds, shard = self.shards[s]
            start = (g - int(self.starts[s])) * T
            rows[r] = ds.read(shard, start, T + 1)  # pread: a shard cut short under the run is a DataError
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:
            self._out_of_range(rows, windows, where)
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()  # (B, T), (B, T)

    def _out_of_range(self, rows: np.ndarray, windows: np.ndarray, where: np.ndarray) -> None:
        r, col = np.argwhere(rows >= self.vocab_size)[0].tolist()
        s = int(where[r])
        ds, shard = self.shards[s]
        offset = (int(windows[r]) - int(self.starts[s])) * self.seq_len + col
        raise ds.out_of_range(shard, offset, int(rows[r, col]), self.vocab_size)


class Sampler:
    """Training microbatches as a pure function of ``(seed, step, microbatch_id)``.

    Args:
        dataset: the training shards, or one dataset per source of a mixture.
        seq_len: tokens per row (T).
        microbatch_size: rows per microbatch (B).
        microbatches_per_step: microbatches per optimizer step (M), fixed for the whole run.
        seed: the data seed.
        weights: one positive weight per source (default: equal); only with several datasets.
        vocab_size: check every microbatch's ids against it (None: no check).
        names: one name per source, for metrics and messages (default: the datasets' sources).

    Raises:
        ValueError: a non-positive size or weight, or weights that do not match the sources.
        DataError: a source has fewer than ``microbatch_size`` windows.
    """

    def __init__(
        self, dataset: TokenDataset | Sequence[TokenDataset], seq_len: int, microbatch_size: int,
        microbatches_per_step: int, seed: int, *, weights: Sequence[float] | None = None,
        vocab_size: int | None = None, names: Sequence[str] | None = None,
    ) -> None:
        datasets = [dataset] if isinstance(dataset, TokenDataset) else list(dataset)
        if weights is not None and len(weights) != len(datasets):
            raise ValueError(f"{len(weights)} weights for {len(datasets)} sources")
        self.microbatch_size = _positive("microbatch_size", microbatch_size)
        self.microbatches_per_step = _positive("microbatches_per_step", microbatches_per_step)
        self.sources = [_Windows([ds], seq_len, self.microbatch_size, vocab_size) for ds in datasets]
        self.names = list(names) if names is not None else [ds.source for ds in datasets]
        self.mixture = Mixture(weights if weights is not None else [1.0] * len(datasets))
        self.seq_len = self.sources[0].seq_len
        self.seed = int(seed)
        self._shuffles: dict[tuple[int, int], Shuffle] = {}

    @property
    def num_windows(self) -> int:
        """Windows (samples) in one epoch of every source."""
        return sum(src.count for src in self.sources)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.microbatch_size * self.seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens in the training shards of every source."""
        return sum(ds.num_tokens for src in self.sources for ds in src.datasets)

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches_per_step * self.tokens_per_microbatch

    def _samples_through(self, step: int) -> int:
        return (step + 1) * self.microbatches_per_step * self.microbatch_size

    def epoch_of(self, step: int) -> float:
        """Epochs consumed once ``step`` has finished (1.0 = every window seen once); with a mixture,
        those of the source read most often relative to its size."""
        counts = self.mixture.counts(self._samples_through(step))
        return max(int(c) / src.count for c, src in zip(counts, self.sources, strict=True))

    def source_tokens(self, step: int) -> dict[str, int]:
        """Training tokens each source has contributed once ``step`` has finished (committed steps are
        ``0..step``): a pure function of the step, the same for every run of the config."""
        counts = self.mixture.counts(self._samples_through(step))
        return {name: int(c) * self.seq_len for name, c in zip(self.names, counts, strict=True)}

    def _shuffle(self, source: int, epoch: int) -> Shuffle:
        key = (source, epoch)
        shuffle = self._shuffles.get(key)
        if shuffle is None:
            shuffle = Shuffle(self.sources[source].count, (self.seed, source, epoch))
            if len(self._shuffles) >= _SHUFFLE_CACHE:
                self._shuffles.pop(next(iter(self._shuffles)))
            self._shuffles[key] = shuffle
        return shuffle

    def rows(self, step: int, microbatch_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, window within that source)`` of each of the B rows of ``(step, microbatch_id)``."""
        self._check(step, microbatch_id)
        B, M = self.microbatch_size, self.microbatches_per_step
        first = (step * M + microbatch_id) * B
        samples = np.arange(first, first + B, dtype=np.int64)  # global sample indices
        source, index = self.mixture.assign(samples)
        windows = np.empty(B, dtype=np.int64)
        for k in np.unique(source).tolist():
            mine = source == k
            W = self.sources[k].count
            epochs, within = np.divmod(index[mine], W)
            out = np.empty(len(within), dtype=np.int64)
            for e in np.unique(epochs).tolist():
                out[epochs == e] = self._shuffle(k, e)(within[epochs == e])
            windows[mine] = out
        return source, windows

    def window_ids(self, step: int, microbatch_id: int) -> np.ndarray:
        """The B window indices read by ``(step, microbatch_id)``, one per row (one source)."""
        return self.rows(step, microbatch_id)[1]

    def microbatch(self, step: int, microbatch_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both ``(B, T)`` torch.long; targets are inputs shifted by one token."""
        source, windows = self.rows(step, microbatch_id)
        if len(self.sources) == 1:
            return self.sources[0].gather(windows)
        inputs = torch.empty(self.microbatch_size, self.seq_len, dtype=torch.long)
        targets = torch.empty_like(inputs)
        for k in np.unique(source).tolist():
            mine = np.flatnonzero(source == k)
            inputs[mine], targets[mine] = self.sources[k].gather(windows[mine])
        return inputs, targets

    def _check(self, step: int, microbatch_id: int) -> None:
        if int(step) != step or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        M = self.microbatches_per_step
        if int(microbatch_id) != microbatch_id or not 0 <= microbatch_id < M:
            raise ValueError(
                f"microbatch_id must be in 0..{M - 1} (microbatches_per_step={M}), got {microbatch_id!r}"
            )


class EvalSampler:
    """Fixed, unshuffled validation batches: batch ``i`` reads windows ``i*B .. i*B+B-1`` (mod W) of the
    validation windows of every source, in order."""

    def __init__(self, dataset: TokenDataset | Sequence[TokenDataset], seq_len: int, microbatch_size: int) -> None:
        self.microbatch_size = _positive("microbatch_size", microbatch_size)
        datasets = [dataset] if isinstance(dataset, TokenDataset) else list(dataset)
        self.windows = _Windows(datasets, seq_len, self.microbatch_size, split="val")
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


def source_dirs(cfg: DataConfig) -> list[tuple[DataConfig, Path, float]]:
    """Each source of ``cfg`` (one without ``data.sources``) as ``(its config, its directory, its weight)``;
    a ``builtin:`` one must be prepared already (:func:`recover.data.prepare.prepared_data_dir` does)."""
    from recover.data.layout import resolve_data_dir

    return [(part, resolve_data_dir(part), weight) for part, weight in cfg.parts()]


def open_samplers(cfg: DataConfig, data_dir: Path, vocab_size: int, microbatches: int,
                  seed: int) -> tuple[Sampler, EvalSampler]:
    """The training sampler and the validation batches of a prepared shard directory (``data_dir``), or of
    every source of a mixture (``cfg.sources``; ``data_dir`` is then the first one's).

    Raises:
        DataError: a shard is unreadable, a source's vocabulary differs from the first one's, or a split
            is missing (named).
    """
    parts = source_dirs(cfg) if cfg.sources else [(cfg, data_dir, 1.0)]
    opened = [check_data(part, directory, vocab_size) for part, directory, _ in parts]
    if len(parts) > 1:
        check_same_vocab(parts)
    sampler = Sampler([train for train, _ in opened], cfg.seq_len, cfg.microbatch_size, microbatches, seed,
                      weights=[w for _, _, w in parts], vocab_size=vocab_size,
                      names=[part.path for part, _, _ in parts])
    return sampler, EvalSampler([val for _, val in opened], cfg.seq_len, cfg.microbatch_size)


def check_same_vocab(parts: Sequence[tuple[DataConfig, Path, float]]) -> None:
    """A mixture's sources must share a tokenizer: refuses recorded vocabularies that differ."""
    from recover.data.layout import data_vocab

    recorded = [(part.path, data_vocab(part, directory)) for part, directory, _ in parts]
    known = {(vocab[0]) for _, vocab in recorded if vocab is not None}
    if len(known) > 1:
        which = ", ".join(f"{path}: {vocab[0]} ({vocab[1]})" for path, vocab in recorded if vocab is not None)
        raise DataError(f"the sources of data.sources were tokenised differently ({which}); prepare them all "
                        "with the same tokenizer")


class TokenSamples:
    """``samples(step, id) -> (inputs, targets)`` of :func:`tokens`, both ``(microbatch_size, seq_len)`` int64;
    the targets are the inputs shifted by one (``targets[:, t] == inputs[:, t + 1]``): a loss on the logits
    takes them as they are (Hugging Face's ``labels=`` shifts again: give it the inputs).

    ``vocab_size``: the vocabulary the ids are checked against (the data's recorded one by default; None when
    the data records none): the model's embedding needs at least that many rows. ``tokens_per_microbatch``:
    for :class:`recover.api.Job`'s token counts."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.vocab_size: int | None = sampler.sources[0].vocab_size
        self.tokens_per_microbatch = sampler.tokens_per_microbatch

    def __call__(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sampler.microbatch(step, mb)


def tokens(path: str | Path | Sequence[str | Path], *, seq_len: int, microbatch_size: int, microbatches: int,
           seed: int = 0, vocab_size: int | None = None, weights: Sequence[float] | None = None,
           ) -> TokenSamples:
    """Token shards as ``samples(step, id) -> (inputs, targets)`` for :class:`recover.api.Job`
    (:class:`TokenSamples`: with the data's ``vocab_size``): the training
    split of a directory of recover's, nanoGPT's or llm.c's shards (or ``builtin:stdlib``, prepared on
    first use), or a mixture of several directories with ``weights``; windows of ``seq_len`` + 1 tokens
    drawn by (seed, step, id) as for the built-in trainer. Headers and sizes are checked first, and every
    microbatch's ids against ``vocab_size`` (default: the data's recorded vocabulary).

    Raises:
        DataError: no training split, a damaged shard, sources of different tokenizers, or an id beyond the
            vocabulary (one line, named).
    """
    from recover.config import DataSource
    from recover.data.layout import check_vocab_fits, data_vocab, split_format, split_pattern
    from recover.data.prepare import prepared_data_dir

    paths = [path] if isinstance(path, (str, Path)) else list(path)
    weights = list(weights) if weights is not None else [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ValueError(f"{len(weights)} weights for {len(paths)} paths")
    data = DataConfig(path=str(paths[0]), seq_len=seq_len, microbatch_size=microbatch_size,
                      sources=tuple(DataSource(str(p), w) for p, w in zip(paths, weights, strict=True))
                      if len(paths) > 1 else ())
    prepared_data_dir(data, quiet=True)
    parts = source_dirs(data)
    if len(parts) > 1:
        check_same_vocab(parts)
    recorded = data_vocab(parts[0][0], parts[0][1])
    vocab = vocab_size or (recorded[0] if recorded else None)
    if vocab is not None:
        check_vocab_fits(vocab, recorded)
    train = [TokenDataset(str(directory / split_pattern(part, directory, "train")),
                          fmt=split_format(part, directory, "train")) for part, directory, _ in parts]
    return TokenSamples(Sampler(train, seq_len, microbatch_size, microbatches, seed, weights=weights,
                                vocab_size=vocab, names=[str(p) for p in paths]))
