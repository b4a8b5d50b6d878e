"""The evaluation of ``recover bench paper``: the seeds run, then the numbers of the four results.

Contract:
- :func:`evaluate` runs a :class:`~recover.bench.paperruns.Plan` (its runners injectable): for
  each seed, the failure-free reference, recover, checkpoint-and-restart and shrink-and-drop on
  the same ``successive`` failure schedule (half the replicas lost at evenly spaced steps), in the
  default (non-deterministic) mode, on emulated devices (:func:`recover.bench.paperruns.run_seed`,
  one ``bench failures`` round per seed: the seeds are the rounds); then, with ``bitwise``,
  recover against its reference in deterministic mode (:func:`~recover.bench.paperruns.run_bitwise`).
  Progress is shown with rich (stderr).
- :func:`assemble` (pure, runs on fake seed results in a unit test) turns the seed results into the
  result object, whose top-level lists are ``trajectory``, ``throughput``, ``budget`` and
  ``simulator`` (each row names its ``system``; every ``simulator`` row holds ``measured`` and
  ``simulated`` for the same trace), plus ``projections`` (the presets, see
  :mod:`recover.bench.papersim`) and ``bitwise``.
- Trajectory: every system's final validation loss per seed against the failure-free seeds'
  spread, by the 95% prediction interval and the permutation test of :mod:`recover.bench.paperstats`.
- Throughput: per system, the median over seeds of effective throughput (committed tokens /
  training time) and of the throughput after successive failures (model tokens gained from the
  first kill to the end / that time), with ratios to checkpoint-and-restart.
- Budget: per seed, the GPU-time budget B = the fewest GPU-seconds any failure system held by its
  end (one replica = one emulated device); tokens in the model at ``f x B`` for f = 0.1 .. 1, medians
  over seeds, and recover's gain over checkpoint-and-restart at each f (the widening gap).
- :func:`evaluate` adds the wall time (``wall_s``), the load average before and after and ``out``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recover.bench import paperstats as st
from recover.bench.common import Log, machine_load, write_json
from recover.bench.paperruns import Plan, Runner, SeedResult, run_bitwise, run_calibration, run_inputs, run_seed
from recover.errors import ConfigError

FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))
SYSTEM_ORDER = ("failure-free", "recover", "checkpoint-and-restart", "shrink-and-drop")
BitwiseRunner = Callable[[Plan, Path, Log], dict[str, Any]]
CalibrationRunner = Callable[[Plan, Path, Log], dict[str, Any]]


def evaluate(plan: Plan, out: Path, runner: Runner = run_seed, bitwise_runner: BitwiseRunner = run_bitwise,
             show_progress: bool = True, scenarios: Sequence[str] | None = None,
             resume: bool = False, calibration_runner: CalibrationRunner = run_calibration) -> dict[str, Any]:
    """Runs every stage with a progress bar; returns :func:`assemble`'s object.

    The stages: the plan's seeds, its calibration (failure-free runs at fewer replicas, for the
    simulator), then each ``plan.scale`` plan's seeds and calibration (under ``out/scaleN``), then
    the bitwise check. Each stage's result is kept in a JSON file under its directory; with
    ``resume`` a stage whose file exists and was made by the same plan is read back instead of run
    again, so that an interrupted evaluation continues and a report can be rebuilt from the runs
    already made.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0, load_before = time.time(), machine_load()
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    parts = [(plan, out), *((sp, out / f"scale{sp.replicas}") for sp in plan.scale)]
    done: list[tuple[Plan, list[SeedResult], dict[str, Any]]] = []
    stage_s: list[float] = []  # each stage's own wall time, run now or read back
    bitwise = None
    total = sum(len(p.seeds) + 1 for p, _ in parts) + (1 if plan.bitwise else 0)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=not show_progress) as progress:
        task = progress.add_task(f"bench paper ({plan.label})", total=total)

        def log(msg: str) -> None:
            progress.console.print(msg, highlight=False, markup=False)

        for part, where in parts:
            seeds: list[SeedResult] = []
            for seed in part.seeds:
                progress.update(task, description=f"{part.replicas} replicas, seed {seed}: 4 systems, "
                                                  f"{part.steps} steps")
                res = _stage(part, where / f"seed{seed}" / "seed.json", resume, log,
                             lambda part=part, seed=seed, where=where: runner(part, seed, where / f"seed{seed}", log),
                             stage_s)
                seeds.append(_measured_again(res, where / f"seed{seed}", part))
                progress.advance(task)
            progress.update(task, description=f"{part.replicas} replicas: failure-free calibration at "
                                              f"{part.calibration_counts()} replicas")
            cal = _stage(part, where / "calibration" / "calibration.json", resume, log,
                         lambda part=part, where=where: calibration_runner(part, where / "calibration", log), stage_s)
            progress.advance(task)
            done.append((part, seeds, cal))
        if plan.bitwise:
            progress.update(task, description="deterministic mode: recover vs its reference, bitwise")
            bitwise = _stage(plan, out / "deterministic" / "bitwise.json", resume, log,
                             lambda: bitwise_runner(plan, out / "deterministic", log), stage_s)
            progress.advance(task)
    (_, seeds, cal), scale = done[0], done[1:]
    res = assemble(plan, seeds, bitwise, scenarios, calibration=cal, scale=scale)
    res.update(wall_s=round(time.time() - t0, 1), stages_s=round(sum(stage_s), 1),
               load={"before": load_before, "after": machine_load()}, out=str(out))
    return res


