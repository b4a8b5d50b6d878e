"""Pure statistics of ``recover bench paper``: the seed test, loss bands, GPU-time budgets.

Contract: plain numbers in, plain numbers out; no process, no file, no torch, numpy only (no scipy:
the one quantile needed, Student's t at 95% two-sided, is tabulated here to 3 decimals).

The test of a final validation loss ``x`` against the failure-free seeds ``ref`` (n >= 2 values,
mean ``m``, sample standard deviation ``s``) is the two-sided 95% *prediction interval* of one more
failure-free seed, ``m +- t(0.975, n - 1) * s * sqrt(1 + 1/n)`` (:func:`prediction_interval`):
under "this system's run is one more failure-free run", ``x`` falls outside it with probability
5%. With several seeds of a system, each seed is tested, and the system's seeds as a group against
the failure-free ones by an exact two-sided permutation test of the difference of means
(:func:`permutation_p`; all splits enumerated up to :data:`MAX_EXACT` of them, else a seeded sample).

Seeds differ more among themselves than a system's run differs from the failure-free run of the SAME
seed (the same initialisation, data order and trace), so each system is also compared seed by seed
(:func:`paired_test`): the per-seed differences ``x_i - ref_i``, their mean, and the exact two-sided
sign-flip permutation test of that mean (all ``2**n`` sign patterns): "the failure changed nothing"
predicts differences symmetric about 0.

GPU-time budgets (:func:`budget_curve`): on emulated devices one replica is one device, so the
GPU-seconds a run has held by time ``t`` are the integral of its live replicas; the tokens held by
the model at that point count only committed steps that were not rolled back.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
"""Student's t 0.975 quantile for 1..30 degrees of freedom (two-sided 95%)."""
MAX_EXACT = 20_000
"""Permutation test: enumerate every split up to this many, else sample this many (seeded)."""


def t975(df: int) -> float:
    """Two-sided 95% Student's t critical value for ``df`` >= 1 degrees of freedom (1.96 beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T975[df - 1] if df <= len(T975) else 1.96


def prediction_interval(ref: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean, sd, low, high): the 95% prediction interval of one more value drawn like ``ref``.

    Raises:
        ValueError: fewer than 2 reference values.
    """
    if len(ref) < 2:
        raise ValueError(f"a spread needs at least 2 failure-free seeds, got {len(ref)}")
    m, s = statistics.fmean(ref), statistics.stdev(ref)
    half = t975(len(ref) - 1) * s * math.sqrt(1 + 1 / len(ref))
    return m, s, m - half, m + half


def permutation_p(a: Sequence[float], b: Sequence[float], seed: int = 0) -> float:
    """Two-sided p-value of ``|mean(a) - mean(b)|`` under exchangeable labels (1.0 if either is empty)."""
    if not a or not b:
        return 1.0
    pool = np.array([*a, *b], dtype=float)
    n, k = len(pool), len(a)
    observed = abs(pool[:k].mean() - pool[k:].mean())
    total = pool.sum()
    if math.comb(n, k) <= MAX_EXACT:
        splits = np.array([list(c) for c in itertools.combinations(range(n), k)])
    else:
        rng = np.random.default_rng(seed)
        splits = np.array([rng.choice(n, k, replace=False) for _ in range(MAX_EXACT)])
    sums = pool[splits].sum(axis=1)
    diffs = np.abs(sums / k - (total - sums) / (n - k))
    return float(np.mean(diffs >= observed - 1e-12))


def paired_test(ref: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """A system's final losses against the failure-free ones of the same seeds (same order, equal length).

    Returns:
        ``diffs`` (value - reference, per seed), ``mean_diff``, ``worse`` (seeds whose loss is higher) and
        ``p_paired`` (the exact two-sided sign-flip test of the mean difference; 1.0 when all are 0).
    """
    diffs = np.array(values, dtype=float) - np.array(ref, dtype=float)
    observed = abs(diffs.mean()) if len(diffs) else 0.0
    if not len(diffs) or observed == 0.0:
        return {"diffs": [float(d) for d in diffs], "mean_diff": 0.0, "worse": int((diffs > 0).sum()), "p_paired": 1.0}
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(diffs))))
    flipped = np.abs((signs * np.abs(diffs)).mean(axis=1))
    return {"diffs": [float(d) for d in diffs], "mean_diff": float(diffs.mean()), "worse": int((diffs > 0).sum()),
            "p_paired": float(np.mean(flipped >= observed - 1e-12))}


def seed_test(ref: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """A system's final losses (one per seed) against the failure-free seeds' spread.

    Returns:
        ``ref_mean``, ``ref_sd``, ``low``, ``high`` (the prediction interval), ``mean``, ``z`` (each
        value's z-score against the reference), ``inside`` (each value in the interval), ``all_inside``
        and ``p_permutation`` (means of the two groups).
    """
    m, s, low, high = prediction_interval(ref)
    return {"ref_mean": m, "ref_sd": s, "low": low, "high": high,
            "mean": statistics.fmean(values) if values else None,
            "z": [(v - m) / s if s > 0 else (0.0 if v == m else math.inf) for v in values],
            "inside": [low <= v <= high for v in values], "all_inside": all(low <= v <= high for v in values),
            "p_permutation": permutation_p(list(values), list(ref))}


def band(curves: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """Per-step ``mean``, ``low`` and ``high`` (min and max over seeds), over the steps all curves have."""
    n = min((len(c) for c in curves), default=0)
    if n == 0:
        return {"mean": [], "low": [], "high": []}
    arr = np.array([list(c[:n]) for c in curves], dtype=float)
    return {"mean": arr.mean(axis=0).tolist(), "low": arr.min(axis=0).tolist(), "high": arr.max(axis=0).tolist()}


def budget_curve(series: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(GPU-seconds held, model tokens) after each committed record.

    Args:
        series: ``(t, live_replicas, model_tokens)`` per committed record in time order, ``t`` in
            seconds since training started; the live replicas of a record are held since the record
            before it (so a relaunch's idle survivors are charged).
    """
    gpu, tok, prev = [0.0], [0.0], 0.0
    for t, live, tokens in series:
        gpu.append(gpu[-1] + max(0.0, t - prev) * live)
        tok.append(float(tokens))
        prev = t
    return np.array(gpu), np.array(tok)


def tokens_at(gpu_s: np.ndarray, tokens: np.ndarray, budget: float | np.ndarray) -> np.ndarray:
    """Model tokens once ``budget`` GPU-seconds are spent (the last record at or before it)."""
    idx = np.searchsorted(gpu_s, np.asarray(budget, dtype=float), side="right") - 1
    return tokens[np.clip(idx, 0, len(tokens) - 1)]


def after_failures(series: Sequence[Sequence[float]], first_kill_t: float | None) -> float | None:
    """Model tokens gained from the first failure to the end / that time (None without a failure)."""
    if first_kill_t is None or not series:
        return None
    end_t, end_tok = series[-1][0], series[-1][2]
    before = [s[2] for s in series if s[0] <= first_kill_t]
    start_tok = before[-1] if before else 0.0
    return (end_tok - start_tok) / (end_t - first_kill_t) if end_t > first_kill_t else None


def median_of(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None
