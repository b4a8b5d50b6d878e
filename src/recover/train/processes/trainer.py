"""``recover train``: the step protocol without a coordinator, in one process or under torchrun.

The same step as a replica of ``recover launch`` (:class:`~recover.recovery.protocol.ResilientStep`
over a :class:`~recover.train.replicas.replica.Replica`), on a :class:`~recover.train.replicas.dist.StaticGroup` of
the torchrun ranks and a coordinator that commits every step: no fault tolerance, the failure-free
path that recover's runs are compared with.

Contract: the samples of microbatch ``id`` at ``step`` are a pure function of (seed, step, id), the
gradient is always divided by the constant M, and the learning rate and data cursor are functions
of the committed step: so any assignment of ids to ranks, and any resume from a checkpoint, follows
the same trajectory up to floating-point summation order (and bitwise in deterministic mode).
With ``parallel.pp x fsdp x tp > 1`` the torchrun processes are the ranks of ONE replica.

SIGTERM or SIGINT (torchrun passes its own on; Slurm signals every process) is a graceful stop: the
ranks agree on it at the next vote, finish that step, save a complete checkpoint and return with
``summary["stopped"]``; ``--resume`` continues bitwise where it stopped (deterministic mode). A
checkpoint the run ends with that the storage refuses leaves its line in ``summary["unsaved"]``
(``recover train`` then exits with ``EXIT_UNSAVED``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from recover.config import Config, write_run_config
from recover.coord.client import Diverged
from recover.data.layout import resolve_data_dir
from recover.data.prepare import prepared_data_dir
from recover.data.sampler import EvalSampler, Sampler, open_samplers
from recover.model import model_stats
from recover.observe.events import JsonlWriter, keep_records_before
from recover.observe.progress import ProgressDisplay
from recover.observe.sinks import StepSinks
from recover.recovery.protocol import Progress
from recover.train.checkpoints.checkpoint import Checkpointer
from recover.train.checkpoints.integrity import remove_leftovers
from recover.train.processes.loop import Loop, configure_torch
from recover.train.processes.process import build_step
from recover.train.replicas.dist import CommitAll, DistContext, StaticGroup
from recover.train.replicas.replica import Replica


def prepare_data(cfg: Config, ctx: DistContext, quiet: bool = False) -> Path:
    """The shard directory, a built-in corpus prepared first by each host's local rank 0 (the other
    ranks wait for it)."""
    data_dir = (prepared_data_dir(cfg.data, quiet=quiet or not ctx.is_main) if ctx.local_rank == 0
                else resolve_data_dir(cfg.data))
    if ctx.world_size > 1:
        torch.distributed.barrier()
    return data_dir


def build_replica(cfg: Config, ctx: DistContext, data_dir: Path) -> tuple[Replica, EvalSampler]:
    """This rank's replica on the prepared data, and the validation batches. With compiled blocks or on a
    GPU it is warmed up (:meth:`Replica.warm_up`): a joiner compiles before it registers."""
    configure_torch(cfg, ctx.local_world_size)
    sampler, eval_data = open_samplers(cfg.data, data_dir, cfg.model.vocab_size,
                                       cfg.training.global_microbatches, cfg.training.seed)
    replica = Replica.from_config(cfg, sampler, ctx)
    if cfg.training.compile or ctx.device.type == "cuda":
        replica.warm_up()
    return replica, eval_data


def data_parallel_group(cfg: Config, ctx: DistContext) -> StaticGroup:
    """The torchrun ranks as data-parallel replicas; just this replica when they are its ranks."""
    if cfg.parallel.procs_per_replica > 1:
        return StaticGroup()
    return StaticGroup(ctx.world_size, ctx.rank)


def train(cfg: Config, out: str | os.PathLike[str], ctx: DistContext | None = None, resume: bool = False,
          stop_at_step: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Trains ``cfg`` from scratch (or the newest checkpoint in ``out``); returns the run's summary.

    Writes ``metrics.jsonl``, ``config.json``, ``summary.json`` (with the goodput), ``loss.png`` and ``checkpoints/``
    under ``out`` (rank 0), and ``tensorboard/train/`` or a W&B run as ``observe`` asks.
    """
    ctx, out = ctx or DistContext(), Path(out)
    tc = cfg.training
    replica, eval_data = build_replica(cfg, ctx, prepare_data(cfg, ctx, quiet=not progress))
    sampler: Sampler = replica.data  # type: ignore[assignment]
    checkpointer = Checkpointer(out / "checkpoints", replica, cfg, sampler.epoch_of)
    if ctx.is_main:  # no save is in flight yet: what interrupted saves left goes
        remove_leftovers(out / "checkpoints")
    start = Progress()
    if resume:
        path, counters = checkpointer.resume()
        start = Progress.of(counters)
        if ctx.is_main:
            print(f"resumed from {path} (step {start.step})", flush=True)
    first = start.step
    group = data_parallel_group(cfg, ctx)
    commit = CommitAll()
    step = build_step(replica, group, commit, tc.global_microbatches, start, cfg, launched=False)
    end = min(tc.steps, stop_at_step) if stop_at_step else tc.steps
    stats = model_stats(cfg.model, cfg.data.seq_len)
    writer = ctx.is_main and replica.is_writer
    if writer:
        keep_records_before(out / "metrics.jsonl", first)  # a resume redoes the steps after its checkpoint
    metrics = JsonlWriter(out / "metrics.jsonl") if writer else None
    sinks = StepSinks.open(cfg, out, "train") if writer else None  # TensorBoard, W&B (observe.*)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(cfg, out)
    display = ProgressDisplay(tc.steps, first, title=cfg.name, enabled=progress and writer)
    display.message(f"[bold]{cfg.name}[/]: {stats.describe()}; {len(group.members)} data-parallel process(es) of "
                    f"{cfg.parallel.procs_per_replica} rank(s), M = {tc.global_microbatches} microbatches x "
                    f"{cfg.data.microbatch_size} x {cfg.data.seq_len} tokens per step; "
                    f"{sampler.num_tokens:,} training tokens")
    t_start = time.perf_counter()

    def write(record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(time.perf_counter() - t_start, 3)
        if metrics is not None:
            metrics.write(record)
        if sinks is not None:
            sinks.step(record)
        display.update(record)

    loop = Loop(cfg, step, replica, eval_data, checkpointer, write)
    restore = _stop_on_signals(commit, display)
    try:
        loop.run(end)
    except Diverged as exc:  # a microbatch was not finite: save the last committed state, then stop
        path = loop.save_last()
        saved = f"is saved at {path}" if path else "could not be saved"
        raise Diverged(exc.code, f"{exc}; the last committed state (step {step.progress.step}) {saved}") from None
    finally:
        restore()
        display.close()
        checkpointer.close()
        if metrics is not None:
            metrics.close()
        if sinks is not None:
            sinks.close()
    loop.settle()  # an asynchronous save still writing is part of the run
    wall = time.perf_counter() - t_start
    done = step.progress.step - first
    tokens_per_step = tc.global_microbatches * replica.tokens_per_microbatch
    summary = {"name": cfg.name, "steps": end, "steps_run": done, "wall_s": round(wall, 3),
               "final_val_loss": loop.val_loss, "total_tokens": step.progress.tokens,
               "tokens_per_s": done * tokens_per_step / wall if wall > 0 else 0.0,
               "params": stats.params, "world_size": ctx.world_size, "stopped": loop.stopped,
               "unsaved": loop.unsaved}
    if writer:
        from recover.observe.goodput import goodput
        from recover.observe.plots import load_metrics

        summary["goodput"] = goodput(load_metrics(out), []).to_dict()  # no launch events: first step to last
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        try:
            if cfg.observe.plots:
                from recover.observe.plots import plot_loss

                plot_loss(out)
        except Exception as exc:  # a plot must never fail a run
            print(f"warning: loss plot not written: {exc}", flush=True)
    return summary


def _stop_on_signals(commit: CommitAll, display: ProgressDisplay) -> Any:
    """SIGTERM and SIGINT ask for a graceful stop (see the module docstring); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: Any) -> None:
        if commit.stop_requested:
            raise KeyboardInterrupt(f"signal {signum}")  # the second one: at once
        commit.stop_requested = True
        display.message(f"signal {signum}: stopping after this step, with a checkpoint (again to stop at once)")

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(sig, handler) for sig, handler in before.items()]
