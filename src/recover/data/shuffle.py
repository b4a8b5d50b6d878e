"""A keyed permutation of ``[0, n)`` in O(1) memory: the order of one epoch of samples.

Contract:
    * ``Shuffle(n, key)`` is a bijection of ``[0, n)`` onto itself, a pure function of ``(n, key)``
      (``key``: a tuple of non-negative integers, e.g. ``(seed, source, epoch)``): the same on every
      process, machine and numpy version, since it uses only 64-bit integer arithmetic.
    * Memory does not depend on ``n`` (a few round keys), and ``shuffle(x)`` costs O(len(x)): a
      balanced Feistel network over the smallest ``2**(2h) >= n``, walked again from any result that
      lands outside ``[0, n)`` (cycle walking keeps it a bijection of ``[0, n)``; the domain is less
      than 4n, so under four walks on average).
    * Six rounds, each a SplitMix64 finaliser of the half-block mixed with a round key drawn from
      ``numpy.random.SeedSequence(key)``: neighbouring inputs land far apart and different keys give
      unrelated orders. This is a shuffle for training data, not a cipher.

It replaces a materialised ``permutation(n)`` (8 bytes per sample: 80 GB at ``n = 1e10``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (a bijection of 64-bit words with full avalanche), element-wise."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Shuffle:
    """A keyed bijection of ``[0, n)`` (see the module docstring).

    Args:
        n: the size of the domain, ``>= 1``.
        key: non-negative integers that select the permutation.
    """

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"a shuffle needs a domain of at least 1 element, got {n!r}")
        self.n = int(n)
        self.half = max(1, ((self.n - 1).bit_length() + 1) // 2)  # bits per half: 2**(2*half) >= n
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([int(k) for k in key]).generate_state(ROUNDS, np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << h) | right

    def __call__(self, x: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """The images of ``x`` (each in ``[0, n)``) as int64, same shape."""
        x = np.asarray(x, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise ValueError(f"shuffle input outside [0, {self.n}): {int(x.min())}..{int(x.max())}")
        with np.errstate(over="ignore"):  # the mixer multiplies modulo 2**64 on purpose
            y = self._rounds(x.astype(np.uint64))
            out = y >= self.n
            while out.any():  # cycle walking: apply again until inside [0, n)
                y[out] = self._rounds(y[out])
                out = y >= self.n
        return y.astype(np.int64)
