"""The simulated job: its description (:class:`JobSpec`) and its step times (:class:`StepModel`).

Contract: :class:`JobSpec` is plain frozen data, validated once in ``__post_init__`` (a bad field
raises :class:`~recover.errors.ConfigError` naming the field, the value and what is allowed).
:class:`StepModel` turns it into step times with the SAME workload policy as training
(:mod:`recover.workload`): a step over ``n`` live replicas takes
``overhead + t_mb * makespan(assign(range(M), range(n)))``, and a replica lost mid-step costs the
makespan of :func:`~recover.workload.replan` of its orphaned microbatches over the survivors.
Every failed step it plans is checked with :func:`~recover.workload.check_assignment`, so a
``recover`` step always carries all M microbatches.

Model of a replica (stated once, used everywhere): replicas are identical (no stragglers); a
microbatch costs ``t_mb`` seconds on any replica; the per-step ``overhead`` (all-reduce, optimizer)
does not depend on the quota. With all ``R`` replicas live a step takes exactly ``step_time_s``.
The overhead is ``step_overhead_s`` at every live count unless ``step_overhead_by_live`` gives it
measured at some counts (collectives and hosts whose cost changes with the processes taking part);
likewise a relaunch costs ``restart_s`` unless ``restart_by_replicas`` gives it by the number of
replicas relaunched. Both tables are read by :func:`interpolate`: linear between the measured
counts, flat beyond them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from recover.errors import ConfigError
from recover.train.checkpoints.cadence import young_daly_interval_s
from recover.workload import assign, check_assignment, makespan, quotas, replan
from recover.workload.policy import Assignment

FAILURE_KINDS = ("exponential", "weibull", "trace", "none")
RESTART_MODES = ("survivors", "replace")
HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True)
class JobSpec:
    """One training job and its environment; every cost is in seconds of wall time."""

    gpus: int = 1024
    """GPUs of the whole job at full size."""
    tp: int = 8
    """tensor-parallel degree inside a replica."""
    pp: int = 1
    """pipeline stages inside a replica."""
    shard: int = 1
    """FSDP shard-group size inside a replica (HSDP); a replica is ``pp * tp * shard`` GPUs."""
    microbatches: int = 1024
    """M: microbatches per step (the global batch); recover keeps it constant."""
    tokens_per_microbatch: int = 8192
    """tokens in one microbatch (sequences x sequence length)."""
    step_time_s: float = 10.0
    """failure-free step time with every replica live."""
    step_overhead_s: float = 0.0
    """part of a step that does not grow with the quota (gradient all-reduce, optimizer step)."""
    step_overhead_by_live: tuple[tuple[int, float], ...] = ()
    """(live replicas, step overhead s) measured at some live counts; empty: ``step_overhead_s`` at every count."""
    duration_s: float = 7 * DAY
    """wall-clock length of the run (it ends earlier if the GPU-hour budget is spent)."""
    budget_gpu_h: float | None = None
    """GPU-hour budget (GPUs held x hours); ``None`` means ``gpus * duration`` (the full allocation)."""
    failures: str = "exponential"
    """failure model: exponential, weibull, trace (replay ``trace``) or none."""
    gpu_mttf_h: float = 50_000.0
    """mean time to failure of ONE GPU, hours (the job's MTBF is this / gpus)."""
    weibull_shape: float = 1.0
    """Weibull shape k (< 1: infant mortality, 1: exponential, > 1: wear-out)."""
    trace: tuple[tuple[float, int], ...] = ()
    """(time_s, gpu) failures replayed when ``failures == 'trace'``."""
    repair_s: float = 3600.0
    """time until a failed GPU's replica is replaced (hot spare or repair) and may rejoin."""
    rejoin: bool = True
    """failed replicas are replaced ``repair_s`` later and taken back (recover and shrink-drop at a
    step boundary, checkpoint-restart at a relaunch); False: lost GPUs are never replaced."""
    min_replicas: int = 1
    """fewest live replicas a job runs with; below it the job waits for replacements."""
    recovery_latency_s: float = 2.0
    """recover: failure detection + new generation (communicator) before orphans are recomputed."""
    rejoin_cost_s: float = 30.0
    """recover/shrink-drop: a joining replica receives the model + optimizer state (job paused)."""
    save_s: float = 30.0
    """checkpoint-restart: blocking checkpoint save."""
    load_s: float = 60.0
    """checkpoint-restart: checkpoint load after a restart."""
    restart_s: float = 180.0
    """checkpoint-restart: relaunch of the job (scheduler, process start, communicator init)."""
    restart_by_replicas: tuple[tuple[int, float], ...] = ()
    """(replicas relaunched, relaunch s) measured at some sizes; empty: ``restart_s`` at every size."""
    restart_mode: str = "survivors"
    """checkpoint-restart after a failure: 'survivors' (relaunch at once on the live replicas, keeping
    M by gradient accumulation) or 'replace' (the relaunch waits for the replacement)."""
    checkpoint_interval_s: float | None = None
    """compute time between checkpoints; ``None``: Young/Daly ``sqrt(2 * save_s * MTBF_job)``."""
    reconfig_s: float = 2.0
    """shrink-drop: quorum + process-group reconfiguration after a failure (torchft-like)."""
    target_tokens: float | None = None
    """token target for 'time to target'; ``None``: half of the failure-free tokens of the run."""
    seed: int = 0
    """seed of the sampled failures (the same failures for every strategy)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """assumptions behind the numbers (presets fill it; printed and written to the JSON)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "tp", "pp", "shard", "microbatches", "tokens_per_microbatch", "min_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} = {value!r} must be an integer >= 1")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed = {self.seed!r} must be an integer")
        for name in ("step_time_s", "duration_s", "gpu_mttf_h", "weibull_shape"):
            _positive(name, getattr(self, name))
        for name in ("step_overhead_s", "repair_s", "recovery_latency_s", "rejoin_cost_s", "save_s",
                     "load_s", "restart_s", "reconfig_s"):
            _non_negative(name, getattr(self, name))
        for name in ("budget_gpu_h", "checkpoint_interval_s", "target_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.failures not in FAILURE_KINDS:
            raise ConfigError(f"failures = {self.failures!r} must be one of {', '.join(FAILURE_KINDS)}")
        if self.restart_mode not in RESTART_MODES:
            raise ConfigError(f"restart_mode = {self.restart_mode!r} must be one of {', '.join(RESTART_MODES)}")
        if self.restart_mode == "replace" and not self.rejoin:
            raise ConfigError("restart_mode = 'replace' needs rejoin = True (replacements to wait for); "
                              "use restart_mode = 'survivors' when lost GPUs are never replaced")
        if self.gpus % self.replica_gpus:
            raise ConfigError(f"gpus = {self.gpus} is not a multiple of the replica size pp*tp*shard = "
                              f"{self.replica_gpus}; change gpus or the replica shape")
        if self.microbatches < self.replicas:
            raise ConfigError(f"microbatches = {self.microbatches} must be >= the {self.replicas} replicas "
                              "(every replica needs at least one microbatch)")
        if self.min_replicas > self.replicas:
            raise ConfigError(f"min_replicas = {self.min_replicas} must be <= the {self.replicas} replicas")
        if self.step_overhead_s >= self.step_time_s:
            raise ConfigError(f"step_overhead_s = {self.step_overhead_s} must be < step_time_s = {self.step_time_s}")
        for name in ("step_overhead_by_live", "restart_by_replicas"):
            for n, cost in getattr(self, name):
                if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not (math.isfinite(cost) and cost >= 0):
                    raise ConfigError(f"{name} entry ({n!r}, {cost!r}): a replica count >= 1 and seconds >= 0")
        if self.step_overhead_by_live and self.overhead(self.replicas) >= self.step_time_s:
            raise ConfigError(f"step_overhead_by_live gives {self.overhead(self.replicas)} s at the full "
                              f"{self.replicas} replicas, not < step_time_s = {self.step_time_s}")
        for t, g in self.trace:
            if not (0 <= g < self.gpus):
                raise ConfigError(f"trace failure of gpu {g} at {t} s: gpu must be in 0..{self.gpus - 1}")

    def overhead(self, live: int) -> float:
        """The step overhead with ``live`` replicas (``step_overhead_by_live`` or ``step_overhead_s``)."""
        return interpolate(self.step_overhead_by_live, live, self.step_overhead_s)

    def restart_for(self, replicas: int) -> float:
        """The relaunch cost of ``replicas`` replicas (``restart_by_replicas`` or ``restart_s``)."""
        return interpolate(self.restart_by_replicas, replicas, self.restart_s)

    @property
    def replica_gpus(self) -> int:
        """GPUs in one replica, the failure unit: ``pp * tp * shard``."""
        return self.pp * self.tp * self.shard

    @property
    def replicas(self) -> int:
        """R: replicas of the job at full size."""
        return self.gpus // self.replica_gpus

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.tokens_per_microbatch

    @property
    def budget_gpu_s(self) -> float:
        """The GPU-hour budget in GPU-seconds (the full allocation when none is given)."""
        return self.gpus * self.duration_s if self.budget_gpu_h is None else self.budget_gpu_h * HOUR

    @property
    def failure_free_throughput(self) -> float:
        """Tokens per second with every replica live and no failure."""
        return self.tokens_per_step / self.step_time_s

    def job_mtbf_s(self) -> float:
        """Mean time between failures of the whole job at full size (``inf`` without failures)."""
        if self.failures == "none":
            return math.inf
        if self.failures == "trace":
            if not self.trace:
                return math.inf
            return max(t for t, _ in self.trace) / len(self.trace) or math.inf
        return self.gpu_mttf_h * HOUR / self.gpus

    def replace(self, **changes: object) -> JobSpec:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def interpolate(table: Sequence[tuple[int, float]], n: int, default: float) -> float:
    """``table``'s value at ``n``: linear between its counts, flat beyond them; ``default`` when empty."""
    if not table:
        return default
    pts = sorted(table)
    if n <= pts[0][0]:
        return float(pts[0][1])
    for (n0, v0), (n1, v1) in zip(pts, pts[1:], strict=False):
        if n <= n1:
            return float(v0 + (v1 - v0) * (n - n0) / (n1 - n0)) if n1 != n0 else float(v1)
    return float(pts[-1][1])


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} = {value!r} must be a finite number > 0")


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} = {value!r} must be a finite number >= 0")


