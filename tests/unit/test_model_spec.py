"""The model seam: a second architecture, defined in this file and registered, goes through the same
code as the built-in Llama (config validation, ``build_model``, ``model_stats``, the pipeline split,
activation checkpointing, tensor parallelism and FSDP) without one line of it naming the new modules.

The architecture is GPT-2-like: LayerNorm with biases, learned positions, separate q/k/v projections,
a GELU MLP. Tensor parallelism and FSDP run on a fake process group of two ranks (no processes, no
communication: collectives return at once), which is enough to check where the plan put each shard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from recover.config import Config, DataConfig, ModelConfig, ParallelConfig, from_dict, load_config
from recover.errors import ConfigError
from recover.model import build_model, hf, model_stats
from recover.model.common import param_seed
from recover.model.spec import ModelSpec, TPPlan, get, names, register
from recover.parallel import ParallelDims, parallelize, split_stage
from recover.train.checkpoints.checkpoint import check_compatible

ARCH = "minigpt"


# ---- the architecture: what a second folder would hold ---------------------------------------------
def hidden(cfg: ModelConfig) -> int:
    return cfg.ffn_dim or 4 * cfg.dim


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.dim, hidden(cfg)), nn.Linear(hidden(cfg), cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps), SelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))  # (B, T, C)
        else:
            x = tokens  # a later pipeline stage: hidden states
        for block in self.h.values():
            x = block(x)
        x = self.ln_f(x) if self.ln_f is not None else x
        return self.lm_head(x).float() if self.lm_head is not None else x

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias") or ".ln_" in f".{name}":
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            if name == "lm_head.weight" and self.cfg.tie_embeddings:
                name = "wte.weight"
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=gen) * self.cfg.init_std)


def tp_plan(sequence_parallel: bool) -> TPPlan:
    if sequence_parallel:
        raise NotImplementedError("minigpt has no sequence-parallel plan")
    rep = Replicate()
    return TPPlan(block={"attn": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,)),
                         "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                         "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})


def validate(cfg: ModelConfig, pp: int, tp: int) -> None:
    if cfg.n_heads % tp or hidden(cfg) % tp:
        raise ConfigError(f"parallel.tp = {tp} is not allowed: must divide model.n_heads = {cfg.n_heads} and the "
                          f"MLP width {hidden(cfg)}")


def embedding_params(cfg: ModelConfig) -> int:
    return (cfg.vocab_size + cfg.max_seq_len) * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int, params: int) -> int:
    flops = 6 * (params - embedding_params(cfg)) + 12 * cfg.n_layers * cfg.dim * seq_len
    return flops + 6 * cfg.vocab_size * cfg.dim if cfg.tie_embeddings else flops


SPEC = register(ModelSpec(
    name=ARCH, build=MiniGPT, validate=validate, tp_plan=tp_plan, flops_per_token=flops_per_token,
    embedding_params=embedding_params, blocks="h", first_stage=("wte", "wpe"), last_stage=("ln_f", "lm_head"),
    tied=("lm_head.weight", "wte.weight")))

CFG = ModelConfig(arch=ARCH, vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16, tie_embeddings=False)


# ---- the registry and the config ----------------------------------------------------------------------
def test_the_registry_knows_both_and_names_them_when_asked_for_another() -> None:
    assert {"llama", ARCH} <= set(names()) and get(ARCH) is SPEC and register(SPEC) is SPEC  # again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register(dataclasses.replace(SPEC, blocks="layers"))
    with pytest.raises(ValueError, match="already registered"):
        register(dataclasses.replace(get("llama"), build=MiniGPT))
    with pytest.raises(ConfigError, match=r"model\.arch = 'gpt5' is not allowed: one of 'llama', .*register"):
        ModelConfig(arch="gpt5")
    with pytest.raises(ConfigError, match=r"model\.arch = 'gpt5' is not allowed"):
        get("gpt5")


def test_a_config_selects_the_architecture_and_its_rules_apply() -> None:
    cfg = load_config("debug", ["--model.arch", ARCH, "--model.tie_embeddings", "false"])
    assert cfg.model.arch == ARCH
    data = DataConfig(seq_len=16)
    Config(model=CFG, data=data, parallel=ParallelConfig(tp=4, pp=3))
    with pytest.raises(ConfigError, match="MLP width 102"):  # the architecture's own rule ...
        Config(model=dataclasses.replace(CFG, ffn_dim=102), data=data, parallel=ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match=r"parallel\.pp = 4 .*model\.n_layers = 3"):  # ... and the common ones
        ParallelDims(pp=4).check_model(CFG)
    ModelConfig(arch=ARCH, dim=36, n_heads=4)  # head size 9: Llama's rotary rule is Llama's alone
    with pytest.raises(ConfigError, match="must be even"):
        ModelConfig(dim=36, n_heads=4)


def test_a_config_or_checkpoint_written_before_arch_existed_reads_as_llama(tmp_path: Path) -> None:
    old = load_config("debug").to_dict()
    del old["model"]["arch"]
    cfg = from_dict(old)
    assert cfg.model.arch == "llama"
    check_compatible({"model": old["model"]}, cfg.model, tmp_path)  # resuming an old checkpoint still works


# ---- building, stats, export --------------------------------------------------------------------------
def test_it_builds_deterministically_through_build_model_and_its_stats_are_its_own() -> None:
    a, b = build_model(CFG, 5), build_model(CFG, 5)
    assert isinstance(a, MiniGPT) and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(),
                                                                             strict=True))
    assert a(torch.randint(0, 64, (2, 16))).shape == (2, 16, 64)
    stats = model_stats(CFG, 16)
    params = sum(p.numel() for p in a.parameters())
    assert stats.params == params and stats.non_embedding_params == params - 80 * 32
    assert stats.flops_per_token == 6 * (params - 80 * 32) + 12 * 3 * 32 * 16
    with pytest.raises(ConfigError, match="no Hugging Face mapping: export it with --format torch"):
        hf.hf_config(CFG, 0)


# ---- parallel/, asking the spec -----------------------------------------------------------------------
def test_pipeline_stages_split_by_the_spec_compose_to_the_whole_model() -> None:
    dims = ParallelDims(pp=2)
    whole = build_model(CFG, 7)
    stages = [split_stage(build_model(CFG, 7), dims, s) for s in range(2)]
    assert list(stages[0].h) == ["0", "1"] and list(stages[1].h) == ["2"]
    assert stages[0].ln_f is None and stages[0].lm_head is None and stages[1].wte is None and stages[1].wpe is None
    assert sorted(n for st in stages for n, _ in st.named_parameters()) == sorted(n for n, _ in
                                                                                 whole.named_parameters())
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](tokens)), whole(tokens), rtol=0, atol=0)


def test_activation_checkpointing_wraps_the_specs_blocks() -> None:
    model = parallelize(build_model(CFG, 1), ParallelDims(), None, activation_checkpointing=True)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.h.values())
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(tokens), build_model(CFG, 1)(tokens), rtol=0, atol=0)


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A process group of two ranks in this process whose collectives do nothing (this process is rank 0)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    import torch.distributed as dist

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(dims: ParallelDims):  # noqa: ANN202 - a DeviceMesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", dims.shape, mesh_dim_names=("pp", "fsdp", "tp"))


def test_tensor_parallelism_applies_the_specs_plan(fake_world: None) -> None:
    dims = ParallelDims(tp=2)
    model = parallelize(build_model(CFG, 1), dims, _mesh(dims))
    block = model.h["2"]
    for linear, placement, local in ((block.attn.q, Shard(0), (16, 32)), (block.attn.proj, Shard(1), (32, 16)),
                                     (block.mlp.fc, Shard(0), (64, 32)), (block.mlp.proj, Shard(1), (32, 64))):
        assert isinstance(linear.weight, DTensor) and linear.weight.placements == (placement,)
        assert tuple(linear.weight.to_local().shape) == local
    assert not isinstance(model.wte.weight, DTensor) and not isinstance(block.ln_1.weight, DTensor)
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)  # heads per rank read from the weights


def test_fsdp_shards_each_of_the_specs_blocks(fake_world: None) -> None:
    from torch.distributed.fsdp import FSDPModule

    dims = ParallelDims(fsdp=2)
    model = parallelize(build_model(CFG, 1), dims, _mesh(dims))
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.h.values())
    assert math.prod(model.h["0"].mlp.fc.weight.to_local().shape) == 4 * 32 * 32 // 2
