"""``recover launch``, ``recover compare`` and the hidden ``recover worker`` (one replica process)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recover.config import Config, load_config
from recover.errors import ConfigError, RecoverError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run a multi-replica job on this machine, with real failures",
        description="Start a coordinator and N replica processes and train with in-step recovery. "
                    "Failures are real SIGKILLs: --fail R@STEP:PHASE (phases: forward, backward, reduce, commit, "
                    "optimizer, idle; steps are 0-based) or --random-failures MTBF_S. Config overrides: "
                    "--section.field VALUE.",
    )
    p.add_argument("--config", default="tiny", help="preset name or .toml path")
    p.add_argument("--replicas", type=int, default=None, help="replicas (default: parallel.replicas of the config)")
    p.add_argument("--steps", type=int, default=None, help="committed steps (default: training.steps)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--fail", action="append", default=[], metavar="R@STEP:PHASE",
                   help="kill replica R at STEP (0-based) and PHASE; repeatable")
    p.add_argument("--fail-rank", type=int, default=None, metavar="K",
                   help="which rank of a replica --fail kills (default: its last rank); the replica's other "
                        "ranks go down with it")
    p.add_argument("--procs-per-replica", type=int, default=None, metavar="P",
                   help="processes per replica, P = pp x tp x fsdp (default: that product)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages inside a replica (parallel.pp)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree inside a replica (parallel.tp)")
    p.add_argument("--fsdp", type=int, default=None, help="FSDP2 shard degree inside a replica (parallel.fsdp)")
    p.add_argument("--random-failures", type=float, default=None, metavar="MTBF_S",
                   help="also SIGKILL a random live replica at exponential intervals with this mean (seconds)")
    p.add_argument("--rejoin-after", type=float, default=None, metavar="SECONDS",
                   help="restart a killed replica after this delay; it joins back at the next step boundary")
    p.add_argument("--rejoin-replicas", default=None, metavar="R[,R...]",
                   help="with --rejoin-after: only these replicas rejoin (default: every killed one)")
    p.add_argument("--baseline", choices=("shrink", "restart"), default=None,
                   help="run a baseline instead of recover on the same model, data and failures: shrink "
                        "(shrink-and-drop, torchft's semantics) or restart (checkpoint-and-restart)")
    p.add_argument("--deterministic", action="store_true",
                   help="float64 accumulation: every committed step bitwise equal to the failure-free run's")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-failures")
    p.add_argument("--reference", default=None, help="a failure-free run directory to draw under loss.png")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.set_defaults(func=run_launch, accepts_overrides=True)

    c = sub.add_parser("compare", help="per-step loss difference of a run against a reference run",
                       description="Print the largest per-step relative loss difference of RUN against REF and "
                                   "both final validation losses; exit 1 when it exceeds --tol.")
    c.add_argument("ref")
    c.add_argument("run")
    c.add_argument("--tol", type=float, default=1e-5, help="allowed relative difference (default 1e-5)")
    c.add_argument("--json", default=None, help="also write the comparison to this file")
    c.set_defaults(func=run_compare)

    w = sub.add_parser("worker", help="(internal) one replica process of `recover launch`")
    sub._choices_actions.pop()  # internal: keep it out of `recover --help`
    w.add_argument("--config", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--replica", type=int, default=None)
    w.add_argument("--spare", action="store_true",
                   help="start up, then wait on stdin for one JSON line {replica, fail} and join as that replica")
    w.add_argument("--coordinator", required=True, help="HOST:PORT")
    w.add_argument("--token-file", required=True)
    w.add_argument("--procs", type=int, default=1, help="replica processes sharing this machine (threads)")
    w.add_argument("--fail", action="append", default=[])
    w.add_argument("--join", action="store_true")
    w.add_argument("--baseline", choices=("shrink", "restart"), default=None)
    w.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint in --out")
    w.set_defaults(func=run_worker, accepts_overrides=True)


def launch_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """The job's config and the overrides every worker gets (flags folded into dotted overrides)."""
    overrides = list(args.overrides)
    if args.replicas is not None:
        if args.replicas < 1:
            raise ConfigError(f"--replicas {args.replicas} is not allowed: at least 1")
        overrides += [f"--parallel.replicas={args.replicas}"]
    if args.steps is not None:
        overrides += [f"--training.steps={args.steps}"]
    for axis in ("pp", "tp", "fsdp"):
        if getattr(args, axis, None) is not None:
            overrides += [f"--parallel.{axis}={getattr(args, axis)}"]
    if args.deterministic:
        overrides += ["--training.deterministic=true"]
    return load_config(args.config, overrides), overrides


