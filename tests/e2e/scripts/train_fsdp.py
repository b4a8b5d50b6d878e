"""A user's loop with their own FSDP2 inside each replica: `fully_shard` on `recover.init().mesh`. Run by
tests/e2e/test_own_loop.py under `recover launch --fsdp 2 -- python THIS` (also runs alone: one process)."""
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import recover

V, T, B, M, STEPS = 64, 16, 2, 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks, self.out = nn.Embedding(V, 32), nn.ModuleList([Block(), Block()]), nn.Linear(32, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + i)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


rt = recover.init()
torch.manual_seed(0)
model = LM().to(rt.device)
if rt.mesh is not None:  # the user's own sharding plan, on the replica's mesh
    for block in model.blocks:
        fully_shard(block, mesh=rt.mesh["fsdp"])
    fully_shard(model, mesh=rt.mesh["fsdp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=1.0, tokens_per_microbatch=B * T)
for step in job.steps(STEPS):
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    if rt.rank == 0:
        print(f"loss {step.loss!r}", flush=True)
