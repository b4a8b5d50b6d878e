"""Runs the strategies of one simulated job over the same failures and measures them.

Contract: :func:`simulate` is a pure function of the :class:`~recover.sim.model.JobSpec` (its
seed included): it draws (or replays) the GPU failures ONCE, maps each to its replica
(``gpu // replica_gpus``), plays every strategy over them, and returns a :class:`SimResult`.

Measures, per strategy (a run ends at ``duration_s`` or when the GPUs it held reach the budget):

* ``effective_throughput``: tokens in the final model state / elapsed wall time (rolled-back
  steps do not count; for shrink-drop only the microbatches its committed steps carried);
* ``tokens_at_budget``: tokens in the model state when the run ended (by budget or duration);
* ``throughput_after_failures``: the same rate over ``[first failure, end]``: what is left once
  failures start to hit (the paper's "after successive failures");
* ``time_to_target_s``: when the model state reached ``target_tokens`` for good;
* ``time_lost_by_cause``: the fraction of elapsed time lost to each cause, where lost time is
  ``elapsed - tokens / failure_free_throughput`` split by cause (see :mod:`recover.sim.track`).

GPUs are charged while they belong to a live replica (the survivors also during restarts and
waits); a dead replica's GPUs are charged from its failure to its rejoin by no strategy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recover.errors import ConfigError
from recover.sim.failures import Failures, from_pairs, sample_failures
from recover.sim.members import Members
from recover.sim.model import HOUR, JobSpec, StepModel
from recover.sim.restart import run_checkpoint_restart
from recover.sim.strategies import run_recover, run_shrink_drop
from recover.sim.track import CAUSES, Track

Strategy = Callable[[StepModel, Members, Track], None]
STRATEGIES: dict[str, Strategy] = {
    "recover": run_recover,
    "checkpoint-restart": run_checkpoint_restart,
    "shrink-drop": run_shrink_drop,
}
BASELINE = "checkpoint-restart"


@dataclass
class StrategyResult:
    """One strategy's measured run (its :class:`Track` keeps the full timeline)."""

    name: str
    track: Track
    failures_hit: int
    first_failure_s: float | None
    target_tokens: float

    @property
    def elapsed_s(self) -> float:
        return self.track.t

    @property
    def tokens(self) -> int:
        return self.track.tokens

    @property
    def tokens_at_budget(self) -> int:
        """Tokens of the model state when the run ended (budget spent, or the duration is over)."""
        return self.track.tokens

    @property
    def gpu_hours(self) -> float:
        return self.track.gpu_s / HOUR

    @property
    def effective_throughput(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def throughput_after_failures(self) -> float | None:
        t0 = self.first_failure_s
        if t0 is None or t0 >= self.elapsed_s:
            return None
        before = float(self.track.progress_at(np.array([t0]))[0])
        return (self.tokens - before) / (self.elapsed_s - t0)

    @property
    def time_to_target_s(self) -> float | None:
        return self.track.time_to(self.target_tokens)

    @property
    def time_lost_s(self) -> dict[str, float]:
        return {c: float(self.track.lost.get(c, 0.0)) for c in CAUSES}

    @property
    def time_lost_by_cause(self) -> dict[str, float]:
        e = self.elapsed_s or 1.0
        return {c: v / e for c, v in self.time_lost_s.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "effective_throughput": self.effective_throughput,
            "tokens_at_budget": self.tokens_at_budget,
            "throughput_after_failures": self.throughput_after_failures,
            "time_to_target_s": self.time_to_target_s,
            "time_lost_by_cause": self.time_lost_by_cause,
            "time_lost_s": self.time_lost_s,
            "elapsed_s": self.elapsed_s,
            "gpu_hours": self.gpu_hours,
            "steps": self.track.steps_done,
            "failures_hit": self.failures_hit,
            "microbatches_per_step": {str(k): v for k, v in sorted(self.track.microbatches.items())},
        }


@dataclass
class SimResult:
    """Every strategy of one simulated job, over the same failures."""

    spec: JobSpec
    failure_times: np.ndarray
    failure_gpus: np.ndarray
    strategies: dict[str, StrategyResult]
    target_tokens: float
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failure_free_throughput(self) -> float:
        return self.spec.failure_free_throughput

    def ratio(self, num: str, den: str, measure: str) -> float | None:
        """``measure`` of strategy ``num`` over that of ``den`` (``None`` if either is missing or 0)."""
        if num not in self.strategies or den not in self.strategies:
            return None
        a, b = getattr(self.strategies[num], measure), getattr(self.strategies[den], measure)
        if a is None or not b:
            return None
        return a / b

    def ratios(self) -> dict[str, dict[str, float | None]]:
        out = {}
        for den in (BASELINE, "shrink-drop"):
            if "recover" in self.strategies and den in self.strategies:
                out[f"recover/{den}"] = {
                    m: self.ratio("recover", den, m)
                    for m in ("effective_throughput", "throughput_after_failures", "tokens_at_budget")
                }
        return out

    def throughput_series(self, bins: int = 60) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Bin centres (s) and, per strategy, the net tokens/s committed in each bin.

        A bin spans at least 5 failure-free steps (fewer bins on short runs); a rollback
        makes its bin's rate negative.
        """
        end = max(r.elapsed_s for r in self.strategies.values())
        bins = max(1, min(bins, int(end / (5 * self.spec.step_time_s))))
        edges = np.linspace(0.0, end, bins + 1)
        width = edges[1] - edges[0] if end > 0 else 1.0
        out = {}
        for name, r in self.strategies.items():
            p = r.track.progress_at(edges)
            rate = np.diff(p) / width
            rate[edges[1:] > r.elapsed_s + width] = np.nan  # after this strategy's run ended
            out[name] = rate
        return (edges[:-1] + edges[1:]) / 2, out

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "job": _spec_json(spec),
            "replicas": spec.replicas,
            "failure_free_throughput": self.failure_free_throughput,
            "target_tokens": self.target_tokens,
            "failures": int(len(self.failure_times)),
            "strategies": {n: r.to_json() for n, r in self.strategies.items()},
            "ratios": self.ratios(),
            "assumptions": list(spec.notes),
            "simulation_wall_s": self.wall_s,
            **self.extra,
        }


def _spec_json(spec: JobSpec) -> dict[str, Any]:
    out = {k: getattr(spec, k) for k in spec.__dataclass_fields__ if k not in ("trace", "notes")}
    out["trace_failures"] = len(spec.trace)
    out["replica_gpus"] = spec.replica_gpus
    out["job_mtbf_h"] = spec.job_mtbf_s() / HOUR if math.isfinite(spec.job_mtbf_s()) else None
    return out


def job_failures(spec: JobSpec) -> Failures:
    """The job's GPU failures before ``duration_s`` (the same for every strategy)."""
    if spec.failures == "none":
        return from_pairs(())
    if spec.failures == "trace":
        t, g = from_pairs(spec.trace)
        keep = t < spec.duration_s
        return t[keep], g[keep]
    shape = spec.weibull_shape if spec.failures == "weibull" else 1.0
    return sample_failures(spec.gpus, spec.gpu_mttf_h * HOUR, spec.duration_s, spec.repair_s, spec.seed, shape)


def failure_free_tokens(spec: JobSpec) -> int:
    """Tokens a run with no failure commits before its end (duration or budget)."""
    run_s = min(spec.duration_s, spec.budget_gpu_s / spec.gpus)
    return math.floor(run_s / spec.step_time_s + 1e-9) * spec.tokens_per_step


def simulate(spec: JobSpec, strategies: Sequence[str] = tuple(STRATEGIES)) -> SimResult:
    """Plays ``strategies`` on ``spec`` over one set of failures; see the module docstring.

    Raises:
        ConfigError: an unknown strategy name.
    """
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ConfigError(f"strategies = {list(strategies)!r}: allowed {', '.join(STRATEGIES)}")
    start = time.perf_counter()
    times, gpus = job_failures(spec)
    replicas = gpus // spec.replica_gpus
    target = spec.target_tokens or failure_free_tokens(spec) / 2
    sm = StepModel(spec)
    results = {}
    for name in strategies:
        track = Track(spec.duration_s, spec.budget_gpu_s, spec.failure_free_throughput)
        members = Members(spec, times, replicas)
        STRATEGIES[name](sm, members, track)
        track.finish()
        results[name] = StrategyResult(name, track, members.hits, members.first_hit, target)
    return SimResult(spec, times, gpus, results, target, time.perf_counter() - start)
