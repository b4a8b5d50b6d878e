"""``recover bench stragglers``: one replica made 1.5x, 2x, 4x slower; recover's ``weighted`` workload
policy against the ``even`` split, wait-for-slowest (torchft / DDP) and the makespan-optimal plan.

Contract:
- Emulated devices (``device_time_s``, ``--device-time-s``, default :data:`DEVICE_TIME_S`): every run
  gets ``training.device_time_s`` = T, so every microbatch takes at least T of wall time (real
  compute, then a sleep); the slow replica's microbatches take FACTOR x that (``recover launch
  --slow R@STEP:FACTOR``: replica ``R`` = the last one, from step ``slow_step``, default
  :data:`SLOW_STEP`). T must hide the real compute, or the replicas' shared CPU cores decide the
  step time: the real compute of one microbatch is measured once (:func:`measure_compute_s`) and a
  warning is logged and printed unless ``T >= DOMINANCE x`` that time scaled by the replicas
  sharing the cores. ``training.device_time_s``, ``training.global_microbatches`` and
  ``workload.policy`` are set by the bench's own options; as config overrides they are refused.
- Systems, per factor: ``weighted`` (recover's default policy: the coordinator agrees per-replica
  seconds per microbatch at each commit and the plan gives a straggler fewer microbatches),
  ``even`` (recover with ``workload.policy = even``: quotas differ by at most one) and
  ``wait-for-slowest`` (what torchft and DDP do: every replica a fixed equal share, every step
  waits for the slowest; run as recover's ``--baseline shrink``, torchft's semantics in recover's
  code, so it is a separately measured system with the same plan as ``even``). Real torchft is not
  run: it needs an interpreter with torchft, and the torchft runner has no slow-down injection;
  the reason is reported under ``skipped``. Plus, once per round, a failure-free ``reference``
  (recover, no slow-down).
- Rounds (``rounds``, default :data:`ROUNDS`, at least 1): every configuration (each factor x
  system, factor by factor, with the reference in the middle: :func:`run_configs`) runs once per
  round, each as its own ``recover launch`` job into ``OUT/round<r>/<name>/``; round ``r`` runs the
  configurations forward for even ``r`` and reversed for odd ``r`` (:func:`round_orders`), so a
  drift of the machine's load is spread evenly.
- Steady state (:func:`settled_times`): a run's step time is the median of ``time_s`` (the step's
  wall time, ``metrics.jsonl``) over the steps ``>= slow_step + settle_steps`` (the first
  ``settle_steps``, default :data:`SETTLE_STEPS`, after the slow-down are skipped: the weighted
  policy needs 3 samples of the slow replica before it moves anything, then one or two
  rebalances). The reference is measured over the same steps. The steps' mean is kept too
  (it shows the weighted policy's periodic one-microbatch probe of a replica left without work).
- Per configuration (:func:`aggregate`): ``step_s`` = the median over rounds of the per-run
  medians, with ``min_s``, ``max_s`` and ``rel_spread`` = (max - min) / median over rounds.
- The makespan-optimal plan (:func:`optimal_model`), computed, not run: with per-microbatch times
  ``{fast: T, slow: FACTOR x T}`` its quotas are ``assign(range(M), live, times)`` (the greedy
  earliest-finish allocation, makespan-optimal for equal microbatches) and its compute time
  ``makespan(...)``; its step time is modelled as the failure-free step time (the reference's
  ``step_s``) plus the difference in compute makespan, ``optimal_s = ref_s + makespan_opt -
  ceil(M / N) x T``: the all-reduce, optimizer, vote and other per-step costs are taken as those
  of the failure-free step. The same model gives the even split's predicted step time
  (``even_model_s``), a check of the model against the measured ``even``. On shared CPU cores that
  per-step cost is partly contention (in the reference all replicas finish their microbatches and
  reduce at the same moment; behind a straggler the fast ones did that work while waiting), so a
  measured plan can come out a few percent below its model (``vs_optimal`` < 1): the model is
  left as it is.
- Ratios (:func:`assemble`), all of medians: ``vs_optimal`` = step_s / optimal_s and ``vs_even`` =
  step_s / even's step_s; each per-round row also gets its paired ratios (against that round's
  reference and even). Acceptance (issue #12, for factor :data:`TARGET_FACTOR` when it is run):
  weighted ``vs_optimal <= 1.15`` and ``vs_even <= 0.6``.
- Outputs: a rich table per factor (medians, spread, ratios, steady quotas, machine load before
  and after that factor's runs), ``OUT/stragglers.png`` (step time vs factor per system, min-max
  over rounds, with the optimal model and the reference), ``OUT/results.json`` and ``--json FILE``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recover.bench.common import (
    Log,
    contended_compute_s,
    fmt,
    launch_run,
    machine_load,
    measure_compute_s,
    print_rich_table,
    round_orders,
    spread,
    stderr_log,
    write_json,
)
from recover.errors import ConfigError
from recover.names import Baseline, Event
from recover.observe.plots import load_events, load_metrics

POLICIES = ("weighted", "even", "wait-for-slowest", "torchft")
DEFAULT_POLICIES = POLICIES[:3]
"""torchft runs only when asked for (``--policies ...,torchft``) and an interpreter imports it."""
LABELS = {
    "reference": "failure-free reference (recover, weighted, no slow replica)",
    "weighted": "recover, workload.policy = weighted (default)",
    "even": "recover, workload.policy = even",
    "wait-for-slowest": "fixed equal shares, every step waits for the slowest (torchft / DDP semantics; "
                        "recover's --baseline shrink)",
    "torchft": "real torchft 0.2.0 DDP + Lighthouse (recover.bench.torchft_runner; fixed equal shares, the "
               "slow replica's device slowed alike)",
    "optimal": "makespan-optimal plan (model, not run)",
}
FACTORS = (1.5, 2.0, 4.0)
CONFIG = "debug"
REPLICAS = 4
STEPS = 30
MICROBATCHES = 16
"""Default M. With 4 replicas, M = 8 (the presets' value) leaves 2 microbatches per replica: at 1.5x
the optimum is the even split itself (3 T either way) and at 4x it is [3, 3, 2, 0] = 1.5x the
failure-free compute. M = 16 (4 per replica) lets a 1.5x straggler shed one microbatch ([5, 4, 4, 3],
5 T instead of 6 T) and brings the 4x optimum to [5, 5, 5, 1], 1.25x failure-free. Real jobs
accumulate many microbatches per replica, so the finer split is the representative one; M = 8
is one option away (``--microbatches 8``)."""
DEVICE_TIME_S = 0.05
"""Default emulated device time per microbatch, for the ``debug`` preset (~0.1M parameters): its
real compute is a few ms per microbatch on one thread (measured and reported by every run of the
bench), so even with 4 replicas sharing 2 cores T = 50 ms dominates it, and a step stays short
(16 microbatches over 4 replicas: ~0.23 s failure-free)."""
SLOW_STEP = 2
SETTLE_STEPS = 6
ROUNDS = 3
MIN_SETTLED = 5
"""The fewest steady-state steps a run must have (``steps - slow_step - settle_steps``)."""
DOMINANCE = 1.5
"""The emulated time dominates real compute when T >= this x the contended compute per microbatch."""
TARGET_FACTOR = 4.0
TARGET_VS_OPTIMAL = 1.15
TARGET_VS_EVEN = 0.6
PLOT_LABELS = {"weighted": "weighted (recover's default)", "even": "even (recover)",
               "wait-for-slowest": "wait-for-slowest (torchft/DDP semantics; --baseline shrink)",
               "torchft": "torchft 0.2.0 (real)",
               "optimal": "makespan-optimal plan (model)"}
OWN_OVERRIDES = {"training.device_time_s": "--device-time-s", "training.global_microbatches": "--microbatches",
                 "workload.policy": "--policies"}


# ---------------------------------------------------------------- pure parts

def parse_factors(text: str) -> list[float]:
    """``1.5,2,4`` -> ``[1.5, 2.0, 4.0]`` (duplicates dropped, order kept).

    Raises:
        ConfigError: an empty list, or a factor that is not a finite number > 1.
    """
    out: list[float] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"--factors {text!r}: {part!r} is not a number; write e.g. 1.5,2,4") from None
        if not (math.isfinite(value) and value > 1):
            raise ConfigError(f"--factors {text!r}: {part} must be a slow-down factor > 1 (1 is no straggler)")
        if value not in out:
            out.append(value)
    if not out:
        raise ConfigError(f"--factors {text!r}: give at least one factor > 1, e.g. 1.5,2,4")
    return out


def parse_policies(text: str) -> list[str]:
    """``weighted,even`` -> ``["weighted", "even"]`` (duplicates dropped, order kept).

    Raises:
        ConfigError: an empty list or an unknown name.
    """
    names = list(dict.fromkeys(p.strip() for p in str(text).split(",") if p.strip()))
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ConfigError(f"--policies {text!r}: {'unknown ' + ','.join(unknown) if unknown else 'empty'}; "
                          f"choose from {','.join(POLICIES)}")
    return names


def check_sizes(replicas: int, steps: int, microbatches: int, rounds: int, device_time_s: float,
                slow_step: int, settle_steps: int) -> None:
    """Refuses sizes the bench cannot measure, in one line naming the fix.

    Raises:
        ConfigError: fewer than 2 replicas, M < replicas, no round, T not finite and > 0, a negative
            slow step or settle count, or fewer than :data:`MIN_SETTLED` steady-state steps.
    """
    if replicas < 2:
        raise ConfigError(f"--replicas {replicas}: at least 2 (one of them is the straggler)")
    if microbatches < replicas:
        raise ConfigError(f"--microbatches {microbatches}: at least --replicas = {replicas}, so every replica "
                          "has work in the failure-free step")
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: at least 1 (every configuration runs once per round)")
    if not (math.isfinite(device_time_s) and device_time_s > 0):
        raise ConfigError(f"--device-time-s {device_time_s}: seconds per microbatch, > 0 (the optimal plan's "
                          "model needs the emulated device time)")
    if slow_step < 0 or settle_steps < 0:
        raise ConfigError(f"--slow-step {slow_step} / --settle-steps {settle_steps}: integers >= 0")
    first = slow_step + settle_steps
    if steps - first < MIN_SETTLED:
        raise ConfigError(f"--steps {steps}: too short to measure {MIN_SETTLED} steady-state steps after "
                          f"step {first} (slow-down at {slow_step} + {settle_steps} settling); "
                          f"use at least {first + MIN_SETTLED}")


def run_configs(factors: Sequence[float], policies: Sequence[str]) -> list[tuple[str, float | None]]:
    """The forward order of one round: every factor x policy, factor by factor, with the reference
    (``("weighted", None)``) in the middle, so that its runs, on which every ratio to the optimum
    depends, are spread over the bench instead of back to back at the round boundaries."""
    out: list[tuple[str, float | None]] = [(p, f) for f in factors for p in policies]
    out.insert(len(out) // 2, ("weighted", None))
    return out


def config_name(policy: str, factor: float | None) -> str:
    """The run directory name of one configuration: ``reference`` or e.g. ``weighted-x1.5``."""
    return "reference" if factor is None else f"{policy}-x{factor:g}"


def settled_times(rows: Sequence[dict[str, Any]], first_step: int) -> list[float]:
    """``time_s`` of the committed steps ``>= first_step``, in step order (one per step)."""
    by_step = {int(r["step"]): float(r["time_s"]) for r in rows if r.get("time_s") is not None}
    return [by_step[s] for s in sorted(by_step) if s >= first_step]


def even_quotas(microbatches: int, replicas: int) -> dict[int, int]:
    from recover.workload.policy import assign, quotas

    return quotas(assign(range(microbatches), range(replicas)))


def optimal_model(ref_step_s: float | None, microbatches: int, replicas: int, factor: float,
                  device_time_s: float, slow_replica: int | None = None) -> dict[str, Any]:
    """The makespan-optimal plan with one replica ``factor`` x slower, and its modelled step time.

    With per-microbatch times ``{fast: T, slow: factor x T}``: ``quotas`` = ``assign(range(M), live,
    times)``, ``compute_s`` = its makespan, ``failure_free_compute_s`` = ``ceil(M / N) x T``,
    ``even_compute_s`` = the even split's makespan under the same times, ``fluid_compute_s`` = ``M /
    sum(1 / time)`` (microbatches split into fractions: a lower bound no integer plan reaches), and
    ``step_s`` = ``ref_step_s + compute_s - failure_free_compute_s`` (``even_model_s`` likewise for
    the even split); both None without ``ref_step_s``.
    """
    from recover.workload.policy import assign, makespan, quotas

    slow = replicas - 1 if slow_replica is None else slow_replica
    times = {r: device_time_s * (factor if r == slow else 1.0) for r in range(replicas)}
    plan = assign(range(microbatches), range(replicas), times)
    compute = makespan(plan, times)
    even = makespan(assign(range(microbatches), range(replicas)), times)
    free = math.ceil(microbatches / replicas) * device_time_s
    return {
        "factor": factor, "slow_replica": slow, "quotas": quotas(plan), "compute_s": round(compute, 6),
        "failure_free_compute_s": round(free, 6), "even_compute_s": round(even, 6),
        "fluid_compute_s": round(microbatches / sum(1.0 / t for t in times.values()), 6),
        "step_s": None if ref_step_s is None else round(ref_step_s + compute - free, 6),
        "even_model_s": None if ref_step_s is None else round(ref_step_s + even - free, 6),
    }


def steady_quotas(rows: Sequence[dict[str, Any]], first_step: int, microbatches: int,
                  replicas: int) -> dict[int, int]:
    """The most common per-replica quotas over the steps ``>= first_step`` (a step without ``quotas``
    had the even split; ties: the earliest such step's)."""
    even = even_quotas(microbatches, replicas)
    seen = [tuple(sorted((int(k), int(v)) for k, v in (r.get("quotas") or even).items()))
            for r in sorted(rows, key=lambda r: r["step"]) if r["step"] >= first_step]
    if not seen:
        return {}
    counts = Counter(seen)
    best = max(counts.values())
    return dict(next(q for q in seen if counts[q] == best))


def run_stats(run_dir: Path, first_step: int, steps: int, microbatches: int, replicas: int,
              exit_code: int = 0) -> dict[str, Any]:
    """One run's steady-state numbers from its run directory (``step_s`` None when it has none)."""
    rows = load_metrics(run_dir)
    xs = settled_times(rows, first_step)
    s = spread(xs)
    events = load_events(run_dir)
    return {
        "run_dir": str(run_dir), "exit_code": exit_code,
        "completed": exit_code == 0 and len(rows) == steps and bool(rows) and rows[-1]["step"] + 1 == steps,
        "committed_steps": len(rows), "settled_steps": len(xs),
        "step_s": round(s["median"], 6) if s["median"] is not None else None,
        "mean_s": round(statistics.fmean(xs), 6) if xs else None,
        "min_s": s["min"], "max_s": s["max"],
        "quotas": {str(k): v for k, v in steady_quotas(rows, first_step, microbatches, replicas).items()},
        "rebalanced_steps": [e.get("step") for e in events if e.get("kind") == Event.REBALANCED],
    }


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its rounds: the median of the per-run ``step_s``, their min, max and
    relative spread, ``completed`` only if every run completed; the per-run rows in ``rounds``."""
    xs = [r["step_s"] for r in runs if r.get("step_s") is not None]
    s = spread(xs)
    mid = sorted((r for r in runs if r.get("step_s") is not None), key=lambda r: (r["step_s"], r["round"]))
    median_run = mid[(len(mid) - 1) // 2] if mid else None
    return {
        "step_s": round(s["median"], 6) if s["median"] is not None else None,
        "min_s": s["min"], "max_s": s["max"],
        "rel_spread": round(s["rel_spread"], 4) if s["rel_spread"] is not None else None,
        "mean_s": round(statistics.median(r["mean_s"] for r in mid), 6) if mid else None,
        "completed": bool(runs) and all(r.get("completed") for r in runs),
        "quotas": median_run["quotas"] if median_run else {},
        "median_round": median_run["round"] if median_run else None,
        "rounds": list(runs),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def assemble(reference: dict[str, Any], systems: dict[float, dict[str, dict[str, Any]]], microbatches: int,
             replicas: int, device_time_s: float) -> list[dict[str, Any]]:
    """One entry per factor: the optimal model (from the reference's median step time) and every
    system's aggregated row with ``vs_optimal`` and ``vs_even``; each per-round row gets the paired
    ratios (that round's reference and even)."""
    ref_by_round = {r["round"]: r.get("step_s") for r in reference["rounds"]}
    out = []
    for factor, rows in systems.items():
        opt = optimal_model(reference.get("step_s"), microbatches, replicas, factor, device_time_s)
        even = rows.get("even", {})
        even_by_round = {r["round"]: r.get("step_s") for r in even.get("rounds", [])}
        for row in rows.values():
            row["vs_optimal"] = ratio(row["step_s"], opt["step_s"])
            row["vs_even"] = ratio(row["step_s"], even.get("step_s"))
            for x in row["rounds"]:
                ref_x = ref_by_round.get(x["round"])
                opt_x = optimal_model(ref_x, microbatches, replicas, factor, device_time_s)["step_s"] if ref_x else None
                x["vs_optimal"] = ratio(x.get("step_s"), opt_x)
                x["vs_even"] = ratio(x.get("step_s"), even_by_round.get(x["round"]))
        out.append({"factor": factor, "optimal": opt, "systems": rows})
    return out


def acceptance(by_factor: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Issue #12's target at :data:`TARGET_FACTOR`: weighted <= 1.15 x optimal and <= 0.6 x even
    (None when that factor or weighted was not run)."""
    entry = next((e for e in by_factor if e["factor"] == TARGET_FACTOR), None)
    if entry is None or "weighted" not in entry["systems"]:
        return None
    w = entry["systems"]["weighted"]
    ok_opt = w["vs_optimal"] is not None and w["vs_optimal"] <= TARGET_VS_OPTIMAL
    ok_even = None if w["vs_even"] is None else w["vs_even"] <= TARGET_VS_EVEN
    return {"factor": TARGET_FACTOR, "vs_optimal": w["vs_optimal"], "vs_optimal_max": TARGET_VS_OPTIMAL,
            "vs_even": w["vs_even"], "vs_even_max": TARGET_VS_EVEN, "meets_vs_optimal": ok_opt,
            "meets_vs_even": ok_even, "met": bool(ok_opt and ok_even)}


def factor_load(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Machine load around one factor's runs: at the start of the first run (by ``seq``), at the end of the
    last, and the range of the 1-minute load at their starts."""
    if not rows:
        return {"before": [], "after": [], "min_1m": None, "max_1m": None}
    ordered = sorted(rows, key=lambda x: x["seq"])
    ones = [x["load_start"][0] for x in ordered if x["load_start"]]
    return {"before": ordered[0]["load_start"], "after": ordered[-1]["load_end"],
            "min_1m": min(ones, default=None), "max_1m": max(ones, default=None)}


def device_note(device: dict[str, Any]) -> str:
    """One line on the emulated devices and the measured real compute per microbatch."""
    if device.get("compute_s") is None:
        return (f"emulated devices: every microbatch takes >= {device['time_s'] * 1000:.0f} ms "
                "(real compute not measured)")
    line = (f"emulated devices: every microbatch takes >= {device['time_s'] * 1000:.0f} ms (training.device_time_s, "
            f"the slow replica FACTOR x that); real compute {device['compute_s'] * 1000:.1f} ms per microbatch "
            f"(fastest of 10; median {device['compute_median_s'] * 1000:.1f} ms under this machine's load) on "
            f"{device['threads']} thread(s), ~{device['contended_s'] * 1000:.1f} ms with {device['replicas']} "
            f"replicas sharing {device['cores']} cores")
    if not device["dominates"]:
        line += f"; WARNING: T is below {DOMINANCE:g} x the contended compute, raise --device-time-s"
    if device.get("reference_overhead_s") is not None:
        line += (f"; the reference step exceeds ceil(M/N) x T by {device['reference_overhead_s'] * 1000:.0f} ms "
                 "(all-reduce, optimizer, vote)")
    return line


# ---------------------------------------------------------------- output

COLUMNS = ("system", "median s", "min s", "max s", "spread", "x optimal", "x opt. by round", "x even", "quotas",
           "mean s")


def _quotas_text(q: dict[Any, int]) -> str:
    return "[" + ",".join(str(q[k]) for k in sorted(q, key=int)) + "]" if q else "-"


def table_rows(entry: dict[str, Any], reference: dict[str, Any], microbatches: int, replicas: int,
               several: bool) -> list[list[str]]:
    """The cells of :data:`COLUMNS` for one factor: the reference, each system, the optimal model."""
    even = even_quotas(microbatches, replicas)

    def row(name: str, r: dict[str, Any], vs_opt: Any, vs_even: Any) -> list[str]:
        by_round = "/".join(fmt(x.get("vs_optimal"), ".2f") for x in sorted(r["rounds"], key=lambda x: x["round"]))
        return [name + ("" if r["completed"] else " (INCOMPLETE)"), fmt(r["step_s"], ".3f"),
                fmt(r["min_s"], ".3f"), fmt(r["max_s"], ".3f"),
                f"{r['rel_spread'] * 100:.1f}%" if several and r["rel_spread"] is not None else "-",
                fmt(vs_opt, ".3f"), by_round if vs_opt is not None else "-", fmt(vs_even, ".3f"),
                _quotas_text(r["quotas"] or even), fmt(r["mean_s"], ".3f")]

    opt = entry["optimal"]
    out = [row("reference", reference, None, None)]
    out += [row(name, r, r["vs_optimal"], r["vs_even"]) for name, r in entry["systems"].items()]
    even_s = entry["systems"].get("even", {}).get("step_s")
    out.append(["optimal (model)", fmt(opt["step_s"], ".3f"), "-", "-", "-", "1.000", "-",
                fmt(ratio(opt["step_s"], even_s), ".3f"), _quotas_text(opt["quotas"]), "-"])
    return out


def print_result(res: dict[str, Any]) -> None:
    """One rich table per factor; the notes common to all of them under the last one."""
    several = res["rounds"] > 1
    T, M, N = res["device"]["time_s"], res["microbatches"], res["replicas"]
    common = [f"{name}: {LABELS[name]}" for name in ("reference", *res["policies"], "optimal")]
    common.append(device_note(res["device"]))
    common.append("rounds run in alternating order (forward, then reversed); spread = (max - min) / median over "
                  "rounds; x optimal, x even: ratios of medians; x opt. by round: each round's run against the "
                  "optimum modelled from that round's reference; quotas: the median round's most common "
                  "quotas over the measured steps (the slow replica is the last); mean s: median over "
                  "rounds of the measured steps' mean (it includes the weighted policy's probes)")
    acc = res.get("acceptance")
    if acc:
        even_verdict = {True: "met", False: "MISSED", None: "even not run"}[acc["meets_vs_even"]]
        common.append(f"issue #12 target at {acc['factor']:g}x: weighted <= {acc['vs_optimal_max']} x optimal "
                      f"({fmt(acc['vs_optimal'], '.3f')}: {'met' if acc['meets_vs_optimal'] else 'MISSED'}) and "
                      f"<= {acc['vs_even_max']} x even ({fmt(acc['vs_even'], '.3f')}: {even_verdict})")
    for name, why in res.get("skipped", {}).items():
        common.append(f"{name}: not run ({why})")
    common.append(f"load average before/after the bench: {res['load']['before']} / {res['load']['after']}; "
                  f"benchmark wall {res['bench_wall_s']:.0f} s; outputs in {res['out']}")
    for i, entry in enumerate(res["by_factor"]):
        f, opt, load = entry["factor"], entry["optimal"], entry["load"]
        notes = [
            f"optimal (model) = reference step {fmt(res['reference']['step_s'], '.3f')} s + makespan "
            f"{opt['compute_s']:.3f} s of quotas {_quotas_text(opt['quotas'])} - failure-free makespan "
            f"ceil(M/N) x T = {opt['failure_free_compute_s']:.3f} s; the same model predicts even at "
            f"{fmt(opt['even_model_s'], '.3f')} s (fluid bound on compute: {opt['fluid_compute_s']:.3f} s)",
        ]
        w = entry["systems"].get("weighted")
        if w:
            notes.append(f"weighted / even = {fmt(w['vs_even'], '.3f')}; weighted / optimal = "
                         f"{fmt(w['vs_optimal'], '.3f')}")
        notes.append(f"machine load (1/5/15 min) before this factor's first run {load['before']}, after its last "
                     f"run {load['after']}; 1-min load at the start of its runs {load['min_1m']}..{load['max_1m']}")
        if i == len(res["by_factor"]) - 1:
            notes += common
        title = (f"bench stragglers: replica {N - 1} {f:g}x slower from step {res['slow_step']} - {res['config']} "
                 f"x{N}, M = {M}, T = {T:g} s; median over {res['rounds']} round(s) of each run's median step "
                 f"time over steps >= {res['first_measured_step']}")
        print_rich_table(title, COLUMNS, table_rows(entry, res["reference"], M, N, several), notes)


def plot_results(path: Path, res: dict[str, Any]) -> Path:
    """``stragglers.png``: median step time vs factor per system (min-max over rounds as error bars),
    the optimal model's line and the failure-free reference."""
    from recover.observe.plots import _pyplot

    plt = _pyplot()
    colors = {"weighted": "C0", "even": "C1", "wait-for-slowest": "C3", "torchft": "C2"}
    factors = [e["factor"] for e in res["by_factor"]]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name in res["policies"]:
        pts = [(e["factor"], e["systems"][name]) for e in res["by_factor"] if e["systems"][name]["step_s"] is not None]
        if not pts:
            continue
        xs = [f for f, _ in pts]
        ys = [r["step_s"] for _, r in pts]
        err = [[y - (r["min_s"] or y) for (_, r), y in zip(pts, ys, strict=True)],
               [(r["max_s"] or y) - y for (_, r), y in zip(pts, ys, strict=True)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors.get(name), label=PLOT_LABELS[name])
    opt = [(e["factor"], e["optimal"]["step_s"]) for e in res["by_factor"] if e["optimal"]["step_s"] is not None]
    if opt:
        ax.plot([f for f, _ in opt], [y for _, y in opt], "k--", marker="x", label=PLOT_LABELS["optimal"])
    if res["reference"]["step_s"] is not None:
        ax.axhline(res["reference"]["step_s"], color="0.5", ls=":", label="failure-free reference")
    ax.set_xticks(factors)
    ax.set_xticklabels([f"{f:g}x" for f in factors])
    ax.set_xlabel(f"slow-down of replica {res['replicas'] - 1} (of {res['replicas']})")
    ax.set_ylabel("steady-state step time (s): median, min-max over rounds")
    ax.set_title(f"{res['config']} x{res['replicas']}, M = {res['microbatches']}, "
                 f"T = {res['device']['time_s']:g} s per microbatch")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- measurement


def torchft_skip_reason() -> str:
    """Why real torchft is not among the systems."""
    try:
        from recover.bench.torchft_runner import torchft_available

        ok, why = torchft_available(sys.executable)
    except Exception as exc:  # never fail the bench on the probe
        ok, why = False, str(exc)
    if not ok:
        return (f"torchft does not import ({why}); its wait-for-slowest semantics are measured as "
                "recover's --baseline shrink")
    return ("torchft imports, but the torchft runner has no slow-down injection (--slow); its wait-for-slowest "
            "semantics are measured as recover's --baseline shrink")


def system_args(policy: str, factor: float | None, slow_step: int, replicas: int) -> tuple[str | None, list[str]]:
    """(``--baseline``, extra ``recover launch`` arguments) of one configuration (``factor`` None: the reference)."""
    slow = [] if factor is None else ["--slow", f"{replicas - 1}@{slow_step}:{factor:g}"]
    if policy == "wait-for-slowest":
        return Baseline.SHRINK.value, slow
    return None, [*slow, f"--workload.policy={policy}"]


def run_bench(config: str = CONFIG, replicas: int = REPLICAS, steps: int = STEPS, factors: Sequence[float] = FACTORS,
              policies: Sequence[str] = DEFAULT_POLICIES, rounds: int = ROUNDS, device_time_s: float = DEVICE_TIME_S,
              microbatches: int = MICROBATCHES, slow_step: int = SLOW_STEP, settle_steps: int = SETTLE_STEPS,
              overrides: Sequence[str] = (), out: Path = Path("runs/bench-stragglers"), timeout_s: float = 600.0,
              torchft_python: str | None = None, log: Log = stderr_log) -> dict[str, Any]:
    """Runs the reference and every factor x policy for ``rounds`` rounds; returns the result object
    (see the module docstring) and writes ``OUT/results.json`` and ``OUT/stragglers.png``.

    Raises:
        ConfigError: a bad argument (named with the fix), before anything runs.
    """
    from recover.config import load_config, parse_overrides

    factors = parse_factors(",".join(str(f) for f in factors))
    policies = parse_policies(",".join(policies))
    check_sizes(replicas, steps, microbatches, rounds, device_time_s, slow_step, settle_steps)
    clash = [f"--{k} (use {v})" for k, v in OWN_OVERRIDES.items() if k in parse_overrides(list(overrides))]
    if clash:
        raise ConfigError(f"config override {', '.join(clash)}: set by the bench's own option")
    run_overrides = [*overrides, f"--training.device_time_s={device_time_s}",
                     f"--training.global_microbatches={microbatches}"]
    load_config(config, [*run_overrides, f"--parallel.replicas={replicas}", f"--training.steps={steps}"])

    t_bench = time.time()
    load_before = machine_load()
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    tft_python = None
    if "torchft" in policies:
        from recover.bench.failures import find_torchft_python

        tft_python, why = find_torchft_python(torchft_python)
        if tft_python is None:
            raise ConfigError(f"--policies torchft: {why}; install torchft or give --torchft-python")
    elif "wait-for-slowest" in policies:
        skipped["torchft"] = torchft_skip_reason()
        log(f"torchft: skipped ({skipped['torchft']})")
    try:
        compute_s, compute_median_s, threads = measure_compute_s(config, overrides, replicas)
    except Exception as exc:  # the check is advisory
        log(f"warning: real compute not measured: {exc}")
        compute_s = compute_median_s = threads = None
    cores = os.cpu_count() or 1
    device: dict[str, Any] = {"time_s": device_time_s, "compute_s": None, "compute_median_s": None,
                              "threads": threads, "cores": cores, "replicas": replicas, "contended_s": None,
                              "dominates": None, "reference_overhead_s": None}
    if compute_s is not None and compute_median_s is not None and threads is not None:
        contended = contended_compute_s(compute_s, replicas, threads, cores)
        device.update(compute_s=round(compute_s, 5), compute_median_s=round(compute_median_s, 5),
                      contended_s=round(contended, 5), dominates=device_time_s >= DOMINANCE * contended)
    log(device_note(device))

    configs = {config_name(p, f): (p, f) for p, f in run_configs(factors, policies)}
    first_step = slow_step + settle_steps
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    seq = 0
    for r, order in enumerate(round_orders(list(configs), rounds)):
        for name in order:
            policy, factor = configs[name]
            run_dir = out / f"round{r}" / name
            shutil.rmtree(run_dir, ignore_errors=True)
            load = machine_load()
            log(f"[{time.strftime('%H:%M:%S')}] round {r}: {name} running (load {load})")
            t0 = time.time()
            baseline, extra = system_args(policy, factor, slow_step, replicas)
            if policy == "torchft":
                from recover.bench.torchft_runner import run_torchft

                slow = [] if factor is None else [f"{replicas - 1}@{slow_step}:forward=slow:{factor:g}"]
                code = run_torchft(run_dir, config, replicas, steps, slow, run_overrides, tft_python, timeout_s)
            else:
                code = launch_run(run_dir, config, replicas, steps, (), baseline, [*run_overrides, *extra], timeout_s)
            row = run_stats(run_dir, first_step, steps, microbatches, replicas, code)
            row.update(round=r, seq=seq, load_start=load, load_end=machine_load(), wall_s=round(time.time() - t0, 1))
            seq += 1
            runs[name].append(row)
            log(f"[{time.strftime('%H:%M:%S')}] round {r}: {name} exit {code} after {row['wall_s']:.0f} s, "
                f"median step {fmt(row['step_s'], '.3f')} s, quotas {_quotas_text(row['quotas'])}")

    reference = aggregate(runs["reference"])
    if reference["step_s"] is not None:
        device["reference_overhead_s"] = round(reference["step_s"] - math.ceil(microbatches / replicas)
                                               * device_time_s, 5)
    systems = {f: {p: aggregate(runs[config_name(p, f)]) for p in policies} for f in factors}
    by_factor = assemble(reference, systems, microbatches, replicas, device_time_s)
    for entry in by_factor:
        rows = [x for p in policies for x in runs[config_name(p, entry["factor"])]]
        entry["load"] = factor_load(rows)
    res: dict[str, Any] = {
        "benchmark": "stragglers", "config": config, "replicas": replicas, "steps": steps,
        "microbatches": microbatches, "factors": factors, "policies": policies, "rounds": rounds,
        "slow_replica": replicas - 1, "slow_step": slow_step, "settle_steps": settle_steps,
        "first_measured_step": first_step, "overrides": list(overrides), "device": device,
        "model": "optimal step_s = reference step_s + makespan(assign(range(M), live, {fast: T, slow: FACTOR x T}))"
                 " - ceil(M / N) x T",
        "labels": LABELS, "reference": reference, "by_factor": by_factor, "acceptance": acceptance(by_factor),
        "skipped": skipped, "load": {"before": load_before, "after": machine_load()},
        "bench_wall_s": round(time.time() - t_bench, 1), "out": str(out),
    }
    try:
        res["plot"] = str(plot_results(out / "stragglers.png", res))
    except Exception as exc:  # a plot never fails a benchmark
        log(f"warning: plot not written: {exc}")
    write_json(out / "results.json", res)
    return res


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench stragglers`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "stragglers", help="one replica 1.5x/2x/4x slower: weighted vs even vs wait-for-slowest vs optimal",
        description="Makes the last replica FACTOR x slower from an early step on emulated devices and measures "
                    "the steady-state step time (median of time_s over the steps after the weighted policy has "
                    "settled) of recover's weighted policy, the even split and wait-for-slowest (torchft/DDP "
                    "semantics, recover's --baseline shrink), in alternating rounds, against a failure-free "
                    "reference and the makespan-optimal plan's modelled step time (reference + its compute "
                    "makespan - ceil(M/N) x T). Config overrides: --section.field VALUE (applied to every run).")
    p.add_argument("--config", default=CONFIG, help=f"preset name or .toml path (default {CONFIG})")
    p.add_argument("--replicas", type=int, default=REPLICAS, help=f"replicas (default {REPLICAS}); the last is slowed")
    p.add_argument("--steps", type=int, default=STEPS, help=f"committed steps per run (default {STEPS})")
    p.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS),
                   help="comma-separated slow-down factors > 1 (default 1.5,2,4)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"runs of every configuration, in alternating order (default {ROUNDS})")
    p.add_argument("--device-time-s", type=float, default=DEVICE_TIME_S,
                   help=f"emulated device time per microbatch, > 0 (default {DEVICE_TIME_S:g}, chosen for the debug "
                        "preset: well above its real compute with 4 replicas on 2 cores; the run measures that "
                        "compute and warns when T is too small)")
    p.add_argument("--microbatches", type=int, default=MICROBATCHES,
                   help=f"M, microbatches per step (default {MICROBATCHES}: 4 per replica, fine enough for the "
                        "weighted plan to shed work from a 1.5x straggler; 8 leaves it none)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"systems to compare, comma-separated, of {','.join(POLICIES)} (default "
                        f"{','.join(DEFAULT_POLICIES)}; torchft needs an interpreter that imports it)")
    p.add_argument("--torchft-python", default=None,
                   help="a Python interpreter with torchft installed, for --policies ...,torchft "
                        "(default: this one, if it imports torchft)")
    p.add_argument("--slow-step", type=int, default=SLOW_STEP,
                   help=f"step from which the replica is slow (default {SLOW_STEP})")
    p.add_argument("--settle-steps", type=int, default=SETTLE_STEPS,
                   help=f"steps after the slow-down not measured, while the weighted policy settles "
                        f"(default {SETTLE_STEPS})")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default 600)")
    p.add_argument("--out", default="runs/bench-stragglers", help="directory of the runs and the plot")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args, accepts_overrides=True)
    return p


def run_from_args(args: argparse.Namespace) -> int:
    res = run_bench(config=args.config, replicas=args.replicas, steps=args.steps, factors=parse_factors(args.factors),
                    policies=parse_policies(args.policies), rounds=args.rounds, device_time_s=args.device_time_s,
                    microbatches=args.microbatches, slow_step=args.slow_step, settle_steps=args.settle_steps,
                    overrides=getattr(args, "overrides", []) or [], out=Path(args.out), timeout_s=args.timeout,
                    torchft_python=args.torchft_python)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    complete = res["reference"]["completed"] and all(r["completed"] for e in res["by_factor"]
                                                     for r in e["systems"].values())
    return 0 if complete else 1
