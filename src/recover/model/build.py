"""Building a model of any registered architecture (deterministic initialisation from a seed) and its
size and cost figures.

Contract:
- :func:`construct` is ``model.arch``'s spec building its modules on ``device`` (values not yet
  initialised: a checkpoint is loaded next, or the meta device only counts); :func:`build_model`
  also initialises them from ``seed`` (``model.init_weights``), the same values on every rank.
- :func:`model_stats` counts the parameters of a model built on the meta device (no memory) and
  asks the spec for the embedding share and the FLOPs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from recover.model.spec import ModelConfig, get

__all__ = ["ModelStats", "build_model", "construct", "model_stats"]


def construct(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """The modules of a model of ``cfg`` (architecture ``cfg.arch``) on ``device``, not yet initialised."""
    with torch.device(device):
        return get(cfg.arch).build(cfg)


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Builds the model on ``device`` and initialises it deterministically from ``seed``."""
    model = construct(cfg, device)
    model.init_weights(seed)
    return model


@dataclass(frozen=True)
class ModelStats:
    params: int
    """All parameters (a tied embedding counted once)."""
    non_embedding_params: int
    """Parameters outside the embeddings (the output projection counts when untied)."""
    flops_per_token: int
    """Training FLOPs per token (forward + backward), the spec's count (Llama: 6 N + 12 L d T)."""

    def describe(self) -> str:
        return (f"{self.params / 1e6:.2f}M parameters ({self.non_embedding_params / 1e6:.2f}M non-embedding), "
                f"{self.flops_per_token / 1e6:.1f} MFLOPs per token")


def model_stats(cfg: ModelConfig, seq_len: int) -> ModelStats:
    spec = get(cfg.arch)
    params = sum(p.numel() for p in construct(cfg, "meta").parameters())
    return ModelStats(params=params, non_embedding_params=params - spec.embedding_params(cfg),
                      flops_per_token=spec.flops_per_token(cfg, seq_len, params))
