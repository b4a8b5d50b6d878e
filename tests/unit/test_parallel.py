"""Pure tests of ``recover.parallel`` (no process group): the rank grid, validation, stage splits,
and the one-process engine against the plain accumulator."""

from __future__ import annotations

import pytest
import torch

from recover.config import ModelConfig
from recover.errors import ConfigError
from recover.model import build_model, lm_loss
from recover.parallel import MeshAxis, ParallelDims, ReplicaEngine, parallelize, split_stage
from recover.parallel.pipeline import PipelineRunner
from recover.recovery.accumulator import GradAccumulator

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=5, n_heads=4, max_seq_len=16, tie_embeddings=False)


# ---- the rank grid -------------------------------------------------------------------------
def test_rank_grid_is_pp_fsdp_tp_arithmetic() -> None:
    dims = ParallelDims(pp=2, tp=2, fsdp=3)
    assert dims.world == 12 and dims.shape == (2, 3, 2)
    assert torch.equal(dims.rank_grid(), torch.arange(12).view(2, 3, 2))
    for rank in range(dims.world):
        c = dims.coords(rank)
        assert dims.rank_of(*c) == rank == int(dims.rank_grid()[c.pp, c.fsdp, c.tp])
    assert dims.coords(7) == (1, 0, 1)


def test_groups_along_each_axis() -> None:
    dims = ParallelDims(pp=2, tp=2, fsdp=2)
    assert dims.groups(MeshAxis.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups(MeshAxis.FSDP) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups(MeshAxis.PP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in MeshAxis:  # every axis partitions the replica
        assert sorted(r for g in dims.groups(axis) for r in g) == list(range(8))
    assert [a.value for a in MeshAxis] == ["pp", "fsdp", "tp"]


def test_stage_layers_are_contiguous_and_cover_the_model() -> None:
    dims = ParallelDims(pp=2)
    assert dims.stage_layers(5, 0) == [0, 1, 2] and dims.stage_layers(5, 1) == [3, 4]
    assert sum((ParallelDims(pp=3).stage_layers(8, s) for s in range(3)), []) == list(range(8))
    with pytest.raises(ValueError, match="stage 2"):
        dims.stage_layers(5, 2)


# ---- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_degrees_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tp"):
        ParallelDims(tp=bad)  # type: ignore[arg-type]


def test_world_must_match_the_replica() -> None:
    with pytest.raises(ConfigError, match=r"2 x 1 x 2 = 4 does not match the replica's 6 processes"):
        ParallelDims(pp=2, tp=2).check_world(6)
    ParallelDims(pp=2, tp=2).check_world(4)
    with pytest.raises(ValueError, match="outside"):
        ParallelDims(tp=2).coords(2)


def test_model_checks() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tp = 3 .*model\.n_heads = 4"):
        ParallelDims(tp=3).check_model(CFG)
    with pytest.raises(ConfigError, match=r"parallel\.pp = 6 .*model\.n_layers = 5"):
        ParallelDims(pp=6).check_model(CFG)
    tied = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, tie_embeddings=True)
    with pytest.raises(ConfigError, match="tie_embeddings = false"):
        ParallelDims(pp=2).check_model(tied)
    ParallelDims(tp=2).check_model(tied)  # tied + TP / FSDP is fine: both copies live on one stage
    ParallelDims(pp=5, tp=4).check_model(CFG)


def test_sequence_parallel_needs_tp_and_no_pipeline() -> None:
    with pytest.raises(ConfigError, match="sequence parallelism"):
        parallelize(build_model(CFG, 0), ParallelDims(), None, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence parallelism"):
        parallelize(build_model(CFG, 0), ParallelDims(pp=2, tp=2), None, sequence_parallel=True)


# ---- pipeline stages -----------------------------------------------------------------------
def test_stages_hold_the_whole_models_values_and_compose_to_its_forward() -> None:
    dims = ParallelDims(pp=2)
    whole = build_model(CFG, 7)
    stages = [split_stage(build_model(CFG, 7), dims, s) for s in range(2)]
    assert stages[0].norm is None and stages[0].output is None and stages[1].tok_embeddings is None
    full = dict(whole.named_parameters())
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(full)
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.equal(p, full[n]), n
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](tokens)), whole(tokens), rtol=0, atol=0)


def test_1f1b_falls_back_to_gpipe_below_pp_microbatches() -> None:
    runner = PipelineRunner(torch.nn.Identity(), 0, 3, None, torch.device("cpu"), 8, 8, "1f1b")  # type: ignore[arg-type]
    assert [runner.kind(n) for n in (1, 2, 3, 8)] == ["gpipe", "gpipe", "1f1b", "1f1b"]
    assert PipelineRunner(torch.nn.Identity(), 0, 2, None, torch.device("cpu"), 8, 8, "gpipe").kind(4) == "gpipe"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule"):
        PipelineRunner(torch.nn.Identity(), 0, 2, None, torch.device("cpu"), 8, 8, "zb")  # type: ignore[arg-type]


# ---- the engine of a one-process replica ---------------------------------------------------
class _Sampler:
    microbatch_size, seq_len = 2, 8

    def microbatch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + mb)
        data = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
        return data[:, :-1], data[:, 1:]


def test_one_process_engine_matches_the_accumulator() -> None:
    sampler, M = _Sampler(), 4
    engine = ReplicaEngine(CFG, 3, ParallelDims(), None)
    model = build_model(CFG, 3)
    acc = GradAccumulator(model)
    opt_e = torch.optim.AdamW(engine.model.parameters(), lr=1e-2)
    opt_a = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        engine.reset()
        acc.reset()
        engine.compute(step, [2, 0], sampler)
        engine.compute(step, [], sampler)  # a quota of 0 is a no-op
        engine.compute(step, [3], sampler)
        for mb in (2, 0, 3):
            x, y = sampler.microbatch(step, mb)
            acc.add(mb, lm_loss(model(x), y))
        assert engine.ledger == acc.ledger == [2, 0, 3]
        assert engine.loss_sum == pytest.approx(acc.loss_sum, rel=1e-6)
        assert sorted(engine.losses) == [0, 2, 3]
        got, want = engine.payload(), acc.payload()
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        norm_e = engine.apply(got, M, opt_e, grad_clip=0.5)
        norm_a = acc.apply(want, M, opt_a, grad_clip=0.5)
        assert norm_e == pytest.approx(norm_a, rel=1e-5)
    for (n, p), q in zip(engine.model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_local_state_round_trip() -> None:
    sampler = _Sampler()
    src = ReplicaEngine(CFG, 3, ParallelDims(), None)
    opt = torch.optim.AdamW(src.model.parameters(), lr=1e-2)
    src.compute(0, [0], sampler)
    src.apply(src.payload(), 1, opt, 1.0)
    dst = ReplicaEngine(CFG, 4, ParallelDims(), None)
    opt2 = torch.optim.AdamW(dst.model.parameters(), lr=1e-2)
    dst.load_local_state(opt2, src.local_state(opt))
    for p, q in zip(src.params, dst.params, strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
