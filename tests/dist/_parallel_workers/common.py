"""What the parallel tests and their torchrun workers share: the model, the data, the reference.

The reference is one process doing plain data parallelism's arithmetic: every step it runs all M
microbatches with plain PyTorch gradient accumulation, divides by M, clips
and steps AdamW. A replica engine run must reproduce its per-step losses and final parameters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recover.config import ModelConfig, TrainingConfig
from recover.data.sampler import Sampler
from recover.data.shards import TokenDataset, write_shard
from recover.model import build_model, lm_loss
from recover.train.replicas.optim import build_optimizer, lr_at, set_lr

M = 8
SEQ_LEN = 32
MICROBATCH = 2
SEED = 1234


def model_cfg(tied: bool) -> ModelConfig:
    """The ``debug`` model with 4 layers (so pp = 2 gives each stage two blocks)."""
    return ModelConfig(vocab_size=320, dim=64, n_layers=4, n_heads=4, max_seq_len=64, tie_embeddings=tied)


def train_cfg(steps: int, deterministic: bool = False) -> TrainingConfig:
    return TrainingConfig(steps=steps, global_microbatches=M, lr=3e-3, min_lr=3e-4, warmup_steps=1,
                          grad_clip=1.0, seed=SEED, deterministic=deterministic)


def write_corpus(directory: Path) -> Path:
    """A small learnable corpus (noisy arithmetic sequences over 257 byte-like ids)."""
    rng = np.random.default_rng(0)
    n = 40_000
    base = (np.arange(n) * 7 + np.repeat(rng.integers(0, 257, n // 50), 50)) % 257
    noise = rng.random(n) < 0.1
    tokens = np.where(noise, rng.integers(0, 257, n), base).astype(np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    write_shard(directory / "train_000.bin", tokens, fmt="nanogpt")
    return directory


def make_sampler(directory: Path) -> Sampler:
    return Sampler(TokenDataset(Path(directory) / "train_*.bin"), SEQ_LEN, MICROBATCH, M, SEED)


def reference(directory: Path, tied: bool, steps: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(per-step mean losses, per-step grad norms, final parameters) of one process."""
    torch.manual_seed(0)
    tc = train_cfg(steps)
    sampler = make_sampler(directory)
    model = build_model(model_cfg(tied), SEED)
    optimizer = build_optimizer(model, tc)
    losses, norms = [], []
    for step in range(steps):  # plain PyTorch gradient accumulation over all M microbatches
        set_lr(optimizer, lr_at(step, tc))
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in range(M):
            inputs, targets = sampler.microbatch(step, mb)
            loss = lm_loss(model(inputs), targets)
            (loss / M).backward()
            loss_sum += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)))
        optimizer.step()
        losses.append(loss_sum / M)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# Which microbatch ids each of the 2 replicas computes at each step, as a list of compute() calls:
# an even split; a 1 / 7 split (a pipeline quota below pp: the 1F1B -> GPipe fallback; FSDP padding);
# a quota of 0; and a second compute() call in a step (orphans taken over after a failure).
PLANS: list[tuple[list[list[int]], list[list[int]]]] = [
    ([[0, 1, 2, 3]], [[4, 5, 6, 7]]),
    ([[0]], [[1, 2, 3, 4, 5, 6, 7]]),
    ([[]], [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ([[0, 1, 2], [6, 7]], [[3, 4, 5]]),
]
# The same ids of every step split otherwise: other pairs of ids in an FSDP replica's passes (its column
# blocks), other calls, other replicas. A deterministic run must end bitwise where a PLANS run ends.
OTHER_PLANS: list[tuple[list[list[int]], list[list[int]]]] = [
    ([[0, 2, 4, 6]], [[7, 5, 3, 1]]),
    ([[7, 6, 5, 4, 3]], [[0, 1], [2]]),
    ([[3, 1, 4]], [[0, 5, 2, 6, 7]]),
    ([[5]], [[0, 1, 2, 3], [4], [6, 7]]),
]
STEPS = len(PLANS)


def plan(step: int, replica: int, replicas: int, other: bool = False) -> list[list[int]]:
    """The compute() calls of ``replica`` at ``step`` (``other``: in OTHER_PLANS); a lone replica makes both
    replicas' calls."""
    calls = (OTHER_PLANS if other else PLANS)[step]
    return calls[replica] if replicas == 2 else calls[0] + calls[1]
