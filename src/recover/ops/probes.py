"""The measurements of ``recover check``, each run in a child process of its own.

Contract:
- ``python -m recover.ops.probes NAME ...`` prints one JSON object on its last stdout line and exits 0
  when it measured; otherwise it exits 1 with one line on stderr naming the error. Every collective is
  bounded by ``--timeout`` (its process group's timeout); the parent also stops the process by its
  process group past its own limit.
- ``gpu``: the one GPU this process sees (the parent sets ``CUDA_VISIBLE_DEVICES``): name, UUID,
  memory, compute capability, a bf16 matmul rate (``n`` x ``n`` by ``n`` x ``n``, warmed up, timed with
  CUDA events), a device-to-device copy's bandwidth (bytes read plus bytes written per second), and an
  NCCL all-reduce on a group of one built by recover's own constructor
  (:func:`recover.comm.backends.make_process_group`), then that communicator's ``abort``.
- ``allreduce``: one rank of a gloo or NCCL all-reduce over the TCPStore the parent hosts: the sum is
  checked, then a few all-reduces are timed (bus bandwidth as nccl-tests defines it).
- ``gradfp``: one microbatch's gradient in deterministic mode (``training.deterministic``, the process
  set up by :func:`recover.train.processes.loop.configure_torch`), model from :func:`recover.model.build_model`,
  loss :func:`recover.model.lm_loss`, tokens drawn from a seeded generator; its exact fingerprint is
  :func:`bit_fingerprint`, the formula of ``Replica.fingerprint``.
- :func:`cpu_matmul_flops` runs in the caller's process (the CPU needs no child).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

MODULE = "recover.ops.probes"
MASK = (1 << 64) - 1
STORE_PREFIX = "recover-check"


# ---------------------------------------------------------------- pieces shared by the probes

def bit_fingerprint(tensors: Sequence[Any]) -> str:
    """The sum, modulo 2**64, of each tensor's bit patterns read as integers, times an odd constant per
    tensor (``2 k + 1``): any single changed bit changes it. 16 hex digits."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for k, t in enumerate(tensors):
        bits = t.detach().contiguous().view(-1).view(ints[t.element_size()])
        total += bits.sum(dtype=torch.int64) * (2 * k + 1)
    return f"{int(total) & MASK:016x}"


