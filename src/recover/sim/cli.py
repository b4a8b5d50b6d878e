"""``recover simulate``: the cluster-scale discrete-event simulator from the command line.

Contract: builds a :class:`~recover.sim.model.JobSpec` from ``--preset`` (or the defaults), then
the job flags (each overrides one field), then ``--trace`` and ``--calibrate`` (which never
overrides a field given by a flag); runs
:func:`~recover.sim.engine.simulate`; prints the tables, the recover ratios (next to the paper's
for ``paper-512``) and the simulation's wall time; writes ``--json`` and the plots of ``--out``.
Bad input raises :class:`~recover.errors.ConfigError` (one line, exit status 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from recover.errors import ConfigError

PRESET_NAMES = ("paper-512", "llama3-16k", "131k")  # mirrors recover.sim.presets.PRESETS
STRATEGY_NAMES = ("recover", "checkpoint-restart", "shrink-drop")

# flag, JobSpec field, type, scale to the field's unit, help
_JOB_FLAGS: tuple[tuple[str, str, type, float, str], ...] = (
    ("--gpus", "gpus", int, 1, "GPUs of the job"),
    ("--tp", "tp", int, 1, "tensor-parallel degree of a replica"),
    ("--pp", "pp", int, 1, "pipeline stages of a replica"),
    ("--shard", "shard", int, 1, "FSDP shard-group size of a replica (replica = pp x tp x shard GPUs)"),
    ("--microbatches", "microbatches", int, 1, "M, microbatches per step"),
    ("--tokens-per-microbatch", "tokens_per_microbatch", int, 1, "tokens in one microbatch"),
    ("--step-time", "step_time_s", float, 1, "failure-free step time with every replica, seconds"),
    ("--step-overhead", "step_overhead_s", float, 1, "part of a step that does not scale with the quota, s"),
    ("--hours", "duration_s", float, 3600, "run length, hours"),
    ("--days", "duration_s", float, 86400, "run length, days"),
    ("--budget-gpu-hours", "budget_gpu_h", float, 1, "GPU-hour budget (default: GPUs x run length)"),
    ("--failures", "failures", str, 1, "exponential, weibull, trace or none"),
    ("--gpu-mttf-hours", "gpu_mttf_h", float, 1, "mean time to failure of one GPU, hours"),
    ("--weibull-shape", "weibull_shape", float, 1, "Weibull shape k (with --failures weibull)"),
    ("--repair", "repair_s", float, 1, "seconds until a failed replica is replaced"),
    ("--min-replicas", "min_replicas", int, 1, "fewest live replicas a job runs with"),
    ("--recovery-latency", "recovery_latency_s", float, 1, "recover: detection + new generation, s"),
    ("--rejoin-cost", "rejoin_cost_s", float, 1, "state transfer to a rejoining replica, s"),
    ("--save", "save_s", float, 1, "checkpoint save, s"),
    ("--load", "load_s", float, 1, "checkpoint load, s"),
    ("--restart", "restart_s", float, 1, "relaunch of the job, s"),
    ("--restart-mode", "restart_mode", str, 1, "checkpoint-restart: survivors or replace"),
    ("--checkpoint-interval", "checkpoint_interval_s", float, 1, "compute s between checkpoints (Young/Daly)"),
    ("--reconfig", "reconfig_s", float, 1, "shrink-drop reconfiguration after a failure, s"),
    ("--target-tokens", "target_tokens", float, 1, "token target for 'time to target'"),
    ("--seed", "seed", int, 1, "seed of the sampled failures"),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` sub-command to ``sub``."""
    p = sub.add_parser(
        "simulate",
        help="simulate recover, checkpoint-restart and shrink-drop on a cluster-scale job with failures",
        description="Discrete-event simulation of a training job under GPU failures: recover (in-step "
        "recovery, constant M), checkpoint-and-restart and shrink-and-drop, over the same failures. "
        "Presets: paper-512 (ReCoVer's 512-GPU scenario), llama3-16k, 131k. Every job field can be "
        "overridden; see docs/BENCHMARKS.md for the model and the assumptions.",
    )
    p.add_argument("--preset", choices=PRESET_NAMES, help="a named job (default: the JobSpec defaults)")
    group = p.add_argument_group("job (each overrides one field of the preset)")
    for flag, _field, kind, _, help_ in _JOB_FLAGS:
        group.add_argument(flag, dest=flag[2:].replace("-", "_"), type=kind, default=None, help=help_)
    group.add_argument("--job-mtbf-hours", type=float, default=None,
                       help="the job's MTBF at full size, hours (sets the per-GPU MTTF = this x GPUs)")
    group.add_argument("--rejoin", dest="rejoin", action=argparse.BooleanOptionalAction, default=None,
                       help="replace failed replicas after --repair and take them back")
    p.add_argument("--trace", type=Path, help="replay failures from a file: one 'time_s gpu' per line")
    p.add_argument("--calibrate", type=Path, metavar="RUN_DIR",
                   help="take step time and recovery latency from a `recover launch` run directory")
    p.add_argument("--strategies", default=",".join(STRATEGY_NAMES),
                   help=f"comma-separated subset of {', '.join(STRATEGY_NAMES)}")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    p.add_argument("--out", type=Path, metavar="DIR", help="write throughput/tokens/time-lost plots (PNG) here")
    p.add_argument("--bins", type=int, default=60, help="time bins of the throughput plot (60)")
    p.add_argument("--assumptions", action="store_true", help="print every assumption of the job")
    p.set_defaults(func=run)


