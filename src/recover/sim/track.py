"""The record of one strategy's simulated run: clock, GPU-seconds held, progress, time lost by cause.

Contract: a strategy only moves the clock through :class:`Track`, which stops the run at
``end_s`` or when the GPU-seconds held reach the budget, whichever comes first (``done`` turns
true and every later call is a no-op). Progress is the token count of the model state: it grows
by whole committed steps (:meth:`steps`, :meth:`step`) and may fall back on a rollback
(:meth:`rollback`). Time is either committed compute or lost to a named cause; :meth:`finish`
adds ``fewer_replicas`` (the time committed compute took beyond the failure-free rate: slower
steps on fewer replicas, or smaller steps), so that for every run

    elapsed = tokens / failure_free_throughput + sum(lost.values())

Time queries (:meth:`progress_at`, :meth:`gpu_s_at`) are vectorised over numpy arrays.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

CAUSES = ("checkpoint", "lost_work", "restart", "load", "waiting", "recovery", "recompute", "reconfig",
          "rejoin", "fewer_replicas", "unfinished", "stopped")
_EPS = 1e-9


def whole_steps(span: float, step_time: float) -> int | float:
    """Steps of ``step_time`` that complete within ``span`` (``inf`` for an infinite span)."""
    if span == math.inf:
        return math.inf
    return max(0, math.floor(span / step_time + _EPS))


class Track:
    """One strategy's run; see the module docstring."""

    def __init__(self, end_s: float, budget_gpu_s: float, failure_free_throughput: float) -> None:
        self.end_s = end_s
        self.budget_gpu_s = budget_gpu_s
        self.ff = failure_free_throughput
        self.t = 0.0
        self.gpu_s = 0.0
        self.tokens = 0
        self.steps_done = 0
        self.done = False
        self.lost: dict[str, float] = defaultdict(float)
        self.microbatches: Counter[int] = Counter()  # microbatches per committed step -> steps
        self._seg: list[tuple[float, int, float, int, int]] = [(0.0, 0, math.inf, 0, 0)]  # start, tokens, st, k, n
        self._gpu_t: list[float] = [0.0]
        self._gpu_v: list[float] = [0.0]

    # ---- moving the clock ---------------------------------------------------------------------
    def limit(self, gpus: int) -> float:
        """When the run ends if ``gpus`` are held from now on."""
        if gpus <= 0:
            return self.end_s
        return min(self.end_s, self.t + max(0.0, self.budget_gpu_s - self.gpu_s) / gpus)

    def _advance(self, dt: float, gpus: int) -> float:
        """Moves the clock by up to ``dt`` holding ``gpus``; returns the time moved."""
        if self.done:
            return 0.0
        lim = self.limit(gpus)
        new = self.t + dt
        if new >= lim - _EPS * max(1.0, lim):
            new = lim
            self.done = True
        moved = new - self.t
        self.gpu_s += gpus * moved
        self.t = new
        self._gpu_t.append(self.t)
        self._gpu_v.append(self.gpu_s)
        return moved

    def idle(self, dt: float, cause: str, gpus: int) -> bool:
        """``dt`` seconds lost to ``cause`` holding ``gpus``; False if the run ended meanwhile."""
        self.lost[cause] += self._advance(dt, gpus)
        return not self.done

    def hold(self, dt: float, gpus: int) -> float:
        """``dt`` seconds whose cause the caller books later (e.g. work a rollback may lose)."""
        return self._advance(dt, gpus)

    def steps(self, count: int | float, step_time: float, tokens: int, gpus: int, microbatches: int) -> int:
        """Runs up to ``count`` whole steps of ``tokens`` each; returns how many committed.

        If the run ends first, the steps that fit commit and the rest of the last one is
        ``unfinished``.
        """
        if self.done or count <= 0:
            return 0
        lim = self.limit(gpus)
        fit = whole_steps(lim - self.t, step_time)
        n = int(min(count, fit))
        if n > 0:
            self._seg.append((self.t, self.tokens, step_time, tokens, n))
            self._advance(n * step_time, gpus)
            self.tokens += n * tokens
            self.steps_done += n
            self.microbatches[microbatches] += n
        if n < count and not self.done:
            self.idle(lim - self.t, "unfinished", gpus)
        return n

    def step(self, compute_s: float, extra: dict[str, float], gpus: int, tokens: int, microbatches: int,
             extra_gpu_s: float = 0.0) -> bool:
        """One step whose time is ``compute_s`` plus ``extra`` lost time by cause; False if cut off.

        ``extra_gpu_s`` charges GPUs held for part of the step only (replicas that died in it).
        """
        total = compute_s + sum(extra.values())
        if self.done:
            return False
        over_budget = self.gpu_s + extra_gpu_s + gpus * total > self.budget_gpu_s * (1 + _EPS)
        if self.t + total > self.end_s * (1 + _EPS) or over_budget:
            self.idle(total, "unfinished", gpus)
            return False
        self._seg.append((self.t, self.tokens, total, tokens, 1))
        self.gpu_s += extra_gpu_s
        self._advance(total, gpus)
        for cause, dt in extra.items():
            self.lost[cause] += dt
        self.tokens += tokens
        self.steps_done += 1
        self.microbatches[microbatches] += 1
        return True

    def rollback(self, tokens: int, steps: int) -> None:
        """The model state falls back to ``tokens`` / ``steps`` (a checkpoint), now."""
        self._seg.append((self.t, tokens, math.inf, 0, 0))
        self.tokens = tokens
        self.steps_done = steps

    def finish(self) -> None:
        """Books ``fewer_replicas``: committed compute time beyond the failure-free rate."""
        booked = sum(v for c, v in self.lost.items() if c != "fewer_replicas")
        self.lost["fewer_replicas"] = max(0.0, self.t - booked - self.tokens / self.ff)

    # ---- queries --------------------------------------------------------------------------------
    def _arrays(self) -> tuple[np.ndarray, ...]:
        start, tok, st, k, n = (np.array(c, dtype=float) for c in zip(*self._seg, strict=True))
        return start, tok, st, k, n

    def progress_at(self, t: np.ndarray) -> np.ndarray:
        """Tokens of the model state at times ``t`` (after any commit or rollback at that instant)."""
        start, tok, st, k, n = self._arrays()
        i = np.searchsorted(start, t, side="right") - 1
        i = np.clip(i, 0, len(start) - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            done = np.floor((t - start[i]) / st[i] + _EPS)
        done = np.nan_to_num(np.clip(done, 0, n[i]))
        return tok[i] + k[i] * done

    def gpu_s_at(self, t: np.ndarray) -> np.ndarray:
        """GPU-seconds held up to times ``t``."""
        return np.interp(t, np.array(self._gpu_t), np.array(self._gpu_v))

    def time_to(self, tokens: float) -> float | None:
        """When the model state last reached ``tokens`` for good (``None``: not within the run)."""
        if self.tokens < tokens:
            return None
        start, tok, st, k, n = self._arrays()
        end_tok = tok + k * n
        below = np.nonzero(tok < tokens)[0]
        # the last segment that starts below the target; it (or a marker after it) crosses it
        i = int(below[-1])
        if end_tok[i] < tokens:
            return float(start[i + 1]) if i + 1 < len(start) else None
        return float(start[i] + st[i] * math.ceil((tokens - tok[i]) / k[i] - _EPS))
