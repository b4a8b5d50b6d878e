"""Checkpoints and extra state of a user's model (`Job.save`, `Job(resume=)`, `Job(extra=)`) in one process: a
run saved at step k and resumed is bitwise the uninterrupted run (model, optimizer, an EMA and an LR scheduler);
the extra state survives a state transfer bitwise as tensors only; a damaged checkpoint falls back to the older
one, another model's is refused in one line with nothing loaded, and only the lowest live replica writes."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import recover
from recover.comm.transfer import DTYPES
from recover.errors import CheckpointError, IncompatibleCheckpoint
from recover.recovery.protocol import Progress

M, CLIP, TOTAL = 3, 0.5, 6


class EMA(nn.Module):
    """An exponential moving average of a model's parameters, updated after each step."""

    def __init__(self, model: nn.Module, decay: float = 0.8) -> None:
        super().__init__()
        self.shadow, self.decay = copy.deepcopy(model).requires_grad_(False), decay
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for e, p in zip(self.shadow.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 1 - self.decay)
        self.updates += 1


def sample(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(100 * step + i))


def build(init_seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer, EMA, object]:
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Embedding(32, width), nn.Dropout(0.1), nn.Linear(width, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, EMA(model), torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))


def train(total: int, *, init_seed: int = 0, save_to: Path | None = None, save_every: int = 0,
          resume: Path | None = None, keep: int = 3) -> tuple[recover.Job, list[int]]:
    """The user's loop: the EMA and the scheduler step after each committed step; returns the job and the steps."""
    model, optimizer, ema, sched = build(init_seed)
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=None, clip=CLIP, deterministic=True,
                      extra={"ema": ema, "sched": sched}, resume=resume)
    seen = []
    for step in job.steps(total):
        for mb in step:
            mb.backward(nn.functional.cross_entropy(model(mb.batch).flatten(0, 1), mb.batch.flatten()))
        ema.update(model)
        sched.step()
        seen.append(step.index)
        if save_to is not None and save_every and (step.index + 1) % save_every == 0:
            job.save(save_to, keep=keep)
    return job, seen


def tensors_of(job: recover.Job) -> dict[str, torch.Tensor]:
    """Every tensor that decides the rest of the run: parameters, optimizer state, the EMA."""
    out = {f"model.{k}": v for k, v in job.model.state_dict().items()}
    for i, state in job.replica.optimizer.state_dict()["state"].items():
        out |= {f"optim.{i}.{k}": v for k, v in state.items()}
    return out | {f"ema.{k}": v for k, v in job.replica.extra["ema"].state_dict().items()}


def assert_bitwise(a: recover.Job, b: recover.Job) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert a.replica.extra["sched"].state_dict() == b.replica.extra["sched"].state_dict()
    assert [g["lr"] for g in a.replica.optimizer.param_groups] == [g["lr"] for g in b.replica.optimizer.param_groups]


@pytest.fixture(scope="module")
def reference() -> recover.Job:
    return train(TOTAL)[0]


def test_a_run_saved_and_resumed_is_bitwise_the_uninterrupted_run(reference: recover.Job, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first, seen = train(3, save_to=tmp_path, save_every=3)
    assert seen == [0, 1, 2] and (tmp_path / "checkpoints" / "step_000003" / "COMMITTED").is_file()
    resumed, seen = train(TOTAL, init_seed=1, resume=tmp_path)  # other initial weights: all of it is loaded
    assert seen == [3, 4, 5]
    assert "resumed from" in capsys.readouterr().err
    assert resumed.protocol.progress.step == TOTAL and resumed.protocol.progress.data_step == TOTAL
    assert_bitwise(resumed, reference)


def test_extra_state_survives_a_transfer_bitwise_as_tensors_only(reference: recover.Job) -> None:
    state = reference.replica.transfer_state(reference.protocol.progress.counters())
    assert all(torch.is_tensor(t) and str(t.dtype).removeprefix("torch.") in DTYPES for t in state.values())
    fresh, _ = train(0, init_seed=2)
    counters = fresh.replica.load_transfer_state(state)
    assert Progress.of(counters) == reference.protocol.progress
    assert_bitwise(fresh, reference)


def test_a_damaged_checkpoint_falls_back_to_the_older_one_and_keep_n(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    train(4, save_to=tmp_path, save_every=1, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    shard = next((root / "step_000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    job, seen = train(5, resume=tmp_path)
    assert seen == [3, 4]
    assert "step_000004 is damaged" in capsys.readouterr().err


def test_no_checkpoint_starts_fresh_and_another_model_is_refused_with_nothing_loaded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, seen = train(1, resume=tmp_path)
    assert seen == [0] and "no complete checkpoint" in capsys.readouterr().err
    job.save(tmp_path)
    model, optimizer, ema, sched = build(width=24)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(IncompatibleCheckpoint, match=r"another model \(0.weight: checkpoint \[32, 16\], this model "
                                                     r"\[32, 24\]; and 1 more\)"):
        recover.Job(model, optimizer, samples=sample, microbatches=M, extra={"ema": ema, "sched": sched},
                    resume=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model, optimizer, _, _ = build()
    with pytest.raises(IncompatibleCheckpoint, match=r"holds extra state \['ema', 'sched'\], this Job has no extra"):
        recover.Job(model, optimizer, samples=sample, microbatches=M, resume=tmp_path)


def test_own_checkpoints_are_refused_by_export_and_sample(tmp_path: Path) -> None:
    from recover.train.checkpoints.describe import read_description, resolve_checkpoint

    job, _ = train(1)
    path = job.save(tmp_path)
    with pytest.raises(CheckpointError, match="a model of your own"):
        read_description(resolve_checkpoint(tmp_path))
    assert path == tmp_path / "checkpoints" / "step_000001"


def test_only_the_lowest_live_replica_writes_and_never_inside_a_step(tmp_path: Path) -> None:
    job, _ = train(1)
    busy: list[str] = []
    job._session = SimpleNamespace(client=SimpleNamespace(activity=lambda kind: busy.append(kind) or nullcontext()))
    job.runtime.replica = 2  # as if launched: replicas 1 and 2 live, this one is 2
    group, job.protocol.group = job.protocol.group, SimpleNamespace(members=(1, 2))
    assert job.save(tmp_path) is None and not (tmp_path / "checkpoints").exists() and busy == []
    job.runtime.replica = 1
    assert job.save(tmp_path) == tmp_path / "checkpoints" / "step_000001"
    assert busy == ["io"]  # the coordinator's hang rule does not count the write as a stuck loop
    job._session, job.protocol.group, job.runtime.replica = None, group, 0
    with pytest.raises(RuntimeError, match="inside a step's microbatch loop"):
        for step in job.steps(2):
            for _ in step:
                job.save(tmp_path)


def test_extra_must_have_a_state_dict_of_tensors_numbers_and_containers(tmp_path: Path) -> None:
    model, optimizer, _, _ = build()
    with pytest.raises(TypeError, match=r"extra\['x'\] is a object; give an object with state_dict"):
        recover.Job(model, optimizer, samples=sample, microbatches=M, extra={"x": object()})
    odd = SimpleNamespace(state_dict=lambda: {"fn": print}, load_state_dict=lambda sd: None)
    job = recover.Job(model, optimizer, samples=sample, microbatches=M, extra={"odd": odd})
    with pytest.raises(TypeError, match=r"extra\['odd'\]\['fn'\] is a builtin_function_or_method; extra state"):
        job.save(tmp_path)
