"""The README's example with what framework users bring along: a torch LR scheduler as the schedule, an
evaluation every 4 steps (`Job(evaluate=..., eval_every=4)`), its own metrics (`job.log`) and, with `SCALER=1`, a
GradScaler whose first scale overflows (its update skipped, the scale backing off)."""
import os

import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 16, 2, 4, 8


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(step * 1000 + i))
    return tokens[:, :-1], tokens[:, 1:]


rt = recover.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, 32), nn.Linear(32, V)).to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))


@torch.no_grad()
def evaluate() -> float:
    x, y = sample(10**6, 0)
    return float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))


scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**200, backoff_factor=2.0**-40, growth_interval=3)
          if os.environ.get("SCALER") == "1" else None)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=scheduler, evaluate=evaluate, eval_every=4,
                  scaler=scaler)
for step in job.steps(STEPS):
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    job.log(double_loss=2 * step.loss)