def cuda_seconds(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream, by CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def cpu_matmul_flops(n: int = 1024, iters: int = 5) -> dict[str, Any]:
    """float32 matmul FLOP/s of this process's CPU threads (one warm-up, then ``iters`` timed)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b, out=out)
    dt = time.perf_counter() - t0
    return {"flops": 2 * n**3 * iters / dt, "n": n, "threads": torch.get_num_threads()}


# ---------------------------------------------------------------- gpu

def matmul_size(n: int, free_bytes: int) -> int:
    """The largest of ``n``, ``n / 2``, ... whose three bf16 matrices fit in a quarter of the free memory."""
    while n > 512 and 3 * n * n * 2 > free_bytes // 4:
        n //= 2
    return n


def gpu_probe(n: int, timeout_s: float) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    res: dict[str, Any] = {"name": props.name, "uuid": str(getattr(props, "uuid", "")), "total_gb": total / 2**30,
                           "free_gb": free / 2**30, "capability": [props.major, props.minor],
                           "sms": props.multi_processor_count}
    res.update(matmul_rate(dev, matmul_size(n, free)))
    res.update(copy_rate(dev, max(2**20, min(2**30, free // 4) // 2**20 * 2**20)))
    res["nccl"] = nccl_alone(dev, timeout_s)
    return res


def matmul_rate(dev: Any, n: int) -> dict[str, Any]:
    """bf16 ``n`` x ``n`` matmuls: FLOP/s after 10 warm-up calls, over 50 timed ones."""
    import torch

    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    return {"matmul_n": n, "matmul_flops": 2 * n**3 / cuda_seconds(lambda: torch.matmul(a, b, out=out), 10, 50)}


def copy_rate(dev: Any, nbytes: int) -> dict[str, Any]:
    """A device-to-device copy of ``nbytes``: bytes read plus bytes written per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return {"copy_gb": nbytes / 2**30, "copy_bytes_per_s": 2 * nbytes / cuda_seconds(lambda: dst.copy_(src), 3, 30)}


def nccl_alone(dev: Any, timeout_s: float) -> dict[str, Any]:
    """An NCCL all-reduce on a group of one (HashStore), then the communicator's abort."""
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return {"ok": False, "error": "this torch has no NCCL"}
    from recover.comm.backends import make_process_group

    t0 = time.perf_counter()
    pg = make_process_group("nccl", dist.HashStore(), 0, 1, timeout_s, dev)
    x = torch.full((1 << 20,), 3.0, device=dev)
    pg.allreduce([x]).wait()
    torch.cuda.synchronize(dev)
    res: dict[str, Any] = {"ok": bool((x == 3.0).all()), "connect_ms": (time.perf_counter() - t0) * 1000}
    if not res["ok"]:
        res["error"] = "a one-rank all-reduce changed its input"
    if hasattr(pg, "abort"):
        t1 = time.perf_counter()
        pg.abort()
        res["abort_ms"] = (time.perf_counter() - t1) * 1000
    return res


# ---------------------------------------------------------------- allreduce

def allreduce_probe(backend: str, host: str, port: int, rank: int, world: int, numel: int,
                    timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from recover.comm.backends import make_process_group

    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if backend == "nccl" else (lambda: None)
    store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s)))
    pg = make_process_group(backend, store, rank, world, timeout_s, dev)
    x = torch.full((numel,), float(rank + 1), device=dev)
    pg.allreduce([x]).wait()
    sync()
    expected = world * (world + 1) / 2
    ok, got = bool((x == expected).all()), float(x[0])
    iters = 5
    t0 = time.perf_counter()
    for _ in range(iters):
        pg.allreduce([x]).wait()
    sync()
    dt = (time.perf_counter() - t0) / iters
    if backend == "nccl" and hasattr(pg, "abort"):
        pg.abort()
    return {"ok": ok, "expected": expected, "got": got, "ms": dt * 1000,
            "bytes": numel * 4, "bus_bytes_per_s": 2 * (world - 1) / world * numel * 4 / dt}


# ---------------------------------------------------------------- gradfp

def gradfp_probe(config: str, device: str, dtype: str, seed: int) -> dict[str, Any]:
    import torch

    from recover.config import load_config
    from recover.model import build_model, lm_loss
    from recover.train.processes.loop import configure_torch

    extra = ["--training.threads=1"] if device == "cpu" else []
    cfg = load_config(config, ["--training.deterministic=true", f"--training.dtype={dtype}", *extra])
    configure_torch(cfg, 1)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = build_model(cfg.model, cfg.training.seed, dev)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.microbatch_size, cfg.data.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    with autocast:
        loss = lm_loss(model(inputs), targets)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"fp": bit_fingerprint(grads), "loss": float(loss), "config": config, "dtype": dtype, "device": device,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


# ---------------------------------------------------------------- command line (the child side)

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = p.add_subparsers(dest="probe", required=True)
    g = sub.add_parser("gpu")
    g.add_argument("--n", type=int, default=8192)
    g.add_argument("--timeout", type=float, default=30.0)
    a = sub.add_parser("allreduce")
    a.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--numel", type=int, default=1 << 20)
    a.add_argument("--timeout", type=float, default=30.0)
    d = sub.add_parser("gradfp")
    d.add_argument("--config", default="debug")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    d.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.probe == "gpu":
        return gpu_probe(args.n, args.timeout)
    if args.probe == "allreduce":
        return allreduce_probe(args.backend, args.host, args.port, args.rank, args.world, args.numel, args.timeout)
    return gradfp_probe(args.config, args.device, args.dtype, args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        res = run(args)
    except Exception as exc:  # noqa: BLE001 - any failure is the probe's result: one line for the parent
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"{type(exc).__name__}: {text}"[:400], file=sys.stderr, flush=True)
        return 1
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
