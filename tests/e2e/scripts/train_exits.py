"""The README's example loop, whose replicas named in EXITS end themselves. EXITS is a JSON object, replica id
-> {"when", "how", "times"}: `when` is `start` (before it registers: before the first generation) or a step
number (as that step begins), `how` is `2`, `1` or `segv`; only `times` times (counted in the file
EXIT_COUNT.R; default: every time). `how` `release` or `wire` instead makes it register as another recover
release, or speak another wire protocol; `clock` steps its wall clock an hour forward (as NTP may); `oom` moves
it into the memory cgroup OOM_CGROUP at the start and allocates far beyond that cgroup's limit at `when` (the
kernel's OOM killer ends it). STEP_PAUSE_S makes each step that much longer. Run by
tests/e2e/test_replica_exits.py under `recover launch -- python THIS`."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import recover

V, T, B, M, STEPS = 96, 32, 4, 6, 12
me = json.loads(os.environ["RECOVER_WORKER"])["replica"]
mine = json.loads(os.environ.get("EXITS", "{}")).get(str(me))
doomed = mine is not None


def maybe_exit(now: str) -> None:
    if not doomed or mine["when"] != now:
        return
    count = Path(f"{os.environ['EXIT_COUNT']}.{me}")
    times = int(count.read_text()) if count.exists() else 0
    if times >= int(mine.get("times", 1000)):
        return
    count.write_text(str(times + 1))
    how = mine["how"]
    print(f"replica {me}: ending itself ({how}) at {now}, time {times + 1}", flush=True)
    if how == "oom":  # the kernel ends it
        print(f"replica {me}: allocating beyond its cgroup's limit", flush=True)
        hog = bytearray(8 << 30)  # zero-filled: every page touched
        print(f"replica {me}: still alive with {len(hog)} bytes", flush=True)
        return
    if how == "clock":  # not an exit: its wall clock jumps
        import time

        real = time.time
        time.time = lambda: real() + 3600.0
        return
    if how in ("release", "wire"):  # not an exit: another release's replica
        import recover.coord.client
        import recover.coord.protocol

        if how == "release":
            recover.coord.client.RELEASE = "0.0.0-other"
        else:
            recover.coord.protocol.PROTOCOL_VERSION += 1
        return
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.stdout.flush()
    os._exit(int(how))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mlp = nn.Embedding(V, 64), nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x))


def sample(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + i)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


if doomed and mine["how"] == "oom":
    Path(os.environ["OOM_CGROUP"], "cgroup.procs").write_text(str(os.getpid()))
maybe_exit("start")
rt = recover.init()
torch.manual_seed(0)
model = TinyLM().to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = recover.Job(model, optimizer, samples=sample, microbatches=M, lr=lambda s: 3e-3 * min(1.0, (s + 1) / 4),
                  clip=1.0, tokens_per_microbatch=B * T)
pause = float(os.environ.get("STEP_PAUSE_S", "0"))  # a slower step (changes no number)
for step in job.steps(STEPS):
    maybe_exit(str(step.index))
    time.sleep(pause)
    for mb in step:
        x, y = mb.batch
        mb.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
