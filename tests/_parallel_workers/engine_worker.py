"""torchrun worker: 2 replicas of ``pp x fsdp x tp`` ranks in one job, trained with ReplicaEngine.

Replica ``q`` is global ranks ``q*P .. q*P+P-1``; its mesh and group are built with the
intra-replica timeout. Layer 1 is emulated by one plain gloo group per replica-local rank ``k``
(rank ``k`` of both replicas) that sums the payloads. The ids each replica computes follow
``common.PLANS``. Writes ``replica{q}.json`` (losses, grad norms, step times, ledgers, group
timeouts) from each replica's local rank 0 and ``params_r{q}_s{stage}.pt`` (a stage's whole
parameters) from the (fsdp 0, tp 0) rank of each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _parallel_workers.common import PLANS, SEED, M, make_sampler, model_cfg, train_cfg  # noqa: E402
from recover.parallel import MeshAxis, ParallelDims, ReplicaEngine  # noqa: E402
from recover.recovery.accumulator import GradAccumulator  # noqa: E402
from recover.train.dist import DistReducer  # noqa: E402
from recover.train.optim import build_optimizer, lr_at, set_lr  # noqa: E402

REPLICAS = 2


def timeout_of(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tied", type=int, default=0)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--ac", type=int, default=0)
    ap.add_argument("--sp", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="intra-replica timeout (s)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the job's default group (not used by the engine)
    dims = ParallelDims(pp=a.pp, tp=a.tp, fsdp=a.fsdp)
    P, rank = dims.world, dist.get_rank()
    assert dist.get_world_size() == P * REPLICAS, "launch 2 x pp x fsdp x tp processes"
    q, k = divmod(rank, P)
    # every rank builds both replicas' mesh and group, in the same order (new_group is collective)
    spans = [list(range(r * P, (r + 1) * P)) for r in range(REPLICAS)]
    meshes = [dims.build_mesh("cpu", a.timeout, ranks=span) for span in spans]
    groups = [dims.build_group(a.timeout, ranks=span) for span in spans]
    cross = [dist.new_group([r * P + j for r in range(REPLICAS)], timeout=timedelta(seconds=60)) for j in range(P)]
    timeouts = [timeout_of(groups[q])] + [timeout_of(meshes[q][axis.value].get_group()) for axis in MeshAxis]

    tc = train_cfg(len(PLANS))
    engine = ReplicaEngine(model_cfg(bool(a.tied)), SEED, dims, meshes[q], groups[q], schedule=a.schedule,
                           activation_checkpointing=bool(a.ac), sequence_parallel=bool(a.sp))
    optimizer = build_optimizer(engine.model, tc)
    sampler = make_sampler(Path(a.data))
    reducer = DistReducer(cross[k])  # layer 1 stand-in: rank k of every replica
    losses, norms, times, ledgers = [], [], [], []
    for step, plan in enumerate(PLANS):
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, tc))
        engine.reset()
        for ids in plan[q]:
            engine.compute(step, ids, sampler)
        reduced = reducer.allreduce(engine.payload())
        loss_sum, count = GradAccumulator.totals(reduced)
        assert count == M, f"step {step}: {count} microbatches reduced, expected {M}"
        norms.append(engine.apply(reduced, M, optimizer, tc.grad_clip))
        losses.append(loss_sum / M)
        times.append(time.perf_counter() - t0)
        ledgers.append(list(engine.ledger))
    params = engine.full_parameters()
    out = Path(a.out)
    if engine.coord.fsdp == 0 and engine.coord.tp == 0:
        torch.save(params, out / f"params_r{q}_s{engine.coord.pp}.pt")
    if k == 0:
        (out / f"replica{q}.json").write_text(json.dumps({"losses": losses, "norms": norms, "times": times,
                                                          "ledgers": ledgers, "timeouts": timeouts}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded on a busy 2-core box)


if __name__ == "__main__":
    main()
