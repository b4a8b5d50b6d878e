"""`recover.api` in one process (no launch): a Job's update equals the plain gradient-accumulation loop, every
microbatch's RNG follows (seed, step, id), and a loop that skips a microbatch is told which one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import recover
from recover.train.replicas.steps import microbatch_seed

M, CLIP = 4, 0.5


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Dropout(0.1), nn.Linear(16, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def sample(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(100 * step + i))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def test_a_job_is_plain_gradient_accumulation_divided_by_m_and_clipped() -> None:
    model, optimizer = model_and_optimizer()
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda s: 1e-2 / (s + 1), clip=CLIP,
                      seed=7)
    losses = []
    for step in job.steps(3):
        for mb in step:
            mb.backward(loss_of(model, mb.batch))
        losses.append(step.loss)
        assert step.microbatches == M

    plain, opt = model_and_optimizer()
    for s in range(3):
        total = 0.0
        for i in range(M):
            torch.manual_seed(microbatch_seed(7, s, i))  # dropout follows the sample
            loss = loss_of(plain, sample(s, i))
            (loss / M).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        for g in opt.param_groups:
            g["lr"] = 1e-2 / (s + 1)
        opt.step()
        opt.zero_grad()
        assert losses[s] == pytest.approx(total / M, rel=1e-6)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_microbatch_seeds_are_a_pure_function_of_seed_step_and_id() -> None:
    assert microbatch_seed(1, 2, 3) == microbatch_seed(1, 2, 3)
    assert len({microbatch_seed(1, s, i) for s in range(20) for i in range(20)}) == 400


def test_a_loop_that_skips_a_microbatch_is_told_which() -> None:
    model, optimizer = model_and_optimizer()
    job = recover.Job(model, optimizer, samples=sample, microbatches=M)
    with pytest.raises(RuntimeError, match=r"microbatches \[3\] were handed out but not backwarded"):
        for step in job.steps(1):
            for mb in step:
                if mb.id != 3:
                    mb.backward(loss_of(model, mb.batch))


def test_token_shards_are_samples_for_a_job(corpus: Path, tmp_path: Path) -> None:
    """``recover.data.tokens``: the built-in trainer's (seed, step, id) windows, checked against the vocabulary."""
    from recover.data import DataError, tokens

    samples = tokens(corpus, seq_len=16, microbatch_size=2, microbatches=M, seed=3)
    assert samples.vocab_size is not None and samples.tokens_per_microbatch == 32  # the data's, documented
    x, y = samples(5, 1)
    assert int(x.max()) < samples.vocab_size
    assert x.shape == y.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(samples(5, 1)[0], x) and not torch.equal(samples(5, 2)[0], x)  # pure, per id
    with pytest.raises(DataError, match="vocab"):
        tokens(corpus, seq_len=16, microbatch_size=2, microbatches=M, vocab_size=8)
    with pytest.raises(DataError):
        tokens(tmp_path, seq_len=16, microbatch_size=2, microbatches=M)  # no training split there


def test_a_map_style_dataset_is_samples_for_a_job() -> None:
    """``recover.data.indexed``: per step B*M distinct indices, each epoch a seeded permutation, pure in (step, id)."""
    from recover.data import indexed

    class Squares:  # any __len__ + __getitem__
        def __len__(self) -> int:
            return 50

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.tensor([i, i * i]), i

    B = 3
    samples = indexed(Squares(), microbatch_size=B, microbatches=M, seed=5)
    x, ids = samples(2, 1)
    assert x.shape == (B, 2) and torch.equal(x[:, 0], ids) and torch.equal(x[:, 1], ids * ids)  # default_collate
    assert torch.equal(samples(2, 1)[1], ids) and samples.indices(2, 1) == ids.tolist()  # pure
    per_epoch = 50 // (B * M)  # 4 steps; 2 indices a pass are left undrawn
    for epoch in range(2):
        drawn = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for mb in range(M)
                 for i in samples.indices(s, mb)]
        assert len(drawn) == len(set(drawn)) == per_epoch * B * M  # no index twice in an epoch
    assert samples.indices(0, 0) != samples.indices(per_epoch, 0)  # each epoch its own order
    again = indexed(Squares(), microbatch_size=B, microbatches=M, seed=5)
    assert [again.indices(s, i) for s in (9, 0) for i in range(M)] == [samples.indices(s, i) for s in (9, 0)
                                                                      for i in range(M)]  # any call order
    assert indexed(Squares(), collate=list, microbatch_size=B, microbatches=M)(0, 0)[0][1] in range(50)
    with pytest.raises(ValueError, match="50 samples, fewer than the 52 one step draws"):
        indexed(Squares(), microbatch_size=13, microbatches=M)
    with pytest.raises(ValueError, match=r"microbatch id = 4: it must be in 0..3"):
        samples(0, M)


