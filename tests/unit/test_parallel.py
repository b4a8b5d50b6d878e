"""Pure tests of ``recover.parallel`` (no process group): the rank grid, validation, stage splits,
and a one-process replica against plain PyTorch gradient accumulation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recover.config import ModelConfig, TrainingConfig
from recover.errors import ConfigError
from recover.model import build_model, lm_loss
from recover.parallel import MeshAxis, ParallelDims, parallelize, split_stage
from recover.parallel.pipeline import PipelineRunner
from recover.train.replicas.optim import build_optimizer, lr_at, set_lr
from recover.train.replicas.replica import Replica

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


# ---- a one-process replica --------------------------------------------------------------------
class _Sampler:
    microbatch_size, seq_len = 2, 8

    def microbatch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + mb)
        data = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
        return data[:, :-1], data[:, 1:]


TC = TrainingConfig(steps=4, global_microbatches=4, lr=1e-2, warmup_steps=0, seed=3, grad_clip=0.5)


def test_one_process_replica_is_plain_pytorch_gradient_accumulation() -> None:
    """compute/payload/apply of the degenerate layout == a hand-written loop: backward per
    microbatch, sum, divide by M, clip by the global norm, AdamW."""
    sampler, M = _Sampler(), 4
    replica = Replica(CFG, TC, sampler)
    model = build_model(CFG, TC.seed)
    opt = build_optimizer(model, TC)
    for step in range(2):
        replica.reset()
        replica.compute(step, [2, 0])
        replica.compute(step, [])  # a quota of 0 is a no-op
        replica.compute(step, [3])
        losses, grads = [], [torch.zeros_like(p) for p in model.parameters()]
        for mb in (2, 0, 3):
            x, y = sampler.microbatch(step, mb)
            loss = lm_loss(model(x), y)
            model.zero_grad()
            loss.backward()
            losses.append(float(loss.detach()))
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad
        assert replica.ledger == [2, 0, 3]
        assert replica.loss_sum == pytest.approx(sum(losses), rel=1e-6)
        assert sorted(replica.losses) == [0, 2, 3]
        payload = replica.payload()
        t = replica.totals(payload)
        assert (t.loss_sum, t.microbatches) == (pytest.approx(sum(losses), rel=1e-6), 3)
        for a, b in zip(payload, grads, strict=False):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        norm = replica.apply(payload, M, step, t.sum_norm)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g / M
        set_lr(opt, lr_at(step, TC))
        assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(model.parameters(), TC.grad_clip)),
                                     rel=1e-5)
        opt.step()
    for (n, p), q in zip(replica.model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("deterministic", [True, False])
def test_backwards_in_a_pipeline_schedule_fold_one_by_one_in_deterministic_mode(deterministic: bool) -> None:
    """What a pipeline stage's schedule runs under (``_folding_each_backward``): in deterministic mode each
    backward's gradient reaches the float64 buffers on its own (``.grad`` is cleared after each) and a
    zero-weight padding pass adds exact zeros; in default mode the backwards sum in ``.grad``, folded after."""
    sampler = _Sampler()
    replica = Replica(CFG, dataclasses.replace(TC, deterministic=deterministic), sampler)
    passes = [(1, 1.0), (0, 0.0), (2, 1.0)]  # (id, weight): the middle one is padding
    alone = []
    for mb, weight in passes:  # each pass's gradient on its own, outside the context
        x, y = sampler.microbatch(0, mb)
        (lm_loss(replica.model(x), y) * weight).backward()
        alone.append([p.grad.clone() for p in replica.params])
        replica.model.zero_grad(set_to_none=True)
    with replica._folding_each_backward():
        for mb, weight in passes:
            x, y = sampler.microbatch(0, mb)
            (lm_loss(replica.model(x), y) * weight).backward()
            assert all(p.grad is None for p in replica.params) is deterministic
    replica._fold()
    for i, buf in enumerate(replica.buffers):
        if deterministic:
            assert torch.equal(buf, alone[0][i].double() + alone[2][i].double())
        else:
            torch.testing.assert_close(buf, alone[0][i] + alone[2][i])


def test_transfer_state_round_trip() -> None:
    sampler = _Sampler()
    src = Replica(CFG, TC, sampler)
    src.compute(0, [0])
    src.apply(src.payload(), 1, 0, src.totals(src.payload()).sum_norm)
    dst = Replica(CFG, TrainingConfig(seed=4), sampler)
    counters = dst.load_transfer_state(src.transfer_state({"step": 7, "data_step": 9}))
    assert counters == {"step": 7, "data_step": 9}
    for p, q in zip(src.params, dst.params, strict=True):
        assert torch.equal(p, q)
        s, d = src.optimizer.state[p], dst.optimizer.state[q]
        assert s.keys() == d.keys() and all(torch.equal(s[k], d[k]) for k in s)
    with pytest.raises(ValueError, match="lacks parameters"):
        dst.load_transfer_state({"counter.step": torch.tensor(1)})


def test_an_emulated_device_makes_each_microbatch_take_its_time_and_changes_no_number() -> None:
    import time

    sampler = _Sampler()
    plain, slow = Replica(CFG, TC, sampler), Replica(CFG, TrainingConfig(**{**TC.__dict__, "device_time_s": 0.2}),
                                                       sampler)
    plain.compute(0, [0, 1, 2])
    t0 = time.perf_counter()
    slow.compute(0, [0, 1, 2])
    assert time.perf_counter() - t0 >= 0.6  # 3 microbatches of at least 0.2 s each
    assert all(torch.equal(a, b) for a, b in zip(plain.payload(), slow.payload(), strict=True))


def test_compiled_blocks_train_like_eager_ones() -> None:
    """``training.compile`` compiles each block in place (names unchanged); the aot_eager backend traces
    forward and backward without generating kernels (inductor, the default, is for GPUs: minutes on CPU)."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    eager = Replica(cfg, TC, _Sampler())
    compiled = Replica(cfg, dataclasses.replace(TC, compile=True, compile_backend="aot_eager"), _Sampler())
    assert compiled.names == eager.names
    assert all(b._compiled_call_impl is not None for b in compiled.model.layers.values())
    for r in (eager, compiled):
        r.compute(0, [0, 1])
    assert compiled.loss_sum == pytest.approx(eager.loss_sum, rel=1e-6)
    for a, b in zip(compiled.payload(), eager.payload(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
