"""``recover train``: one process, or one rank under torchrun (failure-free data parallelism)."""

from __future__ import annotations

import argparse
import sys

from recover.config import available_presets, load_config


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


def run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from recover.coord.client import Diverged
    from recover.observe.rundir import check_out, clear_run
    from recover.train.dist import init_from_env, shutdown
    from recover.train.exits import EXIT_NONFINITE, EXIT_STOPPED
    from recover.train.trainer import train

    cfg = load_config(args.config, [*args.overrides, *init_from_override(args.init_from)])
    check_out(Path(args.out), args.resume, args.overwrite)
    if cfg.training.init_from:  # refused before anything starts, with one line
        from recover.train.weights import check_init_from

        check_init_from(cfg.training.init_from, cfg.model)
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
        if summary["stopped"]:
            print(f"stopped on request after {summary['steps_run']} steps of this run; a complete checkpoint is "
                  f"in {args.out}/checkpoints; continue with the same command and --resume", flush=True)
    return EXIT_STOPPED if summary["stopped"] else 0