def _measured_again(seed: SeedResult, where: Path, plan: Plan) -> SeedResult:
    """``seed`` with the inputs its run directories give re-read (:func:`~recover.bench.paperruns.run_inputs`),
    so that a resumed evaluation takes them as this version measures them; kept as they were when the
    runs are gone (or were faked)."""
    inputs = seed.get("inputs", {})
    try:
        fresh = run_inputs(where / "round0", int(inputs["microbatches"]), plan.device_time_s)
    except (KeyError, ValueError, OSError, ConfigError):
        return seed
    return {**seed, "inputs": {**inputs, **fresh}}


def _stage(plan: Plan, path: Path, resume: bool, log: Log, run: Callable[[], dict[str, Any]],
           stage_s: list[float]) -> dict[str, Any]:
    """One stage's result: read back from ``path`` (``resume``, same plan) or run and kept there (with its wall
    time, appended to ``stage_s`` either way: 0 for a stage kept by an older release without it)."""
    import json

    key = _plan_key(plan)
    if resume and path.exists():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        if kept.get("plan") == key and "result" in kept:
            log(f"{path.parent.name}: read back from {path} (--resume)")
            stage_s.append(float(kept.get("wall_s") or kept["result"].get("wall_s") or 0.0))
            return dict(kept["result"])
    t0 = time.time()
    result = run()
    stage_s.append(time.time() - t0)
    write_json(path, {"plan": key, "result": result, "wall_s": round(stage_s[-1], 1)})
    return result


def _plan_key(plan: Plan) -> dict[str, Any]:
    """What makes two plans' runs interchangeable: what a run is made of (not its seeds' number, label or timeout)."""
    return json.loads(json.dumps({k: getattr(plan, k) for k in ("config", "replicas", "steps", "device_time_s",
                                                                 "overrides")}))


