"""The simulator checked against the emulated runs of ``recover bench paper``, then projected.

Contract: pure (no process, no file): measured numbers in, :class:`~recover.sim.model.JobSpec`
and rows out.

* :func:`job_spec` builds the spec of one measured run from MEASURED inputs only (the list
  :data:`MEASURED`): replicas, M and tokens per microbatch of the run; the failure-free step time
  (median full-size step of the failure-free reference); the emulated device time per microbatch
  (what the emulator enforces; the part of a step above ``ceil(M/N)`` of it is the step overhead);
  recover's recovery latency (median over kills of the kill to the new generation naming the
  replica dead: detection and the new generation); shrink-and-drop's reconfiguration;
  checkpoint-and-restart's relaunch cost (from its kill to its first commit after the relaunch,
  minus one step: detection, teardown, process start, rendezvous, checkpoint load and warm-up, all
  booked as ``restart_s``, ``load_s`` = 0), by the number of replicas relaunched when given
  (``restart_by_replicas``); its blocking save cost and the K it ran with; and the failure trace,
  each kill at the time it happened in THAT system's run (failures are keyed by step, so a system
  that loses time meets its later failures later). Nothing is fitted. With a ``calibration``
  (failure-free runs at fewer replicas, :func:`recover.bench.paperruns.run_calibration`) the step
  overhead is taken per live count (``step_overhead_by_live``: on a host whose cores the replicas
  share, the overhead falls as replicas die).
* :func:`costs_elsewhere` gives a seed the costs measured in the OTHER seeds' runs (leave one out),
  so that no run is simulated with a cost measured in itself (its own when no other seed has one).
* :func:`validate` replays each system twice: until it holds the measured run's tokens (effective
  throughput = those tokens / the time the simulated run takes to hold them, so that a step that
  ends a moment after the measured run's last does not count as lost) and to the GPU-time budget
  (tokens at the budget); a row is ``within`` when ``|simulated / measured - 1| <= TOLERANCE``.
* :func:`projections` runs the presets (``paper-512``, ``llama3-16k``, ``131k``) as published
  (their costs assumed, see :mod:`recover.sim.presets`), and again with the measured costs carried
  over as multiples of the step time (:data:`SCALED_COSTS`); everything else stays assumed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from recover.sim.engine import simulate
from recover.sim.model import HOUR, JobSpec
from recover.sim.presets import PRESETS, preset

TOLERANCE = 0.10
SIM_NAMES = {"recover": "recover", "checkpoint-and-restart": "checkpoint-restart", "shrink-and-drop": "shrink-drop"}
"""System name in the benchmark -> strategy name in the simulator."""
MEASURED = ("replicas", "microbatches", "tokens_per_microbatch", "step_time_s", "device_time_s",
            "recovery_latency_s", "reconfig_s", "restart_s", "relaunches", "save_s", "checkpoint_every", "kill times",
            "calibration: step overhead per live replica count")
SCALED_COSTS = {"recovery_latency_s": "recovery_latency_s", "reconfig_s": "reconfig_s",
                "restart_s": "restart_s", "save_s": "save_s"}
"""Measured cost -> JobSpec field carried to a projection as (cost / measured step time) x the preset's step."""
COSTS = ("recovery_latency_s", "reconfig_s", "restart_s", "save_s")
"""The measured costs of a run (:func:`costs_elsewhere` takes them, and ``relaunches``, from the other seeds)."""
PROJECTIONS = tuple(PRESETS)
ASSUMED = ("GPUs and the replica shape", "M and tokens per microbatch", "step time", "failure model or trace",
           "repair and rejoin costs", "restart mode", "the costs a preset keeps when one was not measured")
"""What a projection takes from the preset (docs/BENCHMARKS.md), not from the emulated runs."""


def job_spec(system: str, inputs: dict[str, Any], kills: Sequence[tuple[float, int]], duration_s: float,
             budget_gpu_s: float | None = None, calibration: Sequence[dict[str, Any]] = ()) -> JobSpec:
    """The simulated job of one measured run of ``system`` (see the module docstring).

    Args:
        inputs: the seed's measured inputs (keys of :data:`MEASURED`, ``None`` where not measured;
            ``relaunches``: ``[replicas relaunched, cost]`` pairs).
        kills: ``(seconds since training start, replica)`` of each kill in this system's run.
        duration_s: the run length to simulate.
        budget_gpu_s: the GPU-second budget, None for none.
        calibration: points of failure-free runs at fewer replicas (``replicas``, ``overhead_s``).
    """
    n, m = inputs["replicas"], inputs["microbatches"]
    step = inputs["step_time_s"]
    overhead = min(max(0.0, step - math.ceil(m / n) * inputs["device_time_s"]), 0.5 * step)
    costs = {k: inputs.get(k) for k in COSTS}
    every = inputs.get("checkpoint_every")
    overheads: tuple[tuple[int, float], ...] = ()
    if calibration:
        overheads = (*((int(p["replicas"]), float(p["overhead_s"])) for p in calibration), (n, overhead))
    by_count: dict[int, list[float]] = {}
    for k, cost in inputs.get("relaunches") or ():
        by_count.setdefault(int(k), []).append(float(cost))
    restarts = tuple((k, statistics.median(v)) for k, v in sorted(by_count.items()))
    return JobSpec(
        gpus=n, tp=1, microbatches=m, tokens_per_microbatch=inputs["tokens_per_microbatch"], step_time_s=step,
        step_overhead_s=overhead, step_overhead_by_live=overheads, restart_by_replicas=restarts,
        duration_s=duration_s,
        budget_gpu_h=budget_gpu_s / HOUR if budget_gpu_s else None, failures="trace",
        trace=tuple((float(t), int(r)) for t, r in kills), rejoin=False, restart_mode="survivors",
        recovery_latency_s=costs["recovery_latency_s"] or 0.0, reconfig_s=costs["reconfig_s"] or 0.0,
        restart_s=costs["restart_s"] or 0.0, load_s=0.0, save_s=costs["save_s"] or 0.0,
        checkpoint_interval_s=every * step if every else None,
    )


