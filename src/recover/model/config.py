"""The model section of a run's config (``[model]``, ``--model.FIELD``): the architecture and its shape.

Contract: a :class:`ModelConfig` is frozen and valid once constructed: ``arch`` names a registered
architecture (:func:`recover.model.spec.get`, a ConfigError naming the known ones), every shape field is
checked, then the architecture's own rules for one process (:attr:`recover.model.spec.ModelSpec.validate`).
Every problem is a one-line :class:`~recover.errors.ConfigError` naming the field. :mod:`recover.config`
holds it as ``Config.model`` (and exports it under its old name, ``recover.config.ModelConfig``); the
rules of a layout (``pp``, ``tp``) are :func:`recover.config.check_layout`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from recover.errors import check_numbers, require
from recover.model import spec as model_spec


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: ``arch`` picks the architecture, the other fields its shape (each
    architecture reads the fields it has a use for; the comments describe the built-in Llama)."""

    SECTION: ClassVar[str] = "model"

    arch: str = "llama"
    """The architecture: a registered :class:`~recover.model.spec.ModelSpec`'s name (built in: ``llama``)."""
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
        spec = model_spec.get(self.arch)  # ConfigError naming the known architectures
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
