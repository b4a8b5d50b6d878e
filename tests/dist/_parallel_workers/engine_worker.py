"""torchrun worker: runs, one after another, training runs of 1 or 2 replicas of ``pp x fsdp x tp`` ranks.

Each ``--spec NAME:key=value,...`` (keys: pp, tp, fsdp, replicas, tied, schedule, ac, sp, det: deterministic
mode, other: ``common.OTHER_PLANS``, splits) must use
every process of the job (``replicas x pp x fsdp x tp``); running several in one job saves a
torchrun start and the torch imports of every process. In a run, replica ``q`` is global ranks
``q*P .. q*P+P-1``; its mesh and group carry the intra-replica timeout. Layer 1 is emulated by one
plain gloo group per replica-local rank ``k`` (rank ``k`` of every replica) that sums the
payloads. The ids each replica computes follow ``common.plan``. A run writes, under ``OUT/NAME/``,
``replica{q}.json`` (losses, grad norms, step times, ledgers, group timeouts) from each replica's
local rank 0 and ``params_r{q}_s{stage}.pt`` (a stage's whole parameters) from the (fsdp 0, tp 0)
rank of each stage. A run with ``splits=1`` does not train: every replica computes the same ids of
one step in several splits and orders (:func:`splits`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _parallel_workers.common import SEED, STEPS, M, make_sampler, model_cfg, plan, train_cfg  # noqa: E402
from recover.parallel import MeshAxis, ParallelDims  # noqa: E402
from recover.train.replicas.dist import StaticGroup  # noqa: E402
from recover.train.replicas.replica import Replica  # noqa: E402

DEFAULTS: dict[str, Any] = {"pp": 1, "tp": 1, "fsdp": 1, "replicas": 2, "tied": 0, "schedule": "1f1b", "ac": 0,
                            "sp": 0, "det": 0, "other": 0, "splits": 0}


def parse_run(spec: str) -> tuple[str, dict[str, Any]]:
    """``"pp2:pp=2,schedule=gpipe"`` -> ``("pp2", {...defaults updated...})``."""
    name, _, opts = spec.partition(":")
    run = dict(DEFAULTS)
    for item in filter(None, opts.split(",")):
        key, value = item.split("=")
        run[key] = value if isinstance(DEFAULTS[key], str) else int(value)
    return name, run


def timeout_of(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def layout(run: dict[str, Any], timeout_s: float) -> tuple[ParallelDims, int, int, list[Any], list[Any]]:
    """(dims, this rank's replica q, its replica-local rank k, every replica's mesh, every replica's group)."""
    dims = ParallelDims(pp=run["pp"], tp=run["tp"], fsdp=run["fsdp"])
    P, R, rank = dims.world, run["replicas"], dist.get_rank()
    assert dist.get_world_size() == P * R, f"{run}: launch replicas x pp x fsdp x tp processes"
    q, k = divmod(rank, P)
    # every rank builds every replica's mesh and group, in the same order (new_group is collective)
    spans = [list(range(r * P, (r + 1) * P)) for r in range(R)]
    meshes = [dims.build_mesh("cpu", timeout_s, ranks=span) for span in spans]
    groups = [dims.build_group(timeout_s, ranks=span) for span in spans]
    return dims, q, k, meshes, groups


def replica(run: dict[str, Any], data: Path, dims: ParallelDims, mesh: Any, group: Any,
            deterministic: bool = False) -> Replica:
    tc = train_cfg(STEPS, deterministic)
    assert tc.seed == SEED
    return Replica(model_cfg(bool(run["tied"])), tc, make_sampler(data), dims, mesh, group,
                   schedule=run["schedule"], activation_checkpointing=bool(run["ac"]),
                   sequence_parallel=bool(run["sp"]))


def train(run: dict[str, Any], data: Path, out: Path, timeout_s: float) -> None:
    dims, q, k, meshes, groups = layout(run, timeout_s)
    P, R = dims.world, run["replicas"]
    cross = [dist.new_group([r * P + j for r in range(R)], timeout=timedelta(seconds=60)) for j in range(P)]
    timeouts = [timeout_of(groups[q])] + [timeout_of(meshes[q][axis.value].get_group()) for axis in MeshAxis]

    engine = replica(run, data, dims, meshes[q], groups[q], bool(run["det"]))
    lane = StaticGroup(R, q, cross[k])  # layer 1 stand-in: rank k of every replica
    losses, norms, times, ledgers = [], [], [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        engine.reset()
        for ids in plan(step, q, R, bool(run["other"])):
            engine.compute(step, ids)
        reduced = lane.allreduce(engine.payload())
        t = engine.totals(reduced)
        assert t.microbatches == M, f"step {step}: {t.microbatches} microbatches reduced, expected {M}"
        norms.append(engine.apply(reduced, M, step, t.sum_norm))
        losses.append(t.loss_sum / M)
        times.append(time.perf_counter() - t0)
        ledgers.append(list(engine.ledger))
    params = engine.full_parameters()
    out.mkdir(parents=True, exist_ok=True)
    if engine.coord.fsdp == 0 and engine.coord.tp == 0:
        torch.save(params, out / f"params_r{q}_s{engine.coord.pp}.pt")
    if k == 0:
        (out / f"replica{q}.json").write_text(json.dumps({"losses": losses, "norms": norms, "times": times,
                                                          "ledgers": ledgers, "timeouts": timeouts}))
    dist.barrier()


SPLITS = [[list(range(M))], [[3, 1], [7, 0, 5, 2, 6, 4]], [[6], [5, 4, 3, 2, 1, 0, 7]]]
"""The same M ids of one step in compute() calls of other sizes and orders (a call of one id, below pp,
takes the GPipe fallback of a 1F1B replica)."""


def splits(run: dict[str, Any], data: Path, out: Path, timeout_s: float) -> None:
    """Every replica computes the M ids of step 0 in each split of ``SPLITS``, in deterministic and in default
    mode; each rank writes ``splits_rank{rank}.json``: per mode, whether its payloads (gradient buffers and
    stats) were bitwise equal in every split."""
    dims, q, _, meshes, groups = layout(run, timeout_s)
    equal = {}
    for deterministic in (True, False):
        engine = replica(run, data, dims, meshes[q], groups[q], deterministic)
        payloads = []
        for calls in SPLITS:
            engine.reset()
            for ids in calls:
                engine.compute(0, ids)
            payloads.append([t.clone() for t in engine.payload()])
        equal["deterministic" if deterministic else "default"] = all(
            torch.equal(a, b) for other in payloads[1:] for a, b in zip(payloads[0], other, strict=True))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"splits_rank{dist.get_rank()}.json").write_text(json.dumps(equal))
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", action="append", required=True, help="NAME:key=value,... (repeatable)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=20.0, help="intra-replica timeout (s)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the job's group (not used by the engine)
    for spec in a.spec:
        name, run = parse_run(spec)
        (splits if run["splits"] else train)(run, Path(a.data), Path(a.out) / name, a.timeout)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds with torch loaded on a busy 2-core box)


if __name__ == "__main__":
    main()
