"""The README's example with one contract broken (``BREAK``): ``replica_samples``, a ``samples`` that reads the
replica (pure in each process, another function in each replica); ``unseeded``, the model built without a seed."""
import os

import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 16, 2, 4, 6
BREAK = os.environ["BREAK"]
rt = recover.init()


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = step * 1000 + i + (rt.replica if BREAK == "replica_samples" else 0)
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


if BREAK != "unseeded":
    torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, 32), nn.Linear(32, V)).to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=1.0)
for step in job.steps(STEPS):
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
