"""recover <-> Hugging Face Llama layout, without transformers: names, the rotary permutation, configs.

The mapping is reached as the rest of recover reaches it: through :mod:`recover.model.hf`, which asks
the model registry for ``model.arch``'s; the rotary permutation is Llama's own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recover.config import load_config
from recover.errors import ConfigError
from recover.model import build_model, hf
from recover.model.llama.hf import halves_to_interleaved, interleaved_to_halves
from recover.model.llama.model import apply_rotary, rotary_table


def rotate_half_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's convention, written from its definition: pairs (x[i], x[i + D/2]) rotated by angle t * f_i."""
    T, D = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)  # (T, D/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None, :].float()
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None, :].float()
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + rotated * sin


def test_the_qk_permutation_turns_recovers_rotary_pairs_into_hfs_rotate_half() -> None:
    heads, d, c, T = 3, 8, 5, 7
    w = torch.randn(heads * d, c)
    x = torch.randn(1, T, c)
    ours = apply_rotary((x @ w.T).view(1, T, heads, d), rotary_table(d, T, 500.0))  # (1, T, H, D)
    theirs = rotate_half_rope((x @ interleaved_to_halves(w, heads).T).view(1, T, heads, d), 500.0)
    # the same vectors up to the order of the coordinates inside each head, so every q . k agrees
    scores = torch.einsum("bthd,bshd->bhts", ours, ours)
    torch.testing.assert_close(torch.einsum("bthd,bshd->bhts", theirs, theirs), scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, heads), heads), w)
    unpermuted = rotate_half_rope((x @ w.T).view(1, T, heads, d), 500.0)
    assert (torch.einsum("bthd,bshd->bhts", unpermuted, unpermuted) - scores).abs().max() > 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_names_round_trip_and_a_tied_output_is_not_stored(tied: bool) -> None:
    cfg = dataclasses.replace(load_config("debug").model, n_kv_heads=2, tie_embeddings=tied)
    state = build_model(cfg, 1).state_dict()
    out = hf.to_hf(state, cfg)
    assert ("lm_head.weight" in out) is not tied and "model.layers.1.mlp.down_proj.weight" in out
    back = hf.from_hf(out, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="not a tensor of a Llama model"):
        hf.recover_name("model.layers.0.self_attn.q_proj.bias", cfg)


def test_hf_config_round_trips_and_unsupported_models_are_refused() -> None:
    cfg = dataclasses.replace(load_config("debug").model, n_kv_heads=2, rope_theta=500.0, tie_embeddings=False)
    config = hf.hf_config(cfg, 256)
    back = hf.model_config_from_hf(config, "x")
    assert (back.dim, back.n_layers, back.n_heads, back.kv_heads, back.hidden_dim, back.rope_theta,
            back.tie_embeddings, back.max_seq_len) == (64, 2, 4, 2, cfg.hidden_dim, 500.0, False, 64)
    assert config["eos_token_id"] == 256 and config["bos_token_id"] is None
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        hf.model_config_from_hf({**config, "model_type": "gpt2"}, "x")
    with pytest.raises(ConfigError, match="rope scaling 'llama3'"):
        hf.model_config_from_hf({**config, "rope_parameters": {"rope_type": "llama3"}}, "x")


def test_the_byte_alphabet_is_a_bijection_of_printable_characters() -> None:
    symbols = hf.byte_symbols()
    assert len(set(symbols)) == 256 and all(s.isprintable() and not s.isspace() for s in symbols)
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] == "\u0120" and symbols[10] == "\u010a"
    vocab = hf.byte_tokenizer_json()["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256))
