"""A Llama-style decoder-only transformer, readable top to bottom.

RMSNorm -> attention with rotary embeddings (grouped-query, ``scaled_dot_product_attention``) ->
RMSNorm -> SwiGLU MLP, repeated ``n_layers`` times, then a final RMSNorm and the output projection
(optionally tied to the token embedding).

Contract:
- ``Transformer(cfg)`` builds the modules; :meth:`Transformer.init_weights` fills every parameter
  from ``seed`` and the parameter's *name* alone, so a model built on any device, split into
  pipeline stages or sharded, gets the same values as the whole model.
- The blocks live in a ``ModuleDict`` keyed ``"0".."L-1"`` and any of ``tok_embeddings``, ``norm``,
  ``output`` may be ``None``: a pipeline stage is the same class with the other parts removed, and
  its ``forward`` passes hidden states through.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recover.model.common import param_seed
from recover.model.spec import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


def rotary_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Complex rotations ``(T, head_dim/2)`` for positions ``0..max_seq_len-1``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` of shape (B, T, H, D) by ``rot`` of shape (T, D/2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D/2)
    xc = xc * rot[None, :, None, :]
    return torch.view_as_real(xc).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard (fewer local heads) works as is.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, Hq, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        # grouped-query attention: each kv head serves Hq / Hkv query heads inside the kernel (no copies of
        # K and V, and no repeat_interleave, whose backward is not deterministic on CUDA)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rot)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        head_dim = cfg.dim // cfg.n_heads
        self.register_buffer("rot", rotary_table(head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps hidden states (B, T, C) onward."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, C)
        rot = self.rot[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rot)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h).float() if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: each parameter drawn from its own generator seeded by (seed, name)."""
        depth_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = depth_std if name.endswith(("wo.weight", "w2.weight")) else self.cfg.init_std
            if name == "output.weight" and self.cfg.tie_embeddings:
                name = "tok_embeddings.weight"  # a last pipeline stage holds the tied matrix alone
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(param.dtype))
        self.rot.copy_(rotary_table(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta))

