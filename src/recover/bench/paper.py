"""``recover bench paper``: the ReCoVer paper's evaluation on this machine, by one command.

Contract: the command line and the two plans. :data:`FULL` (or :data:`QUICK` with ``--quick``;
``--seeds``, ``--steps`` and ``--replicas`` change it, refused in one line below their minimum) is
run by :func:`recover.bench.papereval.evaluate` (the seeds, then deterministic mode, with a progress
bar), reported by :mod:`recover.bench.paperreport` (``PAPER.md``, the PNG plots, the console table)
and written to ``OUT/results.json`` and ``--json FILE``. The command exits 1 with one line when a
run did not complete or deterministic mode was not bitwise equal (:func:`problems_of`), else 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from recover.bench.common import write_json
from recover.bench.paperruns import Plan
from recover.errors import ConfigError

DEBUG_M = 8
"""The ``debug`` preset's microbatches per step (``training.global_microbatches``)."""


def scale_plan(n: int, steps: int = 48, seeds: tuple[int, ...] = (0, 1), device_time_s: float = 0.25,
               overrides: tuple[str, ...] = (), **kw: Any) -> Plan:
    """A check plan at ``n`` replicas on the ``debug`` preset, with at least one microbatch per replica (M
    raised to ``n`` where the preset's is smaller)."""
    more = (f"--training.global_microbatches={n}",) if n > DEBUG_M else ()
    return Plan(config="debug", replicas=n, steps=max(steps, n // 2 + 2), seeds=seeds, device_time_s=device_time_s,
                bitwise=False, label=f"scale {n}", overrides=(*overrides, *more), **kw)


SCALE = (scale_plan(8), scale_plan(16))
"""The simulator's check at 8 and 16 replicas: the smallest model, so that 16 processes on 2 cores stay
below the emulated device time."""
FULL = Plan(config="tiny", replicas=4, steps=200, seeds=(0, 1, 2, 3, 4), device_time_s=0.25, label="full",
            scale=SCALE)
"""Sized for under 2 hours on 2 idle cores: 5 seeds x (reference, recover, restart, shrink) x 200 steps of
~0.55 s, the failure-free calibration runs, the 8- and 16-replica checks, and the deterministic pair."""
QUICK = Plan(config="debug", replicas=4, steps=30, seeds=(0, 1, 2), device_time_s=0.1, timeout_s=600.0,
             label="quick", calibration_rounds=1, calibration_steps=12,
             scale=(scale_plan(8, steps=24, seeds=(0,), device_time_s=0.1, timeout_s=600.0, calibration_rounds=1,
                               calibration_steps=12),))
"""The whole pipeline in minutes: the smallest model, 3 seeds, 30 steps, one 8-replica check."""


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench paper`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "paper", help="the paper's evaluation: trajectory, throughput, tokens at a budget, simulator checked",
        description="Runs the ReCoVer paper's evaluation on emulated devices: for several seeds, a failure-free "
                    "reference, recover, checkpoint-and-restart and shrink-and-drop on the same failure trace "
                    "(half the replicas lost); reports the final validation loss against the failure-free seeds' "
                    "spread, effective throughput after successive failures, tokens at a GPU-time budget, and "
                    "`recover simulate` replaying the same traces from measured inputs; projects 512, 16k and "
                    "131k GPUs. Writes PAPER.md, PNG plots and results.json under --out. Config overrides (e.g. "
                    "--data.path DIR) go to every run.")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run of the whole pipeline ({QUICK.config} preset, {len(QUICK.seeds)} seeds, "
                        f"{QUICK.steps} steps; minutes); default: the full evaluation ({FULL.config}, "
                        f"{len(FULL.seeds)} seeds, {FULL.steps} steps; under 2 hours on 2 idle cores)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 5 full, 3 quick; >= 2)")
    p.add_argument("--steps", type=int, default=None, help="committed steps per run (default: 200 full, 30 quick)")
    p.add_argument("--replicas", type=int, default=None,
                   help="emulated replicas (devices) per run, half of them lost (default 4; the simulator's check "
                        "is meant for 4 to 16)")
    p.add_argument("--scale", default=None, metavar="N[,N...]|none",
                   help="the replica counts of the simulator's further checks (default: 8,16 full, 8 quick; "
                        "'none' skips them); each runs the plan's check preset with half its replicas lost")
    p.add_argument("--out", default="runs/bench-paper", help="directory of the runs, plots and PAPER.md")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--resume", action="store_true",
                   help="read back the seeds (and the deterministic check) already run into --out by the same plan "
                        "instead of running them again: continues an interrupted evaluation, or rebuilds its report")
    p.set_defaults(func=run_from_args, accepts_overrides=True)
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan ``--quick``, ``--seeds``, ``--steps`` and ``--replicas`` ask for.

    Raises:
        ConfigError: fewer than 2 seeds (no spread) or fewer than 8 steps.
    """
    import dataclasses

    plan = QUICK if args.quick else FULL
    if args.seeds is not None:
        if args.seeds < 2:
            raise ConfigError(f"--seeds {args.seeds}: at least 2, for the failure-free seeds' spread")
        plan = dataclasses.replace(plan, seeds=tuple(range(args.seeds)))
    if args.steps is not None:
        if args.steps < 8:
            raise ConfigError(f"--steps {args.steps}: at least 8, so that half the replicas can fail in between")
        plan = dataclasses.replace(plan, steps=args.steps)
    if getattr(args, "replicas", None) is not None:
        if args.replicas < 2:
            raise ConfigError(f"--replicas {args.replicas}: at least 2, so that half of them can fail")
        plan = dataclasses.replace(plan, replicas=args.replicas)
    extra = tuple(getattr(args, "overrides", None) or ())
    if extra:  # config overrides (e.g. --data.path DIR) go to every run, the check plans' too
        if any(o.split("=")[0] in ("--training.device_time_s", "--training.seed", "--parallel.replicas",
                                   "--training.steps") for o in extra):
            raise ConfigError("bench paper sets --training.device_time_s, --training.seed, --parallel.replicas and "
                              "--training.steps itself; use --seeds, --steps and --replicas instead")
        plan = dataclasses.replace(plan, overrides=(*plan.overrides, *extra),
                                   scale=tuple(dataclasses.replace(sp, overrides=(*sp.overrides, *extra))
                                               for sp in plan.scale))
    scale = getattr(args, "scale", None)
    if scale is not None:
        plan = dataclasses.replace(plan, scale=_scale_plans(plan, scale))
    if plan.steps < plan.replicas // 2 + 2:
        raise ConfigError(f"--steps {plan.steps} is too short to lose {plan.replicas // 2} of {plan.replicas} replicas "
                          f"at evenly spaced steps; use at least {plan.replicas // 2 + 2}")
    return plan


def _scale_plans(plan: Plan, text: str) -> tuple[Plan, ...]:
    """``--scale``: the plan's check plans at the replica counts named (refused in one line when not counts)."""

    if text.strip().lower() == "none":
        return ()
    template = (plan.scale or (QUICK if plan.label == "quick" else FULL).scale)[0]
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 2 for n in counts):
        raise ConfigError(f"--scale {text}: replica counts >= 2 separated by commas (e.g. 8,16), or none")
    kept = {k: getattr(template, k) for k in ("seeds", "device_time_s", "timeout_s", "calibration_rounds",
                                              "calibration_steps")}
    return tuple(scale_plan(n, steps=template.steps, overrides=plan.overrides, **kept) for n in counts)


def run_from_args(args: argparse.Namespace) -> int:
    from recover.bench.papereval import evaluate
    from recover.bench.paperreport import print_summary, write_report

    plan = plan_from_args(args)
    out = Path(args.out)
    res = evaluate(plan, out, resume=args.resume)
    res["report"] = [str(p) for p in write_report(res, out)]
    write_json(out / "results.json", res)
    if args.json:
        write_json(args.json, res)
    print_summary(res)
    problems = problems_of(res)
    if problems:
        print(f"recover bench paper: {'; '.join(problems)}; see {out / 'PAPER.md'} and the runs' logs under {out}",
              file=sys.stderr)
    return 1 if problems else 0


def problems_of(res: dict[str, Any]) -> list[str]:
    """What makes the evaluation fail (exit 1): a run that did not complete, deterministic mode not bitwise."""
    out = [f"{r['system']} did not complete every run" for r in res["trajectory"] if r.get("completed") is False]
    if res.get("bitwise") and not res["bitwise"]["bitwise_equal"]:
        out.append("deterministic mode: recover's losses are not bitwise equal to its failure-free run's")
    return out
