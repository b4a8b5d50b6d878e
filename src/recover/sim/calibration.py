"""``--calibrate RUN_DIR``: the step time and recovery latency measured by a ``recover launch`` run.

Contract: :func:`calibrate` reads ``RUN_DIR/metrics.jsonl`` (one record per committed step with
``step`` and ``time_s``, optionally ``live_replicas``, ``generation``, ``microbatches``, ``tokens``)
and ``RUN_DIR/events.jsonl`` (records with ``kind``; recoveries carry ``latency_ms``), and returns
a :class:`Calibration`; :meth:`Calibration.apply` puts its step time and recovery latency into a
:class:`~recover.sim.model.JobSpec`. It never guesses silently:

* step time = median ``time_s`` of the full-size steps (``live_replicas`` at its maximum) whose
  generation did not change (no recovery inside), the first step left out as warm-up when
  there are more than two; a missing directory, a missing ``metrics.jsonl`` or no usable
  ``time_s`` raises :class:`~recover.errors.ConfigError` naming the file and field;
* recovery latency = median ``latency_ms`` / 1000 of the recovery events; without
  ``events.jsonl`` or without such events it is ``None`` and the spec keeps its own value
  (a note says so).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.errors import ConfigError
from recover.observe.events import read_jsonl
from recover.sim.model import JobSpec


@dataclass(frozen=True)
class Calibration:
    """What a run directory measured (``None``: not in the files)."""

    run_dir: Path
    step_time_s: float
    steps_used: int
    recovery_latency_s: float | None
    recoveries: int
    replicas: int | None
    microbatches: int | None
    tokens_per_step: int | None
    notes: tuple[str, ...]

    def apply(self, spec: JobSpec, keep: Collection[str] = ()) -> JobSpec:
        """``spec`` with the measured step time (overhead scaled with it) and recovery latency.

        Fields named in ``keep`` (e.g. given explicitly on the command line) are left alone.
        """
        changes: dict[str, Any] = {}
        if "step_time_s" not in keep:
            changes["step_time_s"] = self.step_time_s
            if "step_overhead_s" not in keep:
                changes["step_overhead_s"] = spec.step_overhead_s * self.step_time_s / spec.step_time_s
        if self.recovery_latency_s is not None and "recovery_latency_s" not in keep:
            changes["recovery_latency_s"] = self.recovery_latency_s
        return spec.replace(**changes, notes=spec.notes + (self.summary(),))

    def summary(self) -> str:
        latency = (f"recovery latency {self.recovery_latency_s:.3f} s (median of {self.recoveries} recoveries)"
                   if self.recovery_latency_s is not None else "no recovery latency measured (kept the preset's)")
        shape = ", ".join(f"{k} {v}" for k, v in (("replicas", self.replicas), ("M", self.microbatches),
                                                 ("tokens/step", self.tokens_per_step)) if v is not None)
        return (f"Calibrated from {self.run_dir}: step time {self.step_time_s:.4g} s (median of "
                f"{self.steps_used} full-size steps), {latency}" + (f"; measured run: {shape}" if shape else ""))


def _number(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _steps(path: Path) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(path):
        step = _number(rec, "step")
        if step is not None:
            by_step[int(step)] = rec  # a resumed run rewrites steps: keep the latest
    return [by_step[s] for s in sorted(by_step)]


def _mode(values: list[float]) -> int | None:
    return int(statistics.mode(values)) if values else None


def calibrate(run_dir: str | os.PathLike[str]) -> Calibration:
    """Reads a ``recover launch`` run directory; see the module docstring.

    Raises:
        ConfigError: the directory or ``metrics.jsonl`` is missing, or no step has a usable ``time_s``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--calibrate {run_dir}: not a directory; give the --out directory of `recover launch`")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"--calibrate {run_dir}: {metrics.name} is missing; `recover launch --out DIR` writes it")
    rows = [r for r in _steps(metrics) if (_number(r, "time_s") or 0) > 0]
    if not rows:
        raise ConfigError(f"--calibrate: {metrics} has no step record with a 'time_s' field > 0 "
                          "(one JSON object per step with 'step' and 'time_s' in seconds)")
    notes = []
    live = [_number(r, "live_replicas") for r in rows]
    top = max((v for v in live if v is not None), default=None)
    full, prev_gen = [], None
    for r, n in zip(rows, live, strict=True):
        gen = r.get("generation")
        same_gen = gen is None or prev_gen is None or gen == prev_gen
        prev_gen = gen
        if (top is None or n == top) and same_gen:
            full.append(r)
    if top is None:
        notes.append("no 'live_replicas' field: every step counted as full-size")
    if not full:
        full = rows
    if len(full) > 2:
        full = full[1:]  # the first step warms up (allocation, compilation)
    step_time = statistics.median(_number(r, "time_s") for r in full)
    latencies = _latencies(run_dir / "events.jsonl", notes)
    tokens = [v for v in (_number(r, "tokens") for r in rows) if v is not None]
    mbs = [v for v in (_number(r, "microbatches") for r in rows) if v is not None]
    return Calibration(
        run_dir=run_dir, step_time_s=float(step_time), steps_used=len(full),
        recovery_latency_s=statistics.median(latencies) / 1000.0 if latencies else None,
        recoveries=len(latencies), replicas=int(top) if top is not None else None,
        microbatches=_mode(mbs), tokens_per_step=_mode(tokens), notes=tuple(notes),
    )


def _latencies(events: Path, notes: list[str]) -> list[float]:
    if not events.is_file():
        notes.append(f"{events.name} missing: recovery latency not calibrated")
        return []
    out = []
    for rec in read_jsonl(events):
        kind = str(rec.get("kind", ""))
        ms = _number(rec, "latency_ms")
        if ms is not None and ms >= 0 and ("recover" in kind or not kind):
            out.append(ms)
    if not out:
        notes.append(f"{events.name} has no recovery record with 'latency_ms': recovery latency not calibrated")
    return out
