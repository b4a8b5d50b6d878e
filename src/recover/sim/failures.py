"""GPU failures for the simulator: sampled per GPU, read from a trace file, or spread over a run.

Contract: every function returns failures as two numpy arrays sorted by time, ``times`` (seconds
from the start of the run) and ``gpus`` (GPU index ``0..gpus-1``), and depends only on its
arguments (sampling uses ``numpy.random.default_rng(seed)``), so every strategy of one simulation
sees the SAME failures. A failure of GPU ``g`` kills replica ``g // replica_gpus``.

Sampling model: each GPU slot fails after a lifetime drawn from an exponential distribution
(mean ``mttf``) or a Weibull distribution (shape ``k``, scale ``mttf / Gamma(1 + 1/k)`` so its
mean is ``mttf``); the slot gets a new GPU ``repair_s`` later, whose own lifetime starts then
(a renewal process per GPU). All slots are drawn at once with numpy, then only the slots that
failed inside the horizon are redrawn, so a 131,072-GPU month takes milliseconds.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from recover.errors import ConfigError

Failures = tuple[np.ndarray, np.ndarray]  # (times_s float64, gpus int64), sorted by time


def sample_failures(gpus: int, mttf_s: float, horizon_s: float, repair_s: float, seed: int,
                    shape: float = 1.0) -> Failures:
    """Per-GPU renewal failures before ``horizon_s``.

    Args:
        gpus: GPU slots of the job.
        mttf_s: mean lifetime of one GPU, seconds.
        horizon_s: failures at or after this time are not returned.
        repair_s: a failed slot gets a fresh GPU this long after its failure.
        seed: seed of the generator.
        shape: Weibull shape ``k``; ``1.0`` is the exponential distribution.
    """
    if not (mttf_s > 0 and shape > 0):
        raise ConfigError(f"per-GPU mean time to failure ({mttf_s} s) and Weibull shape ({shape}) must be > 0")
    rng = np.random.default_rng(seed)
    scale = mttf_s / math.gamma(1.0 + 1.0 / shape)

    def life(n: int) -> np.ndarray:
        return scale * rng.weibull(shape, n) if shape != 1.0 else rng.exponential(mttf_s, n)

    t = life(gpus)
    ids = np.arange(gpus, dtype=np.int64)
    out_t, out_g = [], []
    while True:
        inside = t < horizon_s
        if not inside.any():
            break
        t, ids = t[inside], ids[inside]
        out_t.append(t)
        out_g.append(ids)
        t = t + repair_s + life(len(t))
    return _sorted(out_t, out_g)


def _sorted(times: list[np.ndarray], gpus: list[np.ndarray]) -> Failures:
    if not times:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    t = np.concatenate(times)
    g = np.concatenate(gpus)
    order = np.lexsort((g, t))
    return t[order], g[order]


def from_pairs(pairs: tuple[tuple[float, int], ...] | list[tuple[float, int]]) -> Failures:
    """The (time_s, gpu) pairs of a trace as sorted arrays."""
    if not pairs:
        return _sorted([], [])
    t = np.array([float(p[0]) for p in pairs])
    g = np.array([int(p[1]) for p in pairs], dtype=np.int64)
    return _sorted([t], [g])


def read_trace(path: str | os.PathLike[str], gpus: int | None = None) -> tuple[tuple[float, int], ...]:
    """Reads a failure trace: one ``time_s gpu`` per line (blank lines and ``#`` comments allowed).

    Raises:
        ConfigError: a missing file, or a bad line (with its number): not two fields, a time that
            is not a finite number >= 0, a GPU that is not an integer in ``0..gpus-1``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"failure trace {path} does not exist; give a file with one 'time_s gpu' per line")
    pairs = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pairs.append(_parse_line(line, f"{path}:{lineno}", gpus))
    return tuple(sorted(pairs))


def _parse_line(line: str, where: str, gpus: int | None) -> tuple[float, int]:
    fields = line.replace(",", " ").split()
    if len(fields) != 2:
        raise ConfigError(f"{where}: {line!r} has {len(fields)} fields; each line must be 'time_s gpu', "
                          "e.g. '3600.5 17'")
    try:
        t = float(fields[0])
    except ValueError:
        raise ConfigError(f"{where}: time {fields[0]!r} is not a number of seconds") from None
    if not (math.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: time {fields[0]!r} must be a finite number of seconds >= 0")
    try:
        g = int(fields[1])
    except ValueError:
        raise ConfigError(f"{where}: gpu {fields[1]!r} is not an integer GPU index") from None
    if g < 0 or (gpus is not None and g >= gpus):
        allowed = f"0..{gpus - 1}" if gpus is not None else ">= 0"
        raise ConfigError(f"{where}: gpu {g} is out of range; allowed {allowed}")
    return t, g


def spread_losses(gpus: int, replica_gpus: int, lost_gpus: int, budget_gpu_h: float,
                  seed: int = 0) -> tuple[tuple[float, int], ...]:
    """``lost_gpus / replica_gpus`` replica losses evenly spread over a run that ends at the budget.

    With ``L`` losses and no replacement, the live GPUs step down from ``gpus`` by ``replica_gpus``
    at ``t_i = i * T / (L + 1)``; ``T`` is chosen so the GPUs held over ``[0, T]`` add up to the
    budget. The replicas lost are a seeded random choice; each loss names the replica's first GPU.
    """
    if lost_gpus % replica_gpus or not (0 < lost_gpus < gpus):
        raise ConfigError(f"lost_gpus = {lost_gpus} must be a positive multiple of the replica size "
                          f"{replica_gpus} below gpus = {gpus}")
    losses = lost_gpus // replica_gpus
    mean_gpus = sum(gpus - replica_gpus * j for j in range(losses + 1)) / (losses + 1)
    end_s = budget_gpu_h * 3600.0 / mean_gpus
    replicas = np.random.default_rng(seed).permutation(gpus // replica_gpus)[:losses]
    return tuple((end_s * (i + 1) / (losses + 1), int(r) * replica_gpus) for i, r in enumerate(replicas))