class StepModel:
    """Step times of one :class:`JobSpec` under the workload policy (cached by live-replica count).

    Replicas are interchangeable, so the policy is evaluated on the canonical live set
    ``range(n)``: a replica's quota depends only on its position in the sorted live set.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.M = spec.microbatches
        self.R = spec.replicas
        self.full_quota = quotas(assign(range(self.M), range(self.R)))  # {replica: microbatches}
        self.full_quotas = np.array([self.full_quota[r] for r in range(self.R)], dtype=np.int64)
        self.t_mb = (spec.step_time_s - spec.overhead(self.R)) / max(self.full_quota.values())
        self._plan = lru_cache(maxsize=None)(self._plan_uncached)
        self._single = lru_cache(maxsize=None)(self._single_uncached)
        self.step_time = lru_cache(maxsize=None)(self._step_time)  # type: ignore[method-assign]
        self.checked_steps = 0  # failed-step plans verified to hold all M ids

    def _plan_uncached(self, n: int) -> Assignment:
        return assign(range(self.M), range(n))

    def compute_time(self, quota: float, live: int | None = None) -> float:
        """The step time when the busiest of ``live`` replicas (default all) runs ``quota`` microbatches."""
        live = self.R if live is None else live
        if quota == max(self.full_quota.values()) and live == self.R:
            return self.spec.step_time_s  # exact, no rounding through t_mb
        return self.spec.overhead(live) + self.t_mb * quota

    def step_time(self, n: int) -> float:
        """A failure-free step over ``n`` live replicas carrying all M microbatches (cached)."""
        return self._step_time(n)

    def _step_time(self, n: int) -> float:
        if n < 1:
            raise ValueError("a step needs at least one live replica")
        return self.compute_time(makespan(self._plan(n)), n)

    def quota(self, n: int, position: int) -> int:
        """Microbatches of the replica at ``position`` of ``n`` sorted live replicas."""
        return len(self._plan(n)[position])

    def failed_step(self, n: int, positions: Sequence[int]) -> list[float]:
        """Extra compute of a step over ``n`` live replicas that loses those at ``positions`` in turn.

        Each round re-plans the orphans (the dead replica's ids plus any orphans it had taken) over
        the remaining replicas with :func:`~recover.workload.replan`, exactly as training does.

        Returns:
            the makespan in seconds of each round's orphans (one entry per position).

        Raises:
            ValueError: no replica left, or (a bug) a plan that does not hold all M ids.
        """
        if len(positions) == 1:
            return [self._single(n, self.quota(n, positions[0]))]
        merged: dict[int, list[int]] = {r: list(ids) for r, ids in self._plan(n).items()}
        live = set(range(n))
        rounds = []
        for pos in positions:
            if len(live) <= 1:
                raise ValueError(f"no survivor left in a step of {n} replicas after losing {list(positions)}")
            new = replan(merged, None, [pos], live)
            live.discard(pos)
            del merged[pos]
            for r, ids in new.items():
                merged[r].extend(ids)
            rounds.append(self.t_mb * makespan(new))
        check_assignment(merged, range(self.M))
        self.checked_steps += 1
        return rounds

    def _single_uncached(self, n: int, quota: int) -> float:
        # canonical dead replica: the first position with this quota
        pos = next(p for p in range(n) if self.quota(n, p) == quota)
        plan = self._plan(n)
        new = replan(plan, None, [pos], range(n))
        merged = {r: list(plan[r]) + new.get(r, []) for r in plan if r != pos}
        check_assignment(merged, range(self.M))
        self.checked_steps += 1
        return self.t_mb * makespan(new)

    def checkpoint_every(self) -> float:
        """Steps between checkpoints (``inf``: never), from the interval or Young/Daly."""
        spec = self.spec
        interval = spec.checkpoint_interval_s
        if interval is None:
            mtbf = spec.job_mtbf_s()
            if not math.isfinite(mtbf) or spec.save_s == 0:
                return math.inf if not math.isfinite(mtbf) else 1
            interval = young_daly_interval_s(spec.save_s, mtbf)
        return max(1, round(interval / spec.step_time_s))