def build_spec(args: argparse.Namespace) -> Any:
    """The :class:`JobSpec` the flags describe (preset, overrides, trace, calibration)."""
    from recover.sim.calibration import calibrate
    from recover.sim.failures import read_trace
    from recover.sim.model import JobSpec
    from recover.sim.presets import preset

    overrides: dict[str, Any] = {}
    for flag, field, _, scale, _ in _JOB_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            if field in overrides:
                raise ConfigError("give the run length once: --hours or --days")
            overrides[field] = value * scale if scale != 1 else value
    if args.rejoin is not None:
        overrides["rejoin"] = args.rejoin
    spec = preset(args.preset, **overrides) if args.preset else JobSpec(**overrides)
    if args.job_mtbf_hours is not None:
        if args.gpu_mttf_hours is not None:
            raise ConfigError("give the failure rate once: --gpu-mttf-hours or --job-mtbf-hours")
        if not args.job_mtbf_hours > 0:
            raise ConfigError(f"--job-mtbf-hours = {args.job_mtbf_hours} must be > 0")
        spec = spec.replace(gpu_mttf_h=args.job_mtbf_hours * spec.gpus)
    if args.trace is not None:
        spec = spec.replace(failures="trace", trace=read_trace(args.trace, spec.gpus))
    if args.calibrate is not None:
        spec = calibrate(args.calibrate).apply(spec, keep=overrides)
    return spec


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from recover.sim.engine import simulate
    from recover.sim.report import print_report, write_json, write_plots

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGY_NAMES]
    if bad or not strategies:
        raise ConfigError(f"--strategies {args.strategies!r}: allowed {', '.join(STRATEGY_NAMES)}")
    if args.bins < 1:
        raise ConfigError(f"--bins = {args.bins} must be >= 1")
    spec = build_spec(args)
    result = simulate(spec, strategies)
    console = Console()
    print_report(result, console, args.preset, verbose=args.assumptions)
    if args.json is not None:
        console.print(f"Wrote {write_json(result, args.json, args.preset)}", highlight=False)
    if args.out is not None:
        paths = write_plots(result, args.out, args.bins)
        console.print("Wrote " + ", ".join(str(p) for p in paths), highlight=False)
    return 0
