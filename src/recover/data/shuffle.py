"""A keyed permutation of ``[0, n)`` in O(1) memory: the order of one epoch of samples.

Contract:
    * ``Shuffle(n, key)`` is a bijection of ``[0, n)`` onto itself, a pure function of ``(n, key)``
      (``key``: a tuple of non-negative integers, e.g. ``(seed, source, epoch)``): the same on every
      process, machine and numpy version, since it uses only 64-bit integer arithmetic.
    * Memory does not depend on ``n`` (a few round keys), and ``shuffle(x)`` costs O(len(x)): a
      Feistel network over the smallest ``2**b >= n`` (halves of ``ceil(b/2)`` and ``floor(b/2)`` bits,
      which trade places each round), walked again from any result that lands outside ``[0, n)`` (cycle
      walking keeps it a bijection of ``[0, n)``; the domain is less than 2n, so under two walks on
      average).
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
_WORD = (1 << 64) - 1
SMALL = 64  # up to this many inputs, Python integers beat numpy's per-call overhead


def _mix_int(z: int) -> int:
    """:func:`_mix` of one word, in Python integers (faster than numpy for a handful of rows)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _WORD
    return z ^ (z >> 31)


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
        self.bits = max(2, (self.n - 1).bit_length())  # the domain is 2**bits >= n
        self.keys = np.random.SeedSequence([int(k) for k in key]).generate_state(ROUNDS, np.uint64)
        self._keys = [int(k) for k in self.keys]

    def _one(self, x: int) -> int:
        """The image of one input, cycle-walked: the same function as :meth:`_rounds`, on Python ints."""
        while True:
            wide, narrow = (self.bits + 1) // 2, self.bits // 2
            left, right = x >> narrow, x & ((1 << narrow) - 1)
            for k in self._keys:
                left, right = right, left ^ (_mix_int(right ^ k) & ((1 << wide) - 1))
                wide, narrow = narrow, wide
            x = (left << narrow) | right
            if x < self.n:
                return x

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        wide, narrow = (self.bits + 1) // 2, self.bits // 2  # the halves' widths; they alternate
        left, right = x >> np.uint64(narrow), x & np.uint64((1 << narrow) - 1)
        for k in self.keys:  # (left: wide bits, right: narrow) -> (right, left ^ F(right)): widths swap
            left, right = right, left ^ (_mix(right ^ k) & np.uint64((1 << wide) - 1))
            wide, narrow = narrow, wide
        return (left << np.uint64(narrow)) | right

    def __call__(self, x: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """The images of ``x`` (each in ``[0, n)``) as int64, same shape."""
        x = np.asarray(x, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise ValueError(f"shuffle input outside [0, {self.n}): {int(x.min())}..{int(x.max())}")
        if x.size <= SMALL:
            return np.array([self._one(v) for v in x.ravel().tolist()], dtype=np.int64).reshape(x.shape)
        with np.errstate(over="ignore"):  # the mixer multiplies modulo 2**64 on purpose
            y = self._rounds(x.astype(np.uint64))
            out = y >= self.n
            while out.any():  # cycle walking: apply again until inside [0, n)
                y[out] = self._rounds(y[out])
                out = y >= self.n
        return y.astype(np.int64)
