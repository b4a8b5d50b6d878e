"""The model seam: an architecture is one registered :class:`ModelSpec`; the rest of recover asks it.

A spec holds everything outside the model's own code that depends on its module names: how to build
it, the rules a layout must satisfy, its tensor-parallel plan, its pipeline split, its Hugging Face
mapping and its cost per token. ``parallel/``, ``build_model``, ``model_stats``, ``recover export``,
``recover sample`` and ``--init-from`` ask the spec of ``model.arch``; none of them spells a module
name. A second architecture is one folder (its model, TP plan and spec, like
:mod:`recover.model.llama`) plus one :func:`register` call::

    register(ModelSpec(name="gpt2", build=GPT, validate=check, tp_plan=plan, flops_per_token=flops,
                       embedding_params=lambda cfg: (cfg.vocab_size + cfg.max_seq_len) * cfg.dim,
                       blocks="h", first_stage=("wte", "wpe"), last_stage=("ln_f", "lm_head")))
    load_config("debug", ["--model.arch", "gpt2"])     # now validated, built and parallelised as gpt2

Contract of a model that ``build`` returns (what ``parallel/`` and the trainer rely on):
- ``model.cfg`` is its :class:`ModelConfig`; ``model.init_weights(seed)`` fills every
  parameter from ``seed`` and the parameter's name alone (:func:`recover.model.common.param_seed`),
  so a pipeline stage or a shard gets the whole model's values.
- ``forward(tokens (B, T)) -> logits (B, T, V)``; its blocks sit in an ``nn.ModuleDict`` attribute
  named ``blocks``, keyed ``"0".."L-1"``; every module named in ``first_stage`` / ``last_stage`` may
  be set to ``None``, and ``forward`` then passes the hidden states ``(B, T, cfg.dim)`` through
  (a pipeline stage is the same class with the other parts removed; parameter names unchanged).

The model section of a run's config (``[model]``, ``--model.FIELD``) is here too, :class:`ModelConfig`: a
config names its spec and a spec builds, validates and sizes a config, so the two live in one module.
Contract of a :class:`ModelConfig`: frozen and valid once constructed: ``arch`` names a registered
architecture (:func:`get`, a ConfigError naming the known ones), every shape field is checked, then the
architecture's own rules for one process (:attr:`ModelSpec.validate`). Every problem is a one-line
:class:`~recover.errors.ConfigError` naming the field. :mod:`recover.config` holds it as ``Config.model``
(and exports it under its old name, ``recover.config.ModelConfig``); the rules of a layout (``pp``, ``tp``)
are :func:`recover.config.check_layout`'s.

This module imports no torch: a :class:`ModelConfig` validates ``model.arch`` against :func:`names`, and the
launcher and ``recover --help`` stay fast. The built-in ``llama`` spec is imported on its first :func:`get`
(by its name: the spec imports this module for :class:`ModelSpec`); its own module imports torch only when a
model is built or parallelised.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from recover.errors import ConfigError, check_numbers, require

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

    StateDict = dict[str, torch.Tensor]

__all__ = ["HFMapping", "ModelConfig", "ModelSpec", "TPPlan", "get", "names", "register", "spec_of"]


@dataclass(frozen=True)
class TPPlan:
    """Tensor-parallel styles (``torch.distributed.tensor.parallel``) keyed by submodule path."""

    block: dict[str, ParallelStyle]
    """Applied to every block; paths inside the block (``"attention.wq"``)."""
    outer: dict[str, ParallelStyle] = field(default_factory=dict)
    """Applied to the root after the blocks; top-level module names. An entry whose module this pipeline
    stage does not hold (``None``) is skipped. Usually empty without sequence parallelism."""


@dataclass(frozen=True)
class HFMapping:
    """How a model of this architecture reads and writes a Hugging Face ``transformers`` checkpoint."""

    model_type: str
    """``config.json``'s ``model_type`` (``"llama"``); ``--init-from`` of an HF directory picks the spec by it."""
    to_hf: Callable[[StateDict, ModelConfig], StateDict]
    """recover's whole state dict -> HF names and layouts."""
    from_hf: Callable[[StateDict, ModelConfig], StateDict]
    """The inverse: ``from_hf(to_hf(sd, cfg), cfg) == sd`` bitwise."""
    recover_name: Callable[[str], str | None]
    """recover's name of one HF tensor; None for a buffer to skip; KeyError for one with no place."""
    config: Callable[[ModelConfig, int | None, str], dict[str, Any]]
    """``config(cfg, eot_id, dtype)``: the ``config.json`` of the HF model that computes what recover's does."""
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    """``config_from_hf(config_json, where)``: the recover model of an HF config; ConfigError when recover's
    model cannot express it (``where`` names the source in the message)."""


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: everything outside its model code that depends on its module names."""

    name: str
    """What ``model.arch`` says."""
    build: Callable[[ModelConfig], nn.Module]
    """The modules of a model of ``cfg`` on the current default device, values not yet initialised
    (see the module contract)."""
    validate: Callable[[ModelConfig, int, int], None]
    """``validate(cfg, pp, tp)``: ConfigError (field, value, fix) unless ``cfg`` is a model of this
    architecture that ``tp`` shards and ``pp`` stages can split (heads, widths). The rules common to every
    spec (``pp`` at most the number of blocks, untied embeddings with ``pp > 1``) are checked beside it
    (:func:`recover.config.check_layout`)."""
    tp_plan: Callable[[bool], TPPlan]
    """``tp_plan(sequence_parallel)``: the plan :func:`recover.parallel.tp.apply_tp` applies."""
    flops_per_token: Callable[[ModelConfig, int, int], int]
    """``flops_per_token(cfg, seq_len, params)``: training FLOPs (forward + backward) per token, given the
    model's parameter count (a tied matrix counted once)."""
    embedding_params: Callable[[ModelConfig], int]
    """Parameters that are table look-ups, not matmuls (token and learned position embeddings)."""
    blocks: str = "layers"
    """The ``nn.ModuleDict`` of blocks: the unit of pipeline split, activation checkpointing, compile, FSDP."""
    first_stage: tuple[str, ...] = ()
    """Top-level modules only the first pipeline stage keeps (the embeddings)."""
    last_stage: tuple[str, ...] = ()
    """Top-level modules only the last pipeline stage keeps (final norm, output projection)."""
    tied: tuple[str, str] | None = None
    """``(output, embedding)`` parameter names that ``model.tie_embeddings`` makes one matrix."""
    hf: HFMapping | None = None
    """The Hugging Face mapping; None: ``recover export --format hf`` and HF ``--init-from`` are refused."""

    def block_dict(self, model: nn.Module) -> nn.ModuleDict:
        """The model's (or stage's) blocks, keyed ``"0".."L-1"`` (a stage holds a contiguous subset)."""
        return getattr(model, self.blocks)


