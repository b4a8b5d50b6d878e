"""The README's example, 20 steps of 4 microbatches, each microbatch taking at least 0.15 s (emulated devices;
SLOW_S=seconds for another floor, which changes no number):
time enough for a notice to one replica and its replacement to join (the cluster tier: tests/cluster/)."""
import os
import time

import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 16, 2, 4, 20
FLOOR_S = float(os.environ.get("SLOW_S", "0.15"))


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(step * 1000 + i))
    return tokens[:, :-1], tokens[:, 1:]


rt = recover.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, 32), nn.Linear(32, V)).to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=1.0)
for step in job.steps(STEPS):
    for mb in step:
        t0 = time.perf_counter()
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        time.sleep(max(0.0, FLOOR_S - (time.perf_counter() - t0)))
