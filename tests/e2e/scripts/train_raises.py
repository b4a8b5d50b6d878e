"""The README's example with a bug: the replica computing microbatch ID of step STEP raises (``RAISE=STEP:ID``).
``RAISE_ONCE=FILE``: only the first process that meets it raises (it creates FILE), so the exception is met once.
``MB_S=seconds``: each microbatch takes at least that long (time for a replacement to join; no number changes)."""
import os
import time

import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 32, 4, 6, 12
AT_STEP, AT_ID = (int(x) for x in os.environ["RAISE"].split(":"))
ONCE = os.environ.get("RAISE_ONCE")
MB_S = float(os.environ.get("MB_S", "0"))


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(step * 1000 + i))
    return tokens[:, :-1], tokens[:, 1:]


def check(step: int, mb: int | None) -> None:
    if step == AT_STEP and mb == AT_ID:
        if ONCE:
            try:
                os.close(os.open(ONCE, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        raise ValueError(f"bad microbatch {mb} of step {step}")


rt = recover.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(V, 64), nn.Linear(64, V)).to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, clip=1.0, tokens_per_microbatch=B * T)
for step in job.steps(STEPS):
    for mb in step:
        check(step.index, mb.id)
        time.sleep(MB_S)
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
