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
    first = next(iter(load_metrics(rows["reference"]["run_dir"])), {})
    yd = res["young_daly"]
    from recover.sim.calibration import calibrate

    inputs = {
        "replicas": plan.replicas, "microbatches": res["microbatches"],
        "tokens_per_microbatch": int(first.get("tokens", 0) // max(1, res["microbatches"])),
        "step_time_s": calibrate(rows["reference"]["run_dir"]).step_time_s, "device_time_s": plan.device_time_s,
        "recovery_latency_s": _latency(rows.get("recover")), "reconfig_s": _reconfig_s(rows.get(Baseline.SHRINK.value)),
        "restart_s": _relaunch_s(rows.get(Baseline.RESTART.value)), "save_s": yd.get("save_cost_s"),
        "checkpoint_every": yd.get("checkpoint_every"), "compute_s": res["device"]["compute_s"],
        "device_dominates": res["device"]["dominates"],
    }
    return {"seed": seed, "load": load, "wall_s": round(time.time() - t0, 1), "inputs": inputs, "systems": runs,
            "schedule": res["schedule"]["fails"]}


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
    """Median recovery latency (seconds) of a run's recoveries, None without one."""
    if not row or "run_dir" not in row:
        return None
    ms = [e["latency_ms"] for e in load_events(row["run_dir"])
          if e.get("kind") in (Event.RECOVERY, Event.RECOVERED) and isinstance(e.get("latency_ms"), (int, float))]
    return statistics.median(ms) / 1000 if ms else None


def _relaunch_s(row: dict[str, Any] | None) -> float | None:
    """Median over relaunches of (first commit after the relaunch - the kill) - the step after it."""
    if not row or "run_dir" not in row:
        return None
    run_dir = Path(row["run_dir"])
    win = windows(run_dir)
    events = load_events(run_dir)
    times = _commit_times(run_dir, win)
    costs = []
    for e in (e for e in events if e.get("kind") == Event.JOB_RESTART):
        kill = max((k["t"] for k in events if k.get("kind") == Event.KILL and k["t"] <= e["t"]), default=None)
        after = [t for t in times if t > e["t"]]
        if kill is None or len(after) < 3:
            continue
        step = statistics.median(b - a for a, b in zip(after, after[1:], strict=False))
        costs.append(after[0] - kill - step)
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
