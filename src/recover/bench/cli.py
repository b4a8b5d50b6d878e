"""``recover bench``: one parser with a sub-command per benchmark (``bench collectives``, ...).

Contract: each benchmark module listed in :data:`BENCH_MODULES` exposes ``add_parser(bench_subparsers)``
adding its own sub-command and setting ``func``; ``collectives`` is defined here.
Nothing heavy is imported until a benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from recover.errors import ConfigError

# Modules that add `recover bench NAME` sub-commands.
BENCH_MODULES: tuple[str, ...] = ("recover.bench.coordinator", "recover.bench.data", "recover.bench.failures",
                                  "recover.bench.gpu",
                                  "recover.bench.overhead", "recover.bench.paper", "recover.bench.stragglers")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and print its table",
                              description="Benchmarks whose numbers go to docs/BENCHMARKS.md.")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    _register_collectives(sub)
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(sub)


def _register_collectives(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("collectives", help="layer 1: kill latency and all-reduce overhead",
                       description="SIGKILLs replicas during all-reduces and times detection and recovery; "
                                   "times the fault-tolerant all-reduce against a plain one.")
    c.add_argument("--kills", type=int, default=20, help="replicas to kill, one at a time (default 20)")
    c.add_argument("--replicas", type=int, default=4, help="replica processes (default 4)")
    c.add_argument("--floats", type=int, default=10_000_000, help="all-reduce size for the overhead (default 10M)")
    c.add_argument("--kill-floats", type=int, default=1_000_000,
                   help="all-reduce size looped while killing (default 1M)")
    c.add_argument("--iters", type=int, default=10, help="timed all-reduces of each kind (default 10)")
    c.add_argument("--bucket-mb", type=float, default=16.0, help="FT all-reduce bucket size in MiB (default 16)")
    c.add_argument("--seed", type=int, default=0, help="seed for the kill schedule")
    c.add_argument("--deathwatch", choices=("on", "off"), default="on",
                   help="on (default): a killed worker's death is seen by the driver at once and told to the "
                        "coordinator, as recover launch does; off: only its closed connection tells")
    c.add_argument("--json", default=None, help="also write the results to this JSON file")
    c.set_defaults(func=run_collectives)


def run_collectives(args: argparse.Namespace) -> int:
    from recover.bench import collectives

    if args.replicas < 2:
        raise ConfigError(f"--replicas must be >= 2 to kill one, got {args.replicas}")
    if args.kills < 0:
        raise ConfigError(f"--kills must be >= 0, got {args.kills}")
    for name in ("floats", "kill_floats", "iters"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    res = collectives.run(kills=args.kills, replicas=args.replicas, floats=args.floats, kill_floats=args.kill_floats,
                          iters=args.iters, bucket_mb=args.bucket_mb, seed=args.seed,
                          log=lambda msg: print(msg, file=sys.stderr, flush=True),
                          deathwatch=args.deathwatch == "on")
    collectives.print_table(res)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0