class Hooked(nn.Module):
    """A module whose state dict is not its state: a hook adds a derived copy (as torchtitan's fused QKV saves
    ``wq``/``wk``/``wv``) and ``get_extra_state`` an object; a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("cache", torch.arange(4.0), persistent=False)
        self.register_state_dict_post_hook(
            lambda module, sd, prefix, meta: sd.__setitem__(prefix + "half", module.lin.weight[:2].detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.cache

    def get_extra_state(self) -> dict:
        return {"version": 1}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_a_joiner_receives_the_parameters_and_persistent_buffers_not_what_state_dict_hooks_derive() -> None:
    from recover.train.replicas.own import OwnReplica

    def replica(seed: int) -> tuple[nn.Module, OwnReplica]:
        torch.manual_seed(seed)
        model = nn.Sequential(Hooked(), nn.BatchNorm1d(4))
        return model, OwnReplica(model, torch.optim.AdamW(model.parameters()), lr=None, clip=0.0,
                                 deterministic=True, device=torch.device("cpu"))

    live, sender = replica(0)
    live[0].count.fill_(5.0)
    live(torch.randn(3, 4)).sum().backward()  # BatchNorm's running statistics move; AdamW gets state
    sender.optimizer.step()
    state = sender.transfer_state({"step": 7})  # the extra state (a dict) was once sent as a tensor: it crashed
    assert {k for k in state if k.startswith("model.")} == {f"model.{n}" for n in (
        "0.lin.weight", "0.lin.bias", "1.weight", "1.bias", "0.count", "1.running_mean", "1.running_var",
        "1.num_batches_tracked")}
    joiner, receiver = replica(1)
    assert receiver.load_transfer_state(state) == {"step": 7}
    for (name, a), b in zip(live.state_dict().items(), joiner.state_dict().values(), strict=True):
        assert name.endswith("_extra_state") or torch.equal(a, b), name
    for p, q in zip(live.parameters(), joiner.parameters(), strict=True):
        assert torch.equal(sender.optimizer.state[p]["exp_avg"], receiver.optimizer.state[q]["exp_avg"])
    assert torch.equal(joiner[0].cache, torch.arange(4.0))  # non-persistent: the joiner's own construction's


def test_the_loss_of_a_step_not_yet_committed_is_a_clear_error() -> None:
    """`step.loss` inside the microbatch loop used to be "'NoneType' object has no attribute 'loss'"."""
    model, optimizer = model_and_optimizer()
    job = recover.Job(model, optimizer, samples=sample, microbatches=M)
    for step in job.steps(1):
        for mb in step:
            with pytest.raises(RuntimeError, match="step 0 is not committed yet: read step.loss.*after its"):
                _ = step.loss
            mb.backward(loss_of(model, mb.batch))
        assert step.loss > 0


def test_recover_data_is_reachable_after_import_recover_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`recover.data.tokens(...)` after `import recover` used to be an AttributeError until something (recover.init)
    had imported the package: here the package is forgotten, as in a fresh interpreter, and reached again."""
    import sys

    for name in [k for k in sys.modules if k == "recover.data" or k.startswith("recover.data.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test, as is the attribute below
    monkeypatch.delattr(recover, "data", raising=False)
    assert callable(recover.data.tokens) and callable(recover.data.indexed)


def test_a_second_backward_of_one_microbatch_is_refused_where_it_happens() -> None:
    model, optimizer = model_and_optimizer()
    job = recover.Job(model, optimizer, samples=sample, microbatches=M)
    for step in job.steps(1):
        for mb in step:
            mb.backward(loss_of(model, mb.batch))
            with pytest.raises(RuntimeError, match=rf"mb.backward\(\) called twice for microbatch {mb.id} of step 0"):
                mb.backward(loss_of(model, mb.batch))


def test_a_torch_lr_scheduler_is_the_schedule_stepped_once_per_committed_step() -> None:
    model, optimizer = model_and_optimizer()
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=sched, clip=CLIP, seed=7)
    for step in job.steps(3):
        for mb in step:
            mb.backward(loss_of(model, mb.batch))
    assert sched.last_epoch == 3 and job.replica.applied_lr == pytest.approx(1e-2 / 3)

    plain, opt = model_and_optimizer()
    plain_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for s in range(3):
        for i in range(M):
            torch.manual_seed(microbatch_seed(7, s, i))
            (loss_of(plain, sample(s, i)) / M).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        plain_sched.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "lr_scheduler" in job.replica.extra  # carried to joiners and checkpoints


def test_an_evaluation_hook_runs_after_every_kth_and_the_last_step_and_job_log_takes_numbers() -> None:
    model, optimizer = model_and_optimizer()
    calls = []

    def evaluate() -> float:
        calls.append(1)
        return 0.5 * len(calls)

    job = recover.Job(model, optimizer, samples=sample, microbatches=M, evaluate=evaluate, eval_every=2)
    seen = []
    for step in job.steps(5):
        for mb in step:
            mb.backward(loss_of(model, mb.batch))
        seen.append(step.val_loss)
        job.log(acc=torch.tensor(0.25), tokens=3)
        assert job.record_fields()["user"] == {"acc": 0.25, "tokens": 3.0}
    assert seen == [None, 0.5, None, 1.0, 1.5]  # after steps 1, 3 and the last (4)
    with pytest.raises(TypeError, match="job.log\\(name=...\\): str is not a number"):
        job.log(name="x")


def test_user_metrics_go_to_the_dashboards_as_user_scalars() -> None:
    from recover.observe.sinks import scalars

    assert scalars({"step": 3, "loss": 2.0, "user": {"acc": 0.5}}) == {"train/loss": 2.0, "user/acc": 0.5}


def scaled_run(scaler: object | None, steps: int = 4) -> tuple[nn.Module, list[float]]:
    model, optimizer = model_and_optimizer()
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=CLIP, seed=7, scaler=scaler)
    norms = []
    for step in job.steps(steps):
        for mb in step:
            mb.backward(loss_of(model, mb.batch))
        norms.append(step.grad_norm)
    return model, norms


def test_a_power_of_two_loss_scale_trains_bitwise_as_without_it() -> None:
    plain, _ = scaled_run(None)
    scaled, _ = scaled_run(torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), scaled.parameters(), strict=True))


def test_an_overflowed_step_skips_its_update_and_the_scale_backs_off_then_grows() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**200, backoff_factor=2.0**-40, growth_interval=2)
    model, norms = scaled_run(scaler, steps=5)
    fresh, _ = model_and_optimizer()
    assert not math.isfinite(norms[0]) and all(n < 1e6 for n in norms[2:])  # 2**200, then 2**160: overflow
    skipped = sum(1 for n in norms if not math.isfinite(n))
    assert scaler.get_scale() == 2.0 ** (200 - 40 * skipped) * 2.0 ** ((5 - skipped) // 2)  # grown every 2 steps
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    model, _ = scaled_run(torch.amp.GradScaler("cpu", init_scale=2.0**200, backoff_factor=2.0**-40), steps=skipped)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))  # no update
