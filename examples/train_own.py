"""Your own model and loop under recover: `python examples/train_own.py` trains one replica; `recover launch
--replicas 3 --steps 12 --fail 1@5:backward --deterministic --out runs/own -- python examples/train_own.py`
trains three through a kill, every step bitwise the failure-free run's."""
import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 32, 4, 6, 12


class TinyLM(nn.Module):  # any causal LM: here, embeddings and an MLP over a window
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mlp = nn.Embedding(V, 64), nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x))


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # a pure function of (step, id)
    g = torch.Generator().manual_seed(step * 1000 + i)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


rt = recover.init()
torch.manual_seed(0)
model = TinyLM().to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda s: 3e-3 * min(1.0, (s + 1) / 4),
                  clip=1.0, tokens_per_microbatch=B * T)
for step in job.steps(STEPS):
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    print(f"step {step.index}: loss {step.loss:.4f}", flush=True)
