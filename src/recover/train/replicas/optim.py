"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine schedule.

Contract: the learning rate is a pure function of the committed step (``lr_at``), so it advances
only when a step commits and a resumed or recovered run sees exactly the same schedule.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recover.config import TrainingConfig


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on parameters with >= 2 dims (not on norms); the fused CUDA kernel when every
    parameter is on a GPU (every replica uses the same update, so replicas stay identical)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_gpu = all(p.is_cuda for p in decay + no_decay)  # the fused kernel: one launch for every parameter
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             **({"fused": True} if on_gpu else {}))


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate for the optimizer update of ``step`` (0-based): linear warm-up, then cosine."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
