"""A weighted mixture of sources as a pure function of the global sample index.

Contract:
    * ``Mixture(weights)`` splits the sample stream ``0, 1, 2, ...`` among ``K`` sources. ``counts(n)``
      is how many of the first ``n`` samples each source gets: exact integers that sum to ``n``, each
      nondecreasing in ``n``, each within ``K`` of ``n * weight`` (every prefix of the stream is
      stratified: no sampling noise to wait out), computed in O(K) for any ``n`` (no state, no table).
    * Sample ``i`` belongs to the one source whose count grows from ``counts(i)`` to ``counts(i + 1)``,
      and it is that source's sample number ``counts(i)[k]``: each source has its own stream ``0, 1, ...``
      and so its own epochs. ``assign(i)`` does this for an array of indices.
    * The rule: source 0 takes ``floor(n * w0)``; source 1 takes ``floor(r * w1 / (w1 + ... + wK-1))``
      of the ``r`` left, and so on; the last takes what remains. Each step is monotone in ``n``, so the
      counts are, and exactly one source grows per sample. Computed in float64 with IEEE rounding: the
      same on every process, exact for ``n`` below 2**53.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Mixture:
    """Sources ``0..K-1`` with ``weights`` (positive; normalised here)."""

    def __init__(self, weights: Sequence[float]) -> None:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
        if w.size == 0 or not np.isfinite(w).all() or (w <= 0).any():
            raise ValueError(f"mixture weights must be positive numbers, got {list(weights)!r}")
        self.weights = w / w.sum()
        rest = np.cumsum(self.weights[::-1])[::-1]  # w_k + ... + w_{K-1}
        self.shares = np.minimum(self.weights / rest, 1.0)  # source k's share of what sources k.. get
        self.shares[-1] = 1.0

    def __len__(self) -> int:
        return len(self.weights)

    def counts(self, n: np.ndarray | int) -> np.ndarray:
        """Samples of each source among the first ``n``: shape ``(*n.shape, K)``, int64."""
        left = np.asarray(n, dtype=np.int64)
        out = np.empty((*left.shape, len(self)), dtype=np.int64)
        for k, share in enumerate(self.shares):
            take = left if k == len(self) - 1 else np.floor(left * share).astype(np.int64)
            out[..., k] = take
            left = left - take
        return out

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index within the source)`` of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        before, after = self.counts(samples), self.counts(samples + 1)
        source = np.argmax(after - before, axis=-1)
        return source, np.take_along_axis(before, source[..., None], axis=-1)[..., 0]
