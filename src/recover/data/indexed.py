"""Any map-style dataset (``__len__`` and ``__getitem__``) as a Job's ``samples(step, id)``.

Contract (the data half of recover's invariant, as :mod:`recover.data.sampler` for token shards):
    * Epoch ``e`` is one pass over the dataset's N indices in the order
      ``perm_e = np.random.default_rng([seed, e]).permutation(N)``; it holds ``S = N // (B*M)`` steps,
      and the ``N mod B*M`` indices left at the end of ``perm_e`` are not drawn in that epoch (as a
      DataLoader's ``drop_last``), so the B*M indices of a step are always distinct.
    * Step ``s`` is in epoch ``e = s // S`` and takes the slice ``perm_e[(s % S)*B*M : (s % S + 1)*B*M]``;
      microbatch ``i`` of it takes the ``i``-th block of B of that slice, collated into one batch.
    * A pure function of (seed, step, id): no cursor, no dependence on rank, world size, call order or
      process. Nothing proportional to the dataset is held besides the permutation of the epoch last
      asked for (cached).
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, Protocol

import numpy as np


class MapDataset(Sized, Protocol):
    def __getitem__(self, index: int) -> Any: ...


class Indexed:
    """``(step, id) -> batch`` over ``dataset`` (see the module docstring and :func:`indexed`)."""

    def __init__(self, dataset: MapDataset, collate: Callable[[list[Any]], Any] | None, microbatch_size: int,
                 microbatches: int, seed: int) -> None:
        for name, value in (("microbatch_size", microbatch_size), ("microbatches", microbatches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: a positive integer is needed")
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.dataset, self.collate, self.seed = dataset, collate, seed
        self.B, self.M, self.N = microbatch_size, microbatches, len(dataset)
        if self.N < self.B * self.M:
            raise ValueError(f"the dataset has {self.N} samples, fewer than the {self.B * self.M} one step draws "
                             f"(microbatch_size {self.B} x microbatches {self.M}); lower one of them or use more data")
        self.steps_per_epoch = self.N // (self.B * self.M)
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, its permutation)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int, mb: int) -> list[int]:
        """The B dataset indices of microbatch ``mb`` of ``step``."""
        if int(step) != step or step < 0:
            raise ValueError(f"step = {step!r}: an integer >= 0 is needed")
        if int(mb) != mb or not 0 <= mb < self.M:
            raise ValueError(f"microbatch id = {mb!r}: it must be in 0..{self.M - 1} (microbatches={self.M})")
        step, mb = int(step), int(mb)
        first = ((step % self.steps_per_epoch) * self.M + mb) * self.B
        return self._permutation(self.epoch_of(step))[first:first + self.B].tolist()

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.N))
        return self._perm[1]

    def __call__(self, step: int, mb: int) -> Any:
        return self.collate([self.dataset[i] for i in self.indices(step, mb)])


def indexed(dataset: MapDataset, collate: Callable[[list[Any]], Any] | None = None, *, microbatch_size: int,
            microbatches: int, seed: int = 0) -> Indexed:
    """A map-style dataset as ``samples(step, id) -> batch`` for :class:`recover.api.Job`: microbatch ``id`` of
    ``step`` is ``collate`` (default: ``torch.utils.data.default_collate``) of ``microbatch_size`` items drawn
    without replacement within the step, each epoch in its own seeded order (see the module docstring).

    Raises:
        ValueError: a size that is not a positive integer, or a dataset smaller than one step's
            ``microbatch_size * microbatches`` samples.
    """
    return Indexed(dataset, collate, microbatch_size, microbatches, seed)