_BUILTIN = {"llama": "recover.model.llama.spec"}
"""Built-in architectures: name -> the module whose ``SPEC`` is imported on first use."""
_REGISTERED: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Makes ``spec`` the architecture ``model.arch = spec.name`` selects; returns it.

    Raises:
        ValueError: another spec already has that name (registering the same spec again is a no-op).
    """
    taken = _REGISTERED.get(spec.name)
    if spec.name in _BUILTIN or (taken is not None and taken != spec):
        raise ValueError(f"model architecture {spec.name!r} is already registered; give the new spec another name")
    _REGISTERED[spec.name] = spec
    return spec


def names() -> list[str]:
    """Every architecture ``model.arch`` may name (no imports)."""
    return sorted({*_BUILTIN, *_REGISTERED})


def get(name: str) -> ModelSpec:
    """The spec of architecture ``name``.

    Raises:
        ConfigError: no architecture of that name (the message lists the known ones).
    """
    if name not in _REGISTERED and name in _BUILTIN:
        _REGISTERED[name] = importlib.import_module(_BUILTIN[name]).SPEC
    if name not in _REGISTERED:
        raise ConfigError(f"model.arch = {name!r} is not allowed: one of {', '.join(map(repr, names()))} "
                          "(another architecture is added with recover.model.spec.register)")
    return _REGISTERED[name]


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec of a model (or pipeline stage) that a spec built: ``get(model.cfg.arch)``."""
    return get(model.cfg.arch)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: ``arch`` picks the architecture, the other fields its shape (each
    architecture reads the fields it has a use for; the comments describe the built-in Llama)."""

    SECTION: ClassVar[str] = "model"

    arch: str = "llama"
    """The architecture: a registered :class:`ModelSpec`'s name (built in: ``llama``)."""
    vocab_size: int = 320
    """Embedding rows. Unless given on the command line, ``recover train``/``launch`` take the data's
    vocabulary (meta.json, meta.pkl, an llm.c header) rounded up to a multiple of 64 (byte tokenizer:
    257 -> 320); never smaller than the data's (:mod:`recover.data.layout`)."""
    dim: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; must divide ``dim``."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means ``n_heads``."""
    ffn_dim: int = 0
    """SwiGLU hidden width; 0 means 8/3 * dim rounded up to ``ffn_multiple_of``."""
    ffn_multiple_of: int = 32
    """Rounding for the derived SwiGLU width."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding and the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (output projections are scaled by depth)."""

    def __post_init__(self) -> None:
        spec = get(self.arch)  # ConfigError naming the known architectures
        check_numbers(self, self.SECTION)  # finite floats, 64-bit integers
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name}", value, "a positive integer")
        require(self.dim % self.n_heads == 0, "model.n_heads", self.n_heads,
                 f"must divide model.dim = {self.dim}")
        require(self.n_kv_heads >= 0 and (self.n_kv_heads == 0 or self.n_heads % self.n_kv_heads == 0),
                 "model.n_kv_heads", self.n_kv_heads, f"0 or a divisor of model.n_heads = {self.n_heads}")
        require(self.ffn_dim >= 0, "model.ffn_dim", self.ffn_dim, "0 (derived) or a positive integer")
        require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "a positive number")
        require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "a positive number")
        require(self.init_std > 0, "model.init_std", self.init_std, "a positive number")
        spec.validate(self, 1, 1)  # the architecture's own rules (Llama: an even head size)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or ``n_heads`` when it is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU width: ``ffn_dim``, or 8/3 * ``dim`` rounded up to ``ffn_multiple_of`` when it is 0."""
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.ffn_multiple_of * -(-hidden // self.ffn_multiple_of)
