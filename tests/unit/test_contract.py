"""The contracts of `recover.api` checked, not trusted: an optimizer over another model's parameters, a `samples`
that draws from the global RNG or keeps a running cursor are refused in one line naming the fix, where they
used to train a wrong result with exit 0 (nothing trained; a run that differs from its own failure-free run)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import recover
from recover.errors import ContractError
from recover.train.replicas.contract import PureSamples, same

M = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))


def pure(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(100 * step + i))


def train(samples, steps: int = 2, **kwargs) -> list[float]:
    net = model()
    job = recover.Job(net, torch.optim.AdamW(net.parameters(), lr=1e-2), samples=samples, microbatches=M, **kwargs)
    losses = []
    for step in job.steps(steps):
        for mb in step:
            mb.backward(nn.functional.cross_entropy(net(mb.batch).flatten(0, 1), mb.batch.flatten()))
        losses.append(step.loss)
    return losses


def test_an_optimizer_over_another_models_parameters_is_refused_at_job() -> None:
    net, other = model(), model()
    with pytest.raises(ContractError, match=r"3 of its 3 parameters that are not the model's.*model.parameters\(\)"):
        recover.Job(net, torch.optim.AdamW(other.parameters()), samples=pure, microbatches=M)
    recover.Job(net, torch.optim.AdamW(net.parameters()), samples=pure, microbatches=M)  # its own: accepted


@pytest.mark.parametrize("prefetch", [0, 2])
def test_samples_from_the_global_rng_are_refused_at_the_first_step(prefetch: int) -> None:
    def global_rng(step: int, i: int) -> torch.Tensor:
        return torch.randint(0, 32, (2, 8))

    with pytest.raises(ContractError, match=r"samples\(0, 0\) returned a different batch.*global RNG"):
        train(global_rng, prefetch=prefetch)


def test_samples_with_a_running_cursor_are_refused() -> None:
    data = torch.arange(10_000).remainder(32).view(-1, 2, 8)
    cursor = itertools.count()

    def running(step: int, i: int) -> torch.Tensor:
        return data[next(cursor)]

    with pytest.raises(ContractError, match="not a pure function of"):
        train(running)


def test_numpy_global_rng_is_caught_and_a_pure_samples_trains_unchecked_alike() -> None:
    def numpy_rng(step: int, i: int) -> dict[str, object]:
        return {"x": torch.from_numpy(np.random.randint(0, 32, (2, 8)))}

    with pytest.raises(ContractError):
        PureSamples(numpy_rng)(3, 1)
    assert train(pure, steps=3) == train(pure, steps=3, check_samples=False)


def test_same_compares_batches_bitwise() -> None:
    a = (torch.tensor([1.0, float("nan")]), {"k": [1, "s"]})
    assert same(a, (a[0].clone(), {"k": [1, "s"]}))
    assert not same(a, (torch.tensor([1.0, 2.0]), {"k": [1, "s"]}))
    assert not same(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same([torch.zeros(1)], (torch.zeros(1),))