def assemble(plan: Plan, seeds: Sequence[SeedResult], bitwise: dict[str, Any] | None,
             scenarios: Sequence[str] | None = None, calibration: dict[str, Any] | None = None,
             scale: Sequence[tuple[Plan, Sequence[SeedResult], dict[str, Any] | None]] = ()) -> dict[str, Any]:
    """The result object from the seed results (pure; see the module docstring).

    Args:
        scenarios: the simulator presets to project (default all of :data:`recover.bench.papersim.PROJECTIONS`).
        calibration: :func:`~recover.bench.paperruns.run_calibration`'s result for ``plan`` (None: the
            simulator takes one step overhead and one relaunch cost).
        scale: ``(plan, seed results, calibration)`` of further replica counts, for the simulator's
            check and the ``scale`` rows only.
    """
    from recover.bench.papersim import ASSUMED, PROJECTIONS, SCALED_COSTS, projections

    simulator = _simulator(seeds, calibration)
    scale_rows = []
    for sp, sseeds, scal in scale:
        simulator += _simulator(sseeds, scal)
        scale_rows.append({"replicas": sp.replicas, "config": sp.config, "steps": sp.steps,
                           "seeds": [s["seed"] for s in sseeds], "throughput": _throughput(sseeds),
                           "budget": _budget_rows([_budget(s) for s in sseeds]),
                           "calibration": (scal or {}).get("points", [])})
    inputs = _median_inputs(seeds)
    return {
        "benchmark": "paper", "plan": _plan_json(plan),
        "trajectory": _trajectory(seeds) + ([bitwise] if bitwise else []),
        "throughput": _throughput(seeds),
        "budget": _budget_rows([_budget(s) for s in seeds]),
        "simulator": simulator,
        "scale": scale_rows,
        "calibration": (calibration or {}).get("points", []),
        "projections": projections(inputs, PROJECTIONS if scenarios is None else scenarios) if inputs else [],
        "inputs": inputs, "bitwise": bitwise,
        "projection_basis": {"measured": [f"{k} / step_time_s" for k in SCALED_COSTS], "assumed": list(ASSUMED)},
        "seeds": [{k: v for k, v in s.items() if k != "systems"} for s in seeds],
        "deviation": _deviation(seeds),
        "curves": {name: st.band([s["systems"][name]["losses"] for s in seeds if name in s["systems"]])
                   for name in _systems(seeds)},
    }


def _deviation(seeds: Sequence[SeedResult]) -> dict[str, dict[str, list[float]]]:
    """Per system, the band over seeds of its per-step training loss minus the failure-free run's of the same
    seed (the same initialisation and data order): where a system's trajectory leaves the reference's."""
    out = {}
    for name in _systems(seeds):
        if name == "failure-free":
            continue
        diffs = [np.subtract(run["losses"][:n], ref["losses"][:n]).tolist() for s in seeds
                 if (run := s["systems"].get(name, {})).get("losses") and
                 (ref := s["systems"].get("failure-free", {})).get("losses")
                 and (n := min(len(run["losses"]), len(ref["losses"])))]
        if diffs:
            out[name] = st.band(diffs)
    return out


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {k: ([_plan_json(p) for p in v] if k == "scale" else v) for k, v in vars(plan).items()}


