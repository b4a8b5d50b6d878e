"""Building the model (deterministic initialisation from a seed) and its size and cost figures."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recover.config import ModelConfig
from recover.model.llama import Transformer

__all__ = ["ModelStats", "build_model", "model_stats"]


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Builds the model on ``device`` and initialises it deterministically from ``seed``."""
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(seed)
    return model


@dataclass(frozen=True)
class ModelStats:
    params: int
    """All parameters (a tied embedding counted once)."""
    non_embedding_params: int
    """Parameters outside the token embedding (the output projection counts when untied)."""
    flops_per_token: int
    """Training FLOPs per token (forward + backward): 6 N + 12 L d T (attention)."""

    def describe(self) -> str:
        return (f"{self.params / 1e6:.2f}M parameters ({self.non_embedding_params / 1e6:.2f}M non-embedding), "
                f"{self.flops_per_token / 1e6:.1f} MFLOPs per token")


def model_stats(cfg: ModelConfig, seq_len: int) -> ModelStats:
    with torch.device("meta"):
        model = Transformer(cfg)
    params = sum(p.numel() for p in model.parameters())
    embedding = cfg.vocab_size * cfg.dim
    non_embedding = params - embedding
    flops = 6 * non_embedding + 12 * cfg.n_layers * cfg.dim * seq_len
    if cfg.tie_embeddings:
        flops += 6 * embedding  # the tied output projection is a real matmul per token
    return ModelStats(params=params, non_embedding_params=non_embedding, flops_per_token=flops)
