"""examples/train_own.py with an LR scheduler as extra state and ``job.save()`` every 3 steps; trains the launch's
``--steps`` (``recover launch ... --resume`` continues from the run directory's newest checkpoint)."""
import torch
from torch import nn

import recover

V, T, B, M = 96, 32, 4, 6


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mlp = nn.Embedding(V, 64), nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x))


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(step * 1000 + i))
    return tokens[:, :-1], tokens[:, 1:]


rt = recover.init()
torch.manual_seed(0)
model = TinyLM().to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=None, clip=1.0, tokens_per_microbatch=B * T,
                  extra=schedule)
for step in job.steps(rt.launched["config"].training.steps):
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    schedule.step()
    if (step.index + 1) % 3 == 0:
        print(f"step {step.index}: saved {job.save()}", flush=True)