def run_launch(args: argparse.Namespace) -> int:
    from recover.data.prepare import resolve_data_dir
    from recover.faults import FailureSchedule, parse_failure
    from recover.launch.launcher import Launcher, LaunchOptions
    from recover.launch.report import plot_run, summarize
    from recover.observe.events import EventLog

    cfg, overrides = launch_config(args)
    ft, P = cfg.fault_tolerance, cfg.parallel.procs_per_replica
    if args.procs_per_replica is not None and args.procs_per_replica != P:
        p = cfg.parallel
        raise ConfigError(f"--procs-per-replica {args.procs_per_replica} does not match pp x tp x fsdp = {p.pp} x "
                          f"{p.tp} x {p.fsdp} = {P}; give the degrees with --pp/--tp/--fsdp so their product is P")
    if args.fail_rank is not None and not 0 <= args.fail_rank < P:
        raise ConfigError(f"--fail-rank {args.fail_rank} is not allowed: a replica has ranks 0..{P - 1}")
    schedule = FailureSchedule([parse_failure(f, args.fail_rank) for f in args.fail])
    schedule.validate(cfg.parallel.replicas, cfg.training.steps, ft.min_replicas,
                      rejoin=args.rejoin_after is not None, ranks=P)
    if args.random_failures is not None and args.random_failures <= 0:
        raise ConfigError(f"--random-failures {args.random_failures} is not allowed: a positive MTBF in seconds")
    if args.rejoin_after is not None and args.rejoin_after < 0:
        raise ConfigError(f"--rejoin-after {args.rejoin_after} is not allowed: seconds >= 0")
    rejoin_replicas = None
    if args.rejoin_replicas:
        try:
            rejoin_replicas = frozenset(int(r) for r in args.rejoin_replicas.split(","))
        except ValueError:
            raise ConfigError(f"--rejoin-replicas {args.rejoin_replicas!r}: expected replica ids like 1,3") from None
    if args.baseline == "restart" and cfg.training.checkpoint_every == 0:
        raise ConfigError("--baseline restart needs periodic checkpoints: set --training.checkpoint_every K "
                          "(`recover bench failures` picks K by Young/Daly)")
    if args.baseline and args.rejoin_after is not None:
        raise ConfigError("--rejoin-after applies to recover; the baselines run on the survivors")
    if args.baseline and P > 1:
        raise ConfigError(f"--baseline {args.baseline} runs one process per replica; drop --pp/--tp/--fsdp "
                          f"(this replica has {P} ranks)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    resolve_data_dir(cfg.data, quiet=args.no_progress)
    opts = LaunchOptions(config=cfg, config_arg=args.config, overrides=overrides, out=out, failures=schedule,
                         random_mtbf_s=args.random_failures, rejoin_after_s=args.rejoin_after,
                         rejoin_replicas=rejoin_replicas, seed=args.seed, baseline=args.baseline,
                         progress=not args.no_progress,
                         title=f"{cfg.name} x{cfg.parallel.replicas}" + (f" (x{P} ranks)" if P > 1 else ""))
    launcher = Launcher(opts)
    code = launcher.run()
    summary = summarize(out, cfg.name, launcher.wall_s)
    with EventLog(out / "events.jsonl") as events:  # kill -> all survivors computing again, per kill
        for rec in summary["recoveries"]:
            events.event("recovery", **rec)
    try:
        plot_run(out, Path(args.reference) if args.reference else None)
    except Exception as exc:  # a plot never fails a run
        print(f"warning: plots not written: {exc}", file=sys.stderr)
    for text in launcher.failed_logs():
        print(text, file=sys.stderr)
    lat = summary["recovery_latency_ms_median"]
    print(f"{summary['committed_steps']} steps committed in {summary['wall_s']:.1f} s; microbatches per step "
          f"{summary['min_microbatches']}..{summary['max_microbatches']}; kills {summary['kills']}, rejoins "
          f"{summary['rejoins']}; median recovery {lat if lat is not None else '-'} ms; "
          f"final val loss {summary['final_val_loss']}; outputs in {out}", flush=True)
    if code == 3:
        print("recover: the job stopped because too few replicas survived; a complete checkpoint was saved "
              f"under {out / 'checkpoints'}", file=sys.stderr)
    return code


def run_compare(args: argparse.Namespace) -> int:
    from recover.launch.report import compare

    res = compare(Path(args.ref), Path(args.run))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ok = res["max_rel_loss_diff"] <= args.tol and res["steps_compared"] == res["steps_ref"]
    print(f"steps compared: {res['steps_compared']} (reference {res['steps_ref']}, run {res['steps_run']})")
    print(f"max relative loss difference: {res['max_rel_loss_diff']:.3e} at step {res['worst_step']} "
          f"(tolerance {args.tol:.1e}){'; bitwise equal' if res['bitwise_equal'] else ''}")
    print(f"final validation loss: reference {res['final_val_loss_ref']}, run {res['final_val_loss_run']}")
    print(f"min microbatches per step in run: {res['min_microbatches_run']}")
    print("OK" if ok else "DIFFERENT: above tolerance or steps missing")
    return 0 if ok else 1


def run_worker(args: argparse.Namespace) -> int:
    from recover.faults import parse_failure
    from recover.train.worker import ReplicaWorker, build_trainer

    cfg = load_config(args.config, args.overrides)
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise RecoverError(f"--coordinator {args.coordinator!r}: expected HOST:PORT")
    token = Path(args.token_file).read_text().strip()
    replica, fails, join, trainer = args.replica, args.fail, args.join, None
    if args.spare:  # a hot spare: pay the start-up cost now, learn who to be when a replica dies
        trainer = build_trainer(cfg, Path(args.out), args.procs, args.resume)
        line = sys.stdin.readline()
        if not line.strip():
            os._exit(0)  # the launcher closed our stdin: not needed
        order = json.loads(line)
        replica, fails, join = int(order["replica"]), list(order.get("fail", [])), True
    if replica is None:
        raise RecoverError("recover worker needs --replica R (or --spare)")
    specs = []
    for text in fails:  # R@STEP:PHASE, with #RANK when the launcher was given --fail-rank
        spec, _, rank = text.partition("#")
        specs.append(parse_failure(spec, int(rank) if rank else None))
    worker = ReplicaWorker(cfg, args.out, replica, host, int(port), token,
                           failures=specs, join=join, procs=args.procs, trainer=trainer,
                           baseline=args.baseline, resume=args.resume)
    code = worker.run()
    # Skip interpreter teardown: a retired gloo group still held by the graveyard's daemon thread
    # would be destroyed mid-shutdown (std::terminate, SIGABRT). Everything is written and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
