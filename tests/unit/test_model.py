"""Model: deterministic init by (seed, parameter name), causality, shapes and size figures."""

from __future__ import annotations

import dataclasses

import torch

from recover.config import ModelConfig, load_config
from recover.model import build_model, lm_loss, model_stats


def small(**kw: object) -> ModelConfig:
    return dataclasses.replace(load_config("debug").model, **kw)


def test_init_is_deterministic_and_seed_dependent() -> None:
    a, b, c = build_model(small(), 7), build_model(small(), 7), build_model(small(), 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=False):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_a_pipeline_stage_gets_the_same_weights_as_the_whole_model() -> None:
    whole = build_model(small(n_layers=4), 3)
    stage = build_model(small(n_layers=4), 0)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.init_weights(3)
    params = dict(whole.named_parameters(remove_duplicate=False))
    for name, p in stage.named_parameters():
        assert torch.equal(p, params[name]), name
    tokens = torch.randint(0, 257, (2, 16))
    hidden = whole.layers["1"](whole.layers["0"](whole.tok_embeddings(tokens), whole.rot[:16]), whole.rot[:16])
    torch.testing.assert_close(stage(hidden), whole(tokens), rtol=0, atol=0)


def test_forward_is_causal_and_shaped() -> None:
    model = build_model(small(n_kv_heads=2), 1)
    tokens = torch.randint(0, 257, (3, 20))
    logits = model(tokens)
    assert logits.shape == (3, 20, model.cfg.vocab_size)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 257
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_tied_and_untied_embeddings() -> None:
    tied = build_model(small(tie_embeddings=True), 1)
    untied = build_model(small(tie_embeddings=False), 1)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == tied.cfg.vocab_size * tied.cfg.dim


def test_initial_loss_is_near_uniform_and_it_learns() -> None:
    torch.manual_seed(0)
    model = build_model(small(), 1)
    data = torch.randint(0, 257, (4, 33))
    inputs, targets = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        first = float(lm_loss(model(inputs), targets))
    assert abs(first - torch.log(torch.tensor(320.0)).item()) < 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        lm_loss(model(inputs), targets).backward()
        opt.step()
    with torch.no_grad():
        assert float(lm_loss(model(inputs), targets)) < first - 2.0


def test_size_figures_match_known_models() -> None:
    assert abs(model_stats(load_config("8b").model, 8192).params - 8.03e9) < 0.01e9  # Llama 3 8B
    assert abs(model_stats(load_config("1b").model, 2048).params - 1.236e9) < 0.01e9  # Llama 3.2 1B
    stats = model_stats(small(), 64)
    assert stats.flops_per_token > 6 * stats.non_embedding_params
    assert "parameters" in stats.describe()
