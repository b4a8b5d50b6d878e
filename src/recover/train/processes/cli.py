"""``recover train``: one process, or one rank under torchrun (failure-free data parallelism).

Contract: the config is resolved once, before any process group exists (:func:`train_config`):
``parallel.replicas`` becomes what this job runs (:func:`torchrun_replicas`: one replica per
torchrun process when a replica is one process, else ONE replica whose ranks are the processes; a
``--parallel.replicas`` that says otherwise is refused, never ignored), and ``model.vocab_size`` the
data's unless given (:func:`recover.data.layout.resolve_vocab`).
"""

from __future__ import annotations

import argparse
import os
import sys

from recover.config import Config, ParallelConfig, available_presets, load_config
from recover.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a preset in this process (or as one rank under torchrun)",
        description="Train a model. Any config field can be overridden: --section.field VALUE "
                    "(e.g. --training.steps 50 --model.dim 64). Under torchrun every rank runs this "
                    "command and the ranks split each step's microbatches (data parallel).",
    )
    presets = ", ".join(available_presets())
    p.add_argument("--config", default="tiny", help=f"preset name or .toml path (presets: {presets})")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, summary.json, loss.png, checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds another run (deletes its records and checkpoints)")
    p.add_argument("--stop-at-step", type=int, default=None, help="stop after this many committed steps "
                   "(the schedule still spans training.steps)")
    p.add_argument("--init-from", default=None, metavar="PATH", help=INIT_FROM_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.set_defaults(func=run_train, accepts_overrides=True)


INIT_FROM_HELP = ("start from these weights (step 0, fresh optimizer): a recover run or checkpoint directory, a "
                  "Hugging Face Llama directory or a model.pt from `recover export --format torch` "
                  "(training.init_from)")


def init_from_override(path: str | None) -> list[str]:
    """``--init-from PATH`` as the config override every process gets (an absolute path)."""
    from pathlib import Path

    return [f"--training.init_from={Path(path).resolve()}"] if path else []


def torchrun_replicas(parallel: ParallelConfig, world_size: int, explicit: bool) -> int:
    """The data-parallel replicas ``recover train`` runs with ``world_size`` processes (1 without
    torchrun): one per process when ``pp x tp x fsdp = 1``, else one replica of all of them.

    Raises:
        ConfigError: ``explicit`` (``--parallel.replicas`` was given) and it says another number; the
            message says what to pass instead.
    """
    P = parallel.procs_per_replica
    n = world_size if P == 1 else 1
    if not explicit or parallel.replicas == n:
        return n
    r = parallel.replicas
    if P > 1:
        raise ConfigError(f"--parallel.replicas {r} is not allowed with pp x tp x fsdp = {P}: under torchrun "
                          f"`recover train` runs one replica whose ranks are the {world_size} processes; for {r} "
                          f"replicas of {P} ranks use `recover launch --replicas {r}` (or one `torchrun ... recover "
                          "worker` per replica)")
    if world_size == 1:
        raise ConfigError(f"--parallel.replicas {r} is not allowed in one process: `recover train` runs one "
                          f"data-parallel replica per process; start {r} with `torchrun --nproc-per-node {r} -m "
                          f"recover train ...`, or use `recover launch --replicas {r}` for fault-tolerant replicas")
    raise ConfigError(f"--parallel.replicas {r} does not match torchrun's {world_size} processes: `recover train` runs "
                      f"one data-parallel replica per process; pass --nproc-per-node {r} to torchrun (or the nodes x "
                      "processes that make it), or leave --parallel.replicas out")


def world_size() -> int:
    """torchrun's WORLD_SIZE (with RANK, as :func:`~recover.train.replicas.dist.init_from_env` reads it), else 1."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1


def train_config(config: str, overrides: list[str], world_size: int) -> Config:
    """The config ``recover train`` runs: the preset with ``overrides``, its replicas and vocabulary
    resolved (see the module docstring).

    Raises:
        ConfigError, DataError: a bad config, a refused ``--parallel.replicas``, a data directory without
            shards, or a model vocabulary smaller than the data's.
    """
    from recover.data.layout import given, resolve_data_dir, resolve_vocab

    cfg = load_config(config, overrides)
    replicas = torchrun_replicas(cfg.parallel, world_size, given(overrides, "parallel.replicas"))
    if replicas != cfg.parallel.replicas:
        cfg = cfg.replace({"parallel.replicas": replicas})
    return resolve_vocab(cfg, resolve_data_dir(cfg.data), given(overrides, "model.vocab_size"))


def run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from recover.coord.client import Diverged
    from recover.observe.rundir import check_out, clear_run
    from recover.observe.sinks import check_extras
    from recover.train.processes.exits import EXIT_NONFINITE, EXIT_STOPPED, EXIT_UNSAVED
    from recover.train.processes.trainer import train
    from recover.train.replicas.dist import init_from_env, shutdown

    cfg = train_config(args.config, [*args.overrides, *init_from_override(args.init_from)], world_size())
    check_out(Path(args.out), args.resume, args.overwrite)
    check_extras(cfg.observe)
    if cfg.training.init_from:  # refused before anything starts, with one line
        from recover.train.checkpoints.weights import check_init_from

        check_init_from(cfg.training.init_from, cfg.model)
    if cfg.training.deterministic:  # before CUDA initialises (init_from_env picks this rank's GPU)
        from recover.train.processes.loop import use_deterministic_kernels

        use_deterministic_kernels()
    ctx = init_from_env(cfg.parallel.backend)
    if args.overwrite and ctx.is_main:
        clear_run(Path(args.out))  # the other ranks read nothing of it before the data barrier
    try:
        summary = train(cfg, args.out, ctx, resume=args.resume, stop_at_step=args.stop_at_step,
                        progress=not args.no_progress)
    except Diverged as exc:
        print(f"recover: {exc}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    finally:
        shutdown()
    if ctx.is_main:
        val = summary["final_val_loss"]
        val_text = f"{val:.4f}" if val is not None else "n/a"
        print(f"done: {summary['steps_run']} steps in {summary['wall_s']:.1f} s, "
              f"{summary['tokens_per_s']:,.0f} tokens/s, final validation loss {val_text}", flush=True)
        print(f"run directory: {args.out} (metrics.jsonl, summary.json, loss.png)", flush=True)
        if summary["stopped"] and not summary["unsaved"]:
            print(f"stopped on request after {summary['steps_run']} steps of this run; a complete checkpoint is "
                  f"in {args.out}/checkpoints; continue with the same command and --resume", flush=True)
    if summary["unsaved"]:
        return EXIT_UNSAVED
    return EXIT_STOPPED if summary["stopped"] else 0