def _simulator(seeds: Sequence[SeedResult], calibration: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The simulator rows of every completed failure run of ``seeds`` (see :func:`recover.bench.papersim.validate`)."""
    from recover.bench.papersim import costs_elsewhere, validate

    points = (calibration or {}).get("points", [])
    rows = []
    for s in seeds:
        b = _budget(s)
        inputs = costs_elsewhere(s["inputs"], [o["inputs"] for o in seeds if o is not s])
        for name, run in s["systems"].items():
            if name != "failure-free" and run.get("completed"):
                at = b["tokens"].get(name, [None])[-1] if b["budget_gpu_s"] else None
                rows += validate(s["seed"], name, inputs, run, b["budget_gpu_s"], at, points)
    return rows


def _systems(seeds: Sequence[SeedResult]) -> list[str]:
    present = {n for s in seeds for n in s["systems"]}
    return [n for n in SYSTEM_ORDER if n in present] + sorted(present - set(SYSTEM_ORDER))


def _trajectory(seeds: Sequence[SeedResult]) -> list[dict[str, Any]]:
    ref = [s["systems"]["failure-free"]["final_val_loss"] for s in seeds
           if s["systems"].get("failure-free", {}).get("final_val_loss") is not None]
    by_seed = {s["seed"]: s["systems"]["failure-free"]["final_val_loss"] for s in seeds
               if s["systems"].get("failure-free", {}).get("final_val_loss") is not None}
    rows = []
    for name in _systems(seeds):
        runs = [(s["seed"], s["systems"][name]) for s in seeds if name in s["systems"]]
        vals = [r["final_val_loss"] for _, r in runs if r.get("final_val_loss") is not None]
        row: dict[str, Any] = {"system": name, "seeds": [sd for sd, _ in runs], "final_val_loss": vals,
                               "completed": all(r.get("completed") for _, r in runs),
                               "min_microbatches": min((r.get("min_microbatches") or 0 for _, r in runs), default=0),
                               "max_rel_loss_dev": max((r.get("max_rel_loss_dev") or 0 for _, r in runs), default=0),
                               "first_loss": _mean([r["losses"][0] for _, r in runs if r.get("losses")]),
                               "last_loss": _mean([r["losses"][-1] for _, r in runs if r.get("losses")])}
        if name != "failure-free" and len(ref) >= 2 and vals:
            row["test"] = st.seed_test(ref, vals)
            pairs = [(ff, r["final_val_loss"]) for sd, r in runs if r.get("final_val_loss") is not None
                     and (ff := by_seed.get(sd)) is not None]
            if len(pairs) >= 2:
                row["paired"] = st.paired_test([a for a, _ in pairs], [b for _, b in pairs])
        rows.append(row)
    return rows


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _throughput(seeds: Sequence[SeedResult]) -> list[dict[str, Any]]:
    rows = []
    for name in _systems(seeds):
        per = []
        for s in seeds:
            run = s["systems"].get(name)
            if not run or "train_s" not in run:
                continue
            kills = [k[0] for k in run.get("kills", [])]
            per.append({"seed": s["seed"], "effective_tokens_per_s": run["tokens"] / run["train_s"],
                        "after_failures_tokens_per_s": st.after_failures(run["series"], min(kills, default=None)),
                        "train_s": run["train_s"], "failures": len(kills)})
        rows.append({"system": name, "rounds": per,
                     "effective_tokens_per_s": st.median_of([p["effective_tokens_per_s"] for p in per]),
                     "after_failures_tokens_per_s": st.median_of([p["after_failures_tokens_per_s"] for p in per])})
    base = {r["system"]: r for r in rows}
    for r in rows:
        for key, other in (("vs_failure_free", "failure-free"), ("vs_checkpoint_restart", "checkpoint-and-restart")):
            b = base.get(other)
            field = "after_failures_tokens_per_s" if other != "failure-free" else "effective_tokens_per_s"
            r[key] = (r[field] / b[field]) if b and r[field] and b[field] else None
    return rows


def _budget(seed: SeedResult) -> dict[str, Any]:
    """One seed's budget B and each system's model tokens at ``f x B`` (f in :data:`FRACTIONS`)."""
    import numpy as np
    curves = {name: st.budget_curve(run["series"]) for name, run in seed["systems"].items()
              if run.get("series") and name != "failure-free"}
    if not curves:
        return {"seed": seed["seed"], "budget_gpu_s": None, "tokens": {}}
    budget = min(float(g[-1]) for g, _ in curves.values())
    tokens = {name: [float(x) for x in st.tokens_at(g, t, np.array(FRACTIONS) * budget)]
              for name, (g, t) in curves.items()}
    return {"seed": seed["seed"], "budget_gpu_s": budget, "tokens": tokens}


def _budget_rows(budgets: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    names = [n for n in SYSTEM_ORDER if any(n in b["tokens"] for b in budgets)]
    restart = "checkpoint-and-restart"
    rows = []
    for name in names:
        per = [b for b in budgets if name in b["tokens"]]
        curve = [st.median_of([b["tokens"][name][i] for b in per]) for i in range(len(FRACTIONS))]
        gain = [st.median_of([b["tokens"][name][i] / b["tokens"][restart][i] - 1 for b in per
                              if restart in b["tokens"] and b["tokens"][restart][i]]) for i in range(len(FRACTIONS))]
        rows.append({"system": name, "budget_gpu_s": st.median_of([b["budget_gpu_s"] for b in per]),
                     "fractions": list(FRACTIONS), "tokens": curve, "tokens_at_budget": curve[-1],
                     "gain_vs_checkpoint_restart": gain,
                     "rounds": [{"seed": b["seed"], "budget_gpu_s": b["budget_gpu_s"],
                                 "tokens_at_budget": b["tokens"][name][-1]} for b in per]})
    return rows


def _median_inputs(seeds: Sequence[SeedResult]) -> dict[str, Any]:
    if not seeds:
        return {}
    keys = seeds[0]["inputs"].keys()
    out: dict[str, Any] = {}
    for k in keys:
        vals = [s["inputs"].get(k) for s in seeds]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[k] = st.median_of(nums) if nums else vals[0]
    return out
