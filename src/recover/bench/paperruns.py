"""The measured runs of ``recover bench paper``: one seed = one ``bench failures`` round, read back.

Contract: :func:`run_seed` runs, for one seed (``--training.seed``), the failure-free reference,
recover, checkpoint-and-restart (synchronous DCP saves, Young/Daly K) and shrink-and-drop on the
same ``successive`` schedule (half the replicas lost at evenly spaced steps) through
:func:`recover.bench.failures.run_bench` (one round; odd seeds run the failure systems in reverse
order), and returns a :data:`SeedResult`, a plain dict that :mod:`recover.bench.paper` consumes and
that a test can fake:

``{"seed", "load", "wall_s", "inputs": {MEASURED inputs of recover.bench.papersim}, "systems":
{name: {"completed", "final_val_loss", "losses", "train_s", "tokens", "series", "kills",
"max_rel_loss_dev", "min_microbatches"}}}``

with ``series`` ``[t, live_replicas, model_tokens]`` per committed record in time order (``t`` in
seconds since training started; a record of a step at or below one already recorded is a rollback:
the model's tokens drop back) and ``kills`` ``[t, replica]``. :func:`run_bitwise` runs the
reference and recover in deterministic mode and says whether every step's loss is bitwise equal.
:func:`run_calibration` runs failure-free references at a smaller replica count and returns what the
simulator's per-count table needs (:func:`calibration_point`: the step overhead with that many live
replicas; also the start of a fresh launch of that many, launch to first commit minus one step, for
comparison with a relaunch).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.bench.common import Log, machine_load, windows
from recover.names import Baseline, Event
from recover.observe.events import read_jsonl
from recover.observe.plots import load_events, load_metrics

SeedResult = dict[str, Any]
NAMES = {"reference": "failure-free", "recover": "recover", Baseline.RESTART.value: "checkpoint-and-restart",
         Baseline.SHRINK.value: "shrink-and-drop"}
"""``bench failures`` system -> the name a ``bench paper`` row carries."""
FAILURE_SYSTEMS = ("recover", Baseline.RESTART.value, Baseline.SHRINK.value)


@dataclass(frozen=True)
class Plan:
    """What one ``recover bench paper`` evaluates."""

    config: str
    replicas: int
    steps: int
    seeds: tuple[int, ...]
    device_time_s: float
    overrides: tuple[str, ...] = ()
    bitwise: bool = True
    timeout_s: float = 1800.0
    label: str = field(default="full", compare=False)
    scale: tuple[Plan, ...] = ()
    """further plans at other replica counts, run for the simulator's check (and throughput) only."""
    calibration_steps: int = 16
    """steps of each failure-free calibration run (:func:`run_calibration`)."""
    calibration_rounds: int = 2
    """failure-free runs per calibrated replica count (medians)."""

    def calibration_counts(self) -> list[int]:
        """Replica counts calibrated besides the full one: half, and three quarters when distinct."""
        half = max(1, self.replicas - max(1, self.replicas // 2))
        return sorted({k for k in (half, (half + self.replicas) // 2) if 1 <= k < self.replicas})


Runner = Callable[[Plan, int, Path, Log], SeedResult]


def run_seed(plan: Plan, seed: int, out: Path, log: Log) -> SeedResult:
    """Runs the four systems of one seed into ``out`` and reads them back (see the module docstring)."""
    import time

    from recover.bench.failures import run_bench

    t0, load = time.time(), machine_load()
    systems = FAILURE_SYSTEMS if seed % 2 == 0 else tuple(reversed(FAILURE_SYSTEMS))
    res = run_bench(config=plan.config, replicas=plan.replicas, steps=plan.steps, out=out, systems=systems,
                    overrides=[*plan.overrides, f"--training.seed={seed}"], timeout_s=plan.timeout_s,
                    device_time_s=plan.device_time_s, rounds=1, log=log)
    rows = {r["name"]: r for r in res["systems"]}
    runs = {NAMES[name]: read_run(row) for name, row in rows.items() if name in NAMES}
    yd = res["young_daly"]
    inputs = {
        "replicas": plan.replicas, "microbatches": res["microbatches"], "device_time_s": plan.device_time_s,
        "save_s": yd.get("save_cost_s"), "checkpoint_every": yd.get("checkpoint_every"),
        "compute_s": res["device"]["compute_s"], "device_dominates": res["device"]["dominates"],
        **run_inputs(out / "round0", res["microbatches"], plan.device_time_s),
    }
    return {"seed": seed, "load": load, "wall_s": round(time.time() - t0, 1), "inputs": inputs, "systems": runs,
            "schedule": res["schedule"]["fails"]}


def calibration_point(run_dir: str | Path, microbatches: int, device_time_s: float) -> dict[str, Any]:
    """A failure-free run's step time, step overhead (step beyond ``ceil(M/k)`` device times) and
    start (launch to the first commit, minus one step), at its ``replicas`` k."""
    import math

    from recover.sim.calibration import calibrate

    run_dir = Path(run_dir)
    cal = calibrate(run_dir)
    k = int(cal.replicas or 1)
    win = windows(run_dir)
    first = min(_commit_times(run_dir, win))
    return {"replicas": k, "step_time_s": cal.step_time_s,
            "overhead_s": max(0.0, cal.step_time_s - math.ceil(microbatches / k) * device_time_s),
            "start_s": max(0.0, first - win["launch_t"] - cal.step_time_s)}


def run_calibration(plan: Plan, out: Path, log: Log) -> dict[str, Any]:
    """Failure-free runs at each of :meth:`Plan.calibration_counts` (``calibration_rounds`` each, medians),
    on the plan's emulated devices: ``{"points": [{"replicas", "step_time_s", "overhead_s", "start_s",
    "rounds"}]}``."""
    import shutil

    from recover.bench.common import launch_run
    from recover.config import load_config

    overrides = [*plan.overrides, f"--training.seed={plan.seeds[0]}", f"--training.device_time_s={plan.device_time_s}"]
    microbatches = load_config(plan.config, overrides).training.global_microbatches
    points = []
    for k in plan.calibration_counts():
        runs = []
        for r in range(plan.calibration_rounds):
            run_dir = out / f"r{k}" / f"round{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            code = launch_run(run_dir, plan.config, k, plan.calibration_steps, overrides=overrides,
                              timeout_s=plan.timeout_s)
            try:
                runs.append(calibration_point(run_dir, microbatches, plan.device_time_s))
            except (ValueError, OSError) as exc:  # a run without a commit gives no point; said, not hidden
                log(f"calibration at {k} replicas, round {r}: exit {code}, no point ({exc})")
        if runs:
            points.append({"replicas": k, "rounds": runs,
                           **{key: statistics.median(x[key] for x in runs)
                              for key in ("step_time_s", "overhead_s", "start_s")}})
            log(f"calibration at {k} replicas: step {points[-1]['step_time_s']:.3f} s, overhead "
                f"{points[-1]['overhead_s'] * 1000:.0f} ms, start {points[-1]['start_s']:.2f} s")
    return {"points": points}


def run_inputs(rounds_dir: Path, microbatches: int, device_time_s: float) -> dict[str, Any]:
    """The simulator's inputs measured in one seed's run directories (``rounds_dir/<system>``): the
    reference's step time, tokens per microbatch and calibration point; recover's recovery latency;
    shrink-and-drop's reconfiguration; checkpoint-and-restart's relaunches."""
    from recover.sim.calibration import calibrate

    ref = rounds_dir / "reference"
    first = next(iter(load_metrics(ref)), {})
    row = {name: {"run_dir": str(rounds_dir / name)} if (rounds_dir / name).is_dir() else None
           for name in FAILURE_SYSTEMS}
    return {"tokens_per_microbatch": int(first.get("tokens", 0) // max(1, microbatches)),
            "step_time_s": calibrate(ref).step_time_s, "recovery_latency_s": _latency(row["recover"]),
            "reconfig_s": _reconfig_s(row[Baseline.SHRINK.value]),
            "restart_s": _relaunch_s(row[Baseline.RESTART.value]),
            "relaunches": _relaunches(row[Baseline.RESTART.value]),
            "full_point": calibration_point(ref, microbatches, device_time_s)}


def read_run(row: dict[str, Any]) -> dict[str, Any]:
    """One system's run (a ``bench failures`` row) as a :data:`SeedResult` entry."""
    run_dir = Path(row["run_dir"])
    if "train_s" not in row:
        return {"completed": False, "error": row.get("error")}
    win = windows(run_dir)
    kills = [[e["t"] - win["start_t"], int(e.get("replica", 0))] for e in load_events(run_dir)
             if e.get("kind") == Event.KILL]
    return {"completed": row["completed"], "final_val_loss": row.get("final_val_loss"),
            "losses": [r["loss"] for r in load_metrics(run_dir)], "train_s": row["train_s"],
            "tokens": row["committed_tokens"], "series": model_series(run_dir, win), "kills": kills,
            "max_rel_loss_dev": row.get("max_rel_loss_dev"), "min_microbatches": row.get("min_microbatches"),
            "checkpoint_every": row.get("checkpoint_every")}


def model_series(run_dir: Path, win: dict[str, float]) -> list[list[float]]:
    """``[t, live_replicas, model_tokens]`` per record of ``metrics.jsonl`` in time order (rollbacks undone)."""
    recs = sorted((r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r and "elapsed_s" in r),
                  key=lambda r: r["elapsed_s"])
    held: dict[int, int] = {}
    out = []
    for r in recs:
        for s in [s for s in held if s >= r["step"]]:
            del held[s]
        held[int(r["step"])] = int(r.get("tokens", 0))
        out.append([win["launch_t"] + r["elapsed_s"] - win["start_t"], int(r.get("live_replicas", 1)),
                    sum(held.values())])
    return out


def _latency(row: dict[str, Any] | None) -> float | None:
    """Median over kills of the kill to the first new generation naming the replica dead (detection and the
    new generation: what the simulator's ``recovery_latency_s`` is), None without one."""
    if not row or "run_dir" not in row:
        return None
    events = load_events(row["run_dir"])
    gaps = []
    for k in (e for e in events if e.get("kind") == Event.KILL):
        t = min((g["t"] for g in events if g.get("kind") == Event.GENERATION and g["t"] >= k["t"]
                 and k.get("replica") in g.get("dead", [])), default=None)
        if t is not None:
            gaps.append(t - k["t"])
    return statistics.median(gaps) if gaps else None


def _relaunches(row: dict[str, Any] | None) -> list[list[float]]:
    """``[replicas relaunched, cost]`` per relaunch of a checkpoint-and-restart run: the cost is the first
    commit of the relaunched job - the kill - the step after it (detection, teardown, process start,
    rendezvous, checkpoint load and warm-up)."""
    if not row or "run_dir" not in row:
        return []
    run_dir = Path(row["run_dir"])
    win = windows(run_dir)
    events = load_events(run_dir)
    commits = sorted((win["launch_t"] + r["elapsed_s"], int(r.get("live_replicas", 1)))
                     for r in read_jsonl(run_dir / "metrics.jsonl") if "elapsed_s" in r and "step" in r)
    out = []
    for e in (e for e in events if e.get("kind") == Event.JOB_RESTART):
        kill = max((k["t"] for k in events if k.get("kind") == Event.KILL and k["t"] <= e["t"]), default=None)
        begun = min((g["t"] for g in events if g.get("kind") == Event.GENERATION and g.get("reason") == "initial"
                     and g["t"] > e["t"]), default=e["t"])  # the relaunched job's first generation
        after = [(t, n) for t, n in commits if t > begun]  # not a commit of the old job racing its teardown
        if kill is None or len(after) < 3:
            continue
        step = statistics.median(b[0] - a[0] for a, b in zip(after, after[1:], strict=False))
        out.append([after[0][1], max(0.0, after[0][0] - kill - step)])
    return out


def _relaunch_s(row: dict[str, Any] | None) -> float | None:
    """Median cost over a run's relaunches (:func:`_relaunches`), None without one."""
    costs = [c for _, c in _relaunches(row)]
    return statistics.median(costs) if costs else None


def _commit_times(run_dir: Path, win: dict[str, float]) -> list[float]:
    return sorted(win["launch_t"] + r["elapsed_s"] for r in read_jsonl(run_dir / "metrics.jsonl")
                  if "elapsed_s" in r and "step" in r)


def _reconfig_s(row: dict[str, Any] | None) -> float | None:
    """Shrink-and-drop's reconfiguration: median over kills of the gap between the commits around the kill
    minus two steps (the dropped one and the next), a step being the median interval between commits."""
    if not row or "run_dir" not in row:
        return None
    run_dir = Path(row["run_dir"])
    win = windows(run_dir)
    times = _commit_times(run_dir, win)
    kills = [e["t"] for e in load_events(run_dir) if e.get("kind") == Event.KILL]
    if len(times) < 3 or not kills:
        return None
    step = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    gaps = []
    for k in kills:
        before, after = [t for t in times if t <= k], [t for t in times if t > k]
        if before and after:
            gaps.append(max(0.0, after[0] - before[-1] - 2 * step))
    return statistics.median(gaps) if gaps else None


def run_bitwise(plan: Plan, out: Path, log: Log) -> dict[str, Any]:
    """Deterministic mode: reference and recover of the first seed, same schedule; bitwise per-step losses."""
    from recover.bench.failures import run_bench

    seed = plan.seeds[0]
    res = run_bench(config=plan.config, replicas=plan.replicas, steps=plan.steps, out=out, systems=("recover",),
                    overrides=[*plan.overrides, f"--training.seed={seed}", "--training.deterministic=true"],
                    timeout_s=plan.timeout_s, device_time_s=plan.device_time_s, rounds=1, log=log)
    rows = {r["name"]: r for r in res["systems"]}
    ref, rec = (load_metrics(rows[n]["run_dir"]) if n in rows else [] for n in ("reference", "recover"))
    same = bool(ref) and len(ref) == len(rec) and all(a["loss"] == b["loss"] for a, b in zip(ref, rec, strict=True))
    return {"system": "recover", "seed": seed, "deterministic": True, "steps": len(rec), "bitwise_equal": same,
            "final_val_loss": rows.get("recover", {}).get("final_val_loss"),
            "reference_final_val_loss": rows.get("reference", {}).get("final_val_loss"),
            "schedule": res["schedule"]["fails"]}
