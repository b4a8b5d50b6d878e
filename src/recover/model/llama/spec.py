"""The built-in architecture's entry in the model registry: Llama as a :class:`~recover.model.spec.ModelSpec`.

Contract:
- :data:`SPEC` is what ``model.arch = "llama"`` selects (:func:`recover.model.spec.get` imports this
  module on first use). Its blocks are ``layers``; the first pipeline stage alone keeps
  ``tok_embeddings``, the last alone ``norm`` and ``output``; its TP plan is
  :func:`recover.model.llama.tp.tp_plan`; its Hugging Face mapping :mod:`recover.model.llama.hf`.
- :func:`validate` holds Llama's layout rules (rotary head size, what ``tp`` must divide); the rules
  of every architecture are :func:`recover.config.check_layout`'s.
- Importing this module imports no torch (a config is validated before anything starts): the model
  and the TP plan are imported when first built or applied.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from recover.errors import ConfigError
from recover.model.llama import hf
from recover.model.spec import HFMapping, ModelConfig, ModelSpec, TPPlan

if TYPE_CHECKING:
    from torch import nn


def build(cfg: ModelConfig) -> nn.Module:
    from recover.model.llama.model import Transformer

    return Transformer(cfg)


def tp_plan(sequence_parallel: bool) -> TPPlan:
    from recover.model.llama.tp import tp_plan as plan

    return plan(sequence_parallel)


def validate(cfg: ModelConfig, pp: int, tp: int) -> None:
    """Raises ConfigError unless rotary embeddings fit a head and ``tp`` splits heads and the SwiGLU width."""
    head = cfg.dim // cfg.n_heads
    if head % 2:
        raise ConfigError(f"model.n_heads = {cfg.n_heads!r} is not allowed: head size model.dim / model.n_heads = "
                          f"{head} must be even (rotary)")
    if cfg.n_heads % tp or cfg.kv_heads % tp:
        raise ConfigError(f"parallel.tp = {tp!r} is not allowed: must divide model.n_heads = {cfg.n_heads} and the "
                          f"kv heads = {cfg.kv_heads} (each TP rank holds whole heads); choose a tp that divides both")
    if cfg.hidden_dim % tp:
        raise ConfigError(f"parallel.tp = {tp} is not allowed: must divide {_swiglu_fix(cfg, tp)}, "
                          "or choose another tp")


def _swiglu_fix(cfg: ModelConfig, tp: int) -> str:
    """The SwiGLU width ``tp`` does not divide, and the fix."""
    if cfg.ffn_dim:
        return f"model.ffn_dim = {cfg.ffn_dim}; set --model.ffn_dim {-(-cfg.ffn_dim // tp) * tp}"
    step = math.lcm(cfg.ffn_multiple_of, tp)
    return (f"the SwiGLU width {cfg.hidden_dim} (derived from model.dim = {cfg.dim}: 8/3 x dim rounded up to "
            f"model.ffn_multiple_of = {cfg.ffn_multiple_of}); set --model.ffn_multiple_of {step} "
            f"(width {-(-cfg.hidden_dim // step) * step}) or --model.ffn_dim")


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int, params: int) -> int:
    """6 N (N: non-embedding parameters) + 12 L d T (attention scores), plus 6 V d for a tied output
    projection (a real matmul per token, though its matrix is counted once, as the embedding)."""
    embedding = embedding_params(cfg)
    flops = 6 * (params - embedding) + 12 * cfg.n_layers * cfg.dim * seq_len
    return flops + 6 * embedding if cfg.tie_embeddings else flops


SPEC = ModelSpec(
    name="llama", build=build, validate=validate, tp_plan=tp_plan, flops_per_token=flops_per_token,
    embedding_params=embedding_params, blocks="layers", first_stage=("tok_embeddings",),
    last_stage=("norm", "output"), tied=("output.weight", "tok_embeddings.weight"),
    hf=HFMapping(model_type="llama", to_hf=hf.to_hf, from_hf=hf.from_hf, recover_name=hf.recover_name,
                 config=hf.hf_config, config_from_hf=hf.model_config_from_hf),
)
