"""recover's Llama layout <-> Hugging Face ``LlamaForCausalLM``: names, rotary layout, config.

Llama's :class:`~recover.model.spec.HFMapping` (:mod:`recover.model.llama.spec`): pure conversions (no
files; tensors are only reshaped, so no torch import). :mod:`recover.train.checkpoints.export` and
:mod:`recover.train.checkpoints.weights` reach them through :mod:`recover.model.hf`, which asks the model registry.

Contract:
- :func:`to_hf` maps a recover state dict (full tensors, recover names) to HF's names and back
  (:func:`from_hf`); for every ``name``, ``from_hf(to_hf(sd)) == sd`` bitwise.
- Rotary layout. recover rotates the PAIRS ``(x[2i], x[2i+1])`` of each head (``apply_rotary``
  views a head as D/2 complex numbers); HF's ``rotate_half`` rotates ``(x[i], x[i + D/2])``. Both
  compute the same attention scores once the rows of ``wq`` and ``wk`` are reordered inside each
  head: HF row ``i`` is recover row ``2i`` and HF row ``D/2 + i`` is recover row ``2i + 1``
  (:func:`interleaved_to_halves`). q . k is a sum over the pairs, so the order of the pairs is
  free and only this reordering matters. Without it the logits are silently wrong.
- :func:`hf_config` is the ``config.json`` of recover's model; :func:`model_config_from_hf` reads
  one back (for ``--init-from``; :mod:`recover.model.hf` has checked ``model_type``), refusing what
  recover's model cannot express.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recover.errors import ConfigError
from recover.model.spec import ModelConfig

if TYPE_CHECKING:
    import torch

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}


def hf_name(name: str) -> str:
    """HF name of a parameter (``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _TOP:
        return _TOP[name]
    layer, _, rest = name.removeprefix("layers.").partition(".")
    if name.startswith("layers.") and rest in _BLOCK:
        return f"model.layers.{layer}.{_BLOCK[rest]}"
    raise KeyError(f"{name!r} is not a parameter of recover's Llama model")


def recover_name(name: str) -> str | None:
    """The recover name of an HF Llama tensor; None for buffers HF may store (``rotary_emb.inv_freq``)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    layer, _, rest = name.removeprefix("model.layers.").partition(".")
    if name.startswith("model.layers.") and rest in _BLOCK_BACK:
        return f"layers.{layer}.{_BLOCK_BACK[rest]}"
    raise KeyError(f"{name!r} is not a tensor of a Llama model")


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorders the rows of ``wq``/``wk`` (heads x D, C) from recover's rotary pairs to HF's halves."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)  # (H, 2, D/2, C)


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_halves`."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)  # (H, D/2, 2, C)


def _rotary_heads(name: str, cfg: ModelConfig) -> int | None:
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    return None


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A recover state dict in HF's names and rotary layout; the output projection is left out when tied."""
    out = {}
    for name, t in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        heads = _rotary_heads(name, cfg)
        out[hf_name(name)] = (interleaved_to_halves(t, heads) if heads else t).contiguous()
    return out


def from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF Llama state dict in recover's names and rotary layout (``cfg``: the HF model's shape).

    A tied HF model (no ``lm_head.weight``) gets ``output.weight`` = its embedding.
    """
    out = {}
    for name, t in state.items():
        ours = recover_name(name)
        if ours is None:
            continue
        heads = _rotary_heads(ours, cfg)
        out[ours] = halves_to_interleaved(t, heads) if heads else t
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(cfg: ModelConfig, eot_id: int | None, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` that computes what recover's model computes."""
    theta = float(cfg.rope_theta)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim // cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "use_cache": True,
        # recover adds no BOS; generation stops at the run's end-of-text token, as `recover sample` does
        "bos_token_id": None, "eos_token_id": eot_id, "pad_token_id": None, "torch_dtype": dtype,
    }


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The recover model of an HF Llama ``config.json`` (``where`` names it in errors).

    Raises:
        ConfigError: a Llama config recover's model cannot express (biases, rope scaling).
    """
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{where}: {flag} = true, but recover's Llama has no biases")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported "
                          "by recover's model (plain rotary embeddings only)")
    heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    if int(hf.get("head_dim") or dim // heads) * heads != dim:
        raise ConfigError(f"{where}: head_dim x num_attention_heads != hidden_size; recover's model needs them equal")
    return ModelConfig(arch="llama", vocab_size=int(hf["vocab_size"]), dim=dim,
                       n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
                       n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                       ffn_dim=int(hf["intermediate_size"]), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