def costs_elsewhere(inputs: dict[str, Any], others: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``inputs`` with its costs replaced by the other seeds' (medians; their relaunches pooled), where any
    other seed measured them; ``costs_from`` says which."""
    out = dict(inputs)
    taken = []
    for key in COSTS:
        vals = [o[key] for o in others if isinstance(o.get(key), (int, float))]
        if vals:
            out[key] = statistics.median(vals)
            taken.append(key)
    pooled = [r for o in others for r in (o.get("relaunches") or ())]
    if pooled:
        out["relaunches"] = pooled
        taken.append("relaunches")
    out["costs_from"] = "other seeds" if taken else "own run"
    return out


def _check(measured: float | None, simulated: float | None) -> dict[str, Any]:
    if not measured or simulated is None:
        return {"measured": measured, "simulated": simulated, "error": None, "within": None}
    err = simulated / measured - 1
    return {"measured": measured, "simulated": simulated, "error": round(err, 4), "within": abs(err) <= TOLERANCE}


def validate(seed: int, system: str, inputs: dict[str, Any], run: dict[str, Any],
             budget_gpu_s: float | None, measured_at_budget: float | None,
             calibration: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The ``simulator`` rows of one measured run: effective throughput, then tokens at the budget."""
    strategy = SIM_NAMES[system]
    kills = run["kills"]
    spec = job_spec(system, inputs, kills, 3 * run["train_s"], calibration=calibration).replace(
        target_tokens=float(run["tokens"]))
    sim = simulate(spec, [strategy]).strategies[strategy]
    reached = sim.time_to_target_s  # when the simulated run holds the measured run's tokens
    base = {"system": system, "seed": seed, "replicas": inputs["replicas"], "calibrated": bool(calibration),
            "costs_from": inputs.get("costs_from", "own run")}
    rows = [{**base, "measure": "effective_tokens_per_s",
             **_check(run["tokens"] / run["train_s"],
                      run["tokens"] / reached if reached else sim.effective_throughput)}]
    if budget_gpu_s:
        spec_b = job_spec(system, inputs, kills, 4 * run["train_s"], budget_gpu_s, calibration)
        sim_b = simulate(spec_b, [strategy]).strategies[strategy]
        rows.append({**base, "measure": "tokens_at_budget",
                     **_check(measured_at_budget, float(sim_b.tokens_at_budget))})
    return rows


def projections(inputs: dict[str, Any], names: Sequence[str] = PROJECTIONS) -> list[dict[str, Any]]:
    """Each preset in ``names`` with its assumed costs, then with the measured costs scaled to its step time."""
    rows = []
    for name in names:
        base = preset(name)
        scaled: dict[str, Any] = {field: inputs[key] / inputs["step_time_s"] * base.step_time_s
                                  for key, field in SCALED_COSTS.items() if inputs.get(key) is not None}
        if "restart_s" in scaled:
            scaled["load_s"] = 0.0  # the measured relaunch includes the checkpoint load
        for costs, spec in (("assumed", base), ("measured, scaled to the step time", base.replace(**scaled))):
            res = simulate(spec)
            ratios = res.ratios().get("recover/checkpoint-restart", {})
            for strategy, r in res.strategies.items():
                rows.append({"system": _bench_name(strategy), "scenario": name, "costs": costs, "gpus": spec.gpus,
                             "effective_tokens_per_s": r.effective_throughput,
                             "throughput_after_failures": r.throughput_after_failures,
                             "tokens_at_budget": r.tokens_at_budget, "failures": int(len(res.failure_times)),
                             "recover_vs_restart_throughput": ratios.get("throughput_after_failures"),
                             "recover_vs_restart_tokens": ratios.get("tokens_at_budget"),
                             "inputs": {f: getattr(spec, f) for f in (*SCALED_COSTS.values(), "load_s")}})
    return rows


def _bench_name(strategy: str) -> str:
    return next((k for k, v in SIM_NAMES.items() if v == strategy), strategy)
