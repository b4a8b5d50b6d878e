"""The trainer: plain PyTorch training with the step expressed in microbatch ids.

One step, failure-free:
    ids = the ids this replica owns at ``step``       (a static assignment here; layer 3 later)
    for id in ids: forward, backward, fold into the accumulator and the ledger
    reduced = reducer.allreduce(accumulator.payload())  (on copies; layer 1 later)
    check the reduced microbatch count == M, then grad = sum / M, clip, AdamW step

Contract: the samples of microbatch ``id`` at ``step`` are a pure function of (seed, step, id),
the gradient is always divided by the constant M, and the learning rate and data cursor are
functions of the committed step: so any assignment of ids to ranks, and any resume from a
checkpoint, follows the same trajectory up to floating-point summation order (and bitwise in
deterministic mode).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recover.config import Config, DataConfig
from recover.data import EvalSampler, Sampler, TokenDataset
from recover.data.prepare import resolve_data_dir
from recover.errors import ConfigError, RecoverError
from recover.model import build_model, lm_loss, model_stats
from recover.observe.events import JsonlWriter
from recover.observe.progress import ProgressDisplay
from recover.recovery.accumulator import GradAccumulator
from recover.recovery.state import flat_state, load_flat_state
from recover.train import checkpoint as ckpt
from recover.train.dist import DistContext, DistReducer, LocalReducer
from recover.train.optim import build_optimizer, lr_at, set_lr
from recover.workload import static_assignment

if TYPE_CHECKING:
    from recover.parallel import ReplicaEngine


def open_datasets(cfg: DataConfig, data_dir: Path, vocab_size: int) -> tuple[TokenDataset, TokenDataset]:
    train = TokenDataset(str(data_dir / cfg.train_pattern), fmt=cfg.format)
    val = TokenDataset(str(data_dir / cfg.val_pattern), fmt=cfg.format)
    for ds in (train, val):
        ds.check_vocab(vocab_size)
    return train, val


def default_threads(cfg: Config, local_procs: int) -> int:
    if cfg.training.threads:
        return cfg.training.threads
    return max(1, (os.cpu_count() or 1) // max(1, local_procs))


class Trainer:
    """Trains ``cfg`` in this process as data-parallel rank ``ctx.rank`` of ``ctx.world_size``.

    With ``parallel.pp x parallel.fsdp x parallel.tp > 1`` the processes of ``ctx`` are instead the
    ranks of ONE replica (a torchrun job of that many processes): the model is split by
    :class:`~recover.parallel.ReplicaEngine`, which also takes the accumulator's place, every rank
    runs the replica's ids, and checkpoints are sharded DCP saves over the replica's group.
    """

    def __init__(self, cfg: Config, out_dir: str | os.PathLike[str], ctx: DistContext | None = None,
                 resume: bool = False, quiet: bool = False) -> None:
        self.cfg = cfg
        self.ctx = ctx or DistContext()
        self.out = Path(out_dir)
        self.main = self.ctx.is_main
        tc = cfg.training
        sharded = cfg.parallel.procs_per_replica > 1
        self.dp_world = 1 if sharded else self.ctx.world_size
        """Data-parallel processes in this job (1 when the processes are one replica's ranks)."""
        if tc.global_microbatches % self.dp_world:
            raise ConfigError(f"training.global_microbatches = {tc.global_microbatches} is not allowed: "
                              f"must be a multiple of the {self.dp_world} data-parallel processes")
        torch.set_num_threads(default_threads(cfg, self.ctx.local_world_size))
        # Unseen vocabulary rows get ~1e-20 gradients whose squares are subnormal in AdamW's state:
        # on CPUs subnormal arithmetic is ~100x slower, so flush them to zero (no effect on GPUs).
        torch.set_flush_denormal(True)
        data_dir = resolve_data_dir(cfg.data, prepare=self.ctx.local_rank == 0, quiet=quiet or not self.main)
        if self.ctx.world_size > 1:
            torch.distributed.barrier()
        self.train_data, self.val_data = open_datasets(cfg.data, data_dir, cfg.model.vocab_size)
        self.sampler = Sampler(self.train_data, cfg.data.seq_len, cfg.data.microbatch_size,
                               tc.global_microbatches, tc.seed)
        self.eval_sampler = EvalSampler(self.val_data, cfg.data.seq_len, cfg.data.microbatch_size)
        self.engine: ReplicaEngine | None = self._build_engine() if sharded else None
        if self.engine is not None:
            self.model = self.engine.model
            self.acc: GradAccumulator | ReplicaEngine = self.engine
        else:
            self.model = build_model(cfg.model, tc.seed, self.ctx.device)
            self.acc = GradAccumulator(self.model, deterministic=tc.deterministic)
        self.optimizer = build_optimizer(self.model, tc)
        self.reducer = DistReducer() if self.dp_world > 1 else LocalReducer()
        self.stats = model_stats(cfg.model, cfg.data.seq_len)
        self.tokens_per_step = tc.global_microbatches * cfg.data.microbatch_size * cfg.data.seq_len
        self.start_step = 0
        self.total_tokens = 0
        self._pending_save: ckpt.AsyncSave | None = None
        """The asynchronous checkpoint being written (``training.checkpoint_async``), if any."""
        self.last_save_blocking_s = 0.0
        """Seconds the last :meth:`save` blocked training (with an asynchronous save: staging only)."""
        if resume:
            self._resume()

    def _build_engine(self) -> ReplicaEngine:
        """This rank's part of a replica of ``pp x fsdp x tp`` ranks (the processes of ``ctx``)."""
        from recover.parallel import ParallelDims, ReplicaEngine

        p, tc = self.cfg.parallel, self.cfg.training
        dims = ParallelDims.from_config(p)
        dims.check_world(self.ctx.world_size)
        timeout = self.cfg.fault_tolerance.intra_replica_timeout_s
        mesh = dims.build_mesh(self.ctx.device.type, timeout)
        group = dims.build_group(timeout)
        return ReplicaEngine(self.cfg.model, tc.seed, dims, mesh, group, self.ctx.device, tc.deterministic,
                             p.schedule, p.activation_checkpointing, p.sequence_parallel)

    # ---- state -----------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def _resume(self) -> None:
        path = ckpt.latest_checkpoint(self.checkpoint_dir)
        if path is None:
            raise RecoverError(f"--resume: no complete checkpoint under {self.checkpoint_dir}; "
                               "run without --resume to start afresh")
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer, self.cfg.model,
                                    process_group=self.engine.group if self.engine else None)
        self.start_step = int(meta["step"])
        self.total_tokens = int(meta.get("total_tokens", self.start_step * self.tokens_per_step))
        if self.main:
            print(f"resumed from {path} (step {self.start_step})", flush=True)

    def save(self, step: int, blocking: bool | None = None) -> Path:
        """Checkpoint after ``step`` committed steps (every rank holds a full copy: rank 0 writes;
        a replica of several ranks saves its shards together, collectively).

        With ``training.checkpoint_async`` (one writer: not for a replica of several ranks) a periodic
        save returns once the state is copied to CPU memory and DCP writes it in the background; the
        checkpoint becomes loadable only when complete (:func:`~recover.train.checkpoint.save_checkpoint_async`).
        Every save first waits for the previous asynchronous one (and raises its error, if any). A save
        blocks until committed when ``blocking`` is true, or, by default, at the end of training
        (``step >= training.steps``) and when made while an exception is being handled (a stop, such as
        a lost quorum, after which the process exits). :attr:`last_save_blocking_s` is how long the
        call blocked; :meth:`wait_checkpoint` waits for the one in flight.
        """
        t0 = time.perf_counter()
        self.wait_checkpoint()
        meta = {"total_tokens": self.total_tokens, "data_cursor": {"step": step, "epoch": self.sampler.epoch_of(step)},
                "seed": self.cfg.training.seed}
        if self.engine is not None:
            path = ckpt.save_checkpoint(self.checkpoint_dir, step, self.model, self.optimizer, meta, self.cfg.model,
                                        process_group=self.engine.group, is_writer=self.main)
            self.last_save_blocking_s = time.perf_counter() - t0
            return path
        path = ckpt.checkpoint_path(self.checkpoint_dir, step)
        if self.main:
            if blocking is None:
                blocking = step >= self.cfg.training.steps or sys.exc_info()[0] is not None
            if self.cfg.training.checkpoint_async:
                self._pending_save = ckpt.save_checkpoint_async(self.checkpoint_dir, step, self.model,
                                                                self.optimizer, meta, self.cfg.model)
                if blocking:
                    self.wait_checkpoint()
            else:
                path = ckpt.save_checkpoint(self.checkpoint_dir, step, self.model, self.optimizer, meta,
                                            self.cfg.model)
        if self.ctx.world_size > 1:
            torch.distributed.barrier()
        self.last_save_blocking_s = time.perf_counter() - t0
        return path

    def wait_checkpoint(self) -> Path | None:
        """Waits until the asynchronous save in flight (if any) is committed; returns its path.

        Raises:
            CheckpointError: its background write failed (nothing of it was committed).
        """
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def transfer_state(self, counters: dict[str, int]) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer state, plus ``counters``, as flat tensors for a joiner
        (the same rank of a replica built the same way takes them with :meth:`load_transfer_state`)."""
        if self.engine is None:
            return flat_state(self.model, self.optimizer, counters)
        out = self.engine.local_state(self.optimizer)
        out.update({f"counter.{k}": torch.tensor(int(v), dtype=torch.int64) for k, v in sorted(counters.items())})
        return out

    def load_transfer_state(self, state: dict[str, torch.Tensor]) -> dict[str, int]:
        """Inverse of :meth:`transfer_state`; returns the counters."""
        if self.engine is None:
            return load_flat_state(self.model, self.optimizer, state)
        self.engine.load_local_state(self.optimizer, state)
        return {k[len("counter."):]: int(v) for k, v in state.items() if k.startswith("counter.")}

    # ---- one step --------------------------------------------------------------------------
    def my_ids(self, step: int) -> list[int]:
        tc = self.cfg.training
        plan = static_assignment(tc.global_microbatches, self.dp_world, step, tc.assignment, tc.seed)
        return plan[self.ctx.rank if self.dp_world > 1 else 0]

    def compute(self, step: int, ids: list[int], hook: Callable[[int, str], Any] | None = None) -> None:
        """Forward and backward of microbatches ``ids`` of ``step`` into the accumulator.

        ``hook(step, phase)`` runs before each forward and each backward (fault injection points).
        With a replica engine this is collective over the replica's ranks.
        """
        if self.engine is not None:
            self.engine.compute(step, ids, self.sampler, hook)
            return
        for mb in ids:
            inputs, targets = self.sampler.microbatch(step, mb)
            if hook:
                hook(step, "forward")
            loss = lm_loss(self.model(inputs.to(self.ctx.device)), targets.to(self.ctx.device))
            if hook:
                hook(step, "backward")
            self.acc.add(mb, loss)

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        M = self.cfg.training.global_microbatches
        set_lr(self.optimizer, lr_at(step, self.cfg.training))
        self.acc.reset()
        self.compute(step, self.my_ids(step))
        reduced = self.reducer.allreduce(self.acc.payload())
        loss_sum, count = GradAccumulator.totals(reduced)
        if count != M:
            raise RuntimeError(f"step {step}: reduced gradient holds {count} microbatches, expected M = {M}")
        grad_norm = self.acc.apply(reduced, M, self.optimizer, self.cfg.training.grad_clip)
        return self.record(step, loss_sum, count, grad_norm, time.perf_counter() - t0, self.dp_world, 0)

    def record(self, step: int, loss_sum: float, microbatches: int, grad_norm: float, dt: float,
               live_replicas: int, generation: int) -> dict[str, Any]:
        """Counts a committed step's tokens and returns its ``metrics.jsonl`` record."""
        tokens = microbatches * self.sampler.tokens_per_microbatch
        self.total_tokens += tokens
        return {"step": step, "loss": loss_sum / microbatches, "microbatches": microbatches, "tokens": tokens,
                "total_tokens": self.total_tokens, "time_s": round(dt, 6), "lr": lr_at(step, self.cfg.training),
                "grad_norm": grad_norm, "tokens_per_s": tokens / dt, "live_replicas": live_replicas,
                "generation": generation}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``training.eval_batches`` fixed microbatches (same on every rank;
        collective over a replica's ranks)."""
        if self.engine is not None:
            return self.engine.evaluate([self.eval_sampler.batch(i) for i in range(self.cfg.training.eval_batches)])
        self.model.eval()
        losses = []
        for i in range(self.cfg.training.eval_batches):
            inputs, targets = self.eval_sampler.batch(i)
            losses.append(float(lm_loss(self.model(inputs.to(self.ctx.device)), targets.to(self.ctx.device))))
        self.model.train()
        return sum(losses) / len(losses)

    # ---- the loop --------------------------------------------------------------------------
    def run(self, stop_at_step: int | None = None, progress: bool = True) -> dict[str, Any]:
        """Trains from the current step to ``training.steps`` (or ``stop_at_step``); returns the summary."""
        tc = self.cfg.training
        end = min(tc.steps, stop_at_step) if stop_at_step else tc.steps
        metrics = JsonlWriter(self.out / "metrics.jsonl") if self.main else None
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(asdict(self.cfg), indent=1))
        display = ProgressDisplay(tc.steps, self.start_step, title=self.cfg.name, enabled=progress and self.main)
        display.message(f"[bold]{self.cfg.name}[/]: {self.stats.describe()}; {self.dp_world} data-parallel "
                        f"process(es) of {self.cfg.parallel.procs_per_replica} rank(s), M = {tc.global_microbatches} "
                        f"microbatches x {self.cfg.data.microbatch_size} x {self.cfg.data.seq_len} tokens per step; "
                        f"{self.train_data.num_tokens:,} training tokens")
        t_start = time.perf_counter()
        val_loss = None
        try:
            for step in range(self.start_step, end):
                record = self.train_step(step)
                record["elapsed_s"] = round(time.perf_counter() - t_start, 3)
                if tc.eval_due(step, end):
                    val_loss = record["val_loss"] = self.evaluate()
                if metrics is not None:
                    metrics.write(record)
                display.update(record)
                if tc.checkpoint_due(step, end):
                    self.save(step + 1)
        finally:
            display.close()
            if metrics is not None:
                metrics.close()
        self.wait_checkpoint()  # an asynchronous save still writing is part of the run
        wall = time.perf_counter() - t_start
        done = max(0, end - self.start_step)
        summary = {"name": self.cfg.name, "steps": end, "steps_run": done, "wall_s": round(wall, 3),
                   "final_val_loss": val_loss, "total_tokens": self.total_tokens,
                   "tokens_per_s": done * self.tokens_per_step / wall if wall > 0 else 0.0,
                   "params": self.stats.params, "world_size": self.ctx.world_size}
        if self.main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            try:
                from recover.observe.plots import plot_loss

                plot_loss(self.out)
            except Exception as exc:  # a plot must never fail a run
                print(f"warning: loss plot not written: {exc}", flush=True)
        return summary
