"""``recover bench gpu``: recover's trainer against a plain PyTorch loop on one GPU, and a kill on it.

Contract:
- For each preset (default ``125m`` and ``1b``, with one replica: ``parallel.replicas = fsdp = tp =
  pp = 1``), two systems train the same model, samples, microbatches per step, dtype and compile
  setting, each in a fresh child process, in ``rounds`` rounds of alternating order:

  * ``recover``: ``recover train`` (the step protocol, the payload buffers, the commit, the
    fingerprint of the parameters with each vote; no validation or checkpoint inside the window);
  * ``plain``: :func:`plain_worker`, the loop a PyTorch user writes: for each microbatch forward
    under autocast, ``(loss / M).backward()``, then ``clip_grad_norm_`` and fused AdamW; one host
    synchronisation per step (the loss).

- Per system: step time = median over rounds of the median ``time_s`` after ``warmup`` steps (the
  first steps pay compilation); tokens/s = tokens per step / step time; peak memory =
  ``torch.cuda.max_memory_allocated``; MFU = model FLOPs per token (:func:`recover.model.model_stats`:
  6 N + 12 L d T, the PaLM accounting) x tokens/s / the GPU's dense bf16 peak (:data:`PEAK_BF16`,
  looked up by device name; unknown GPUs and the CPU get none). ``recover / plain`` is the ratio of
  step times (target <= 1.03).
- The kill run: ``recover launch`` of 2 replicas of the first preset sharing the GPU (``--share-gpus``:
  gloo across them), replica 1 SIGKILLed in the backward of step ``steps // 2``; it passes when every
  committed step holds M microbatches.
- ``--device cpu`` runs the same on the CPU (a smoke test of the benchmark itself with a small preset:
  no MFU). Without ``--device cpu`` and without a CUDA GPU it refuses in one line.
- ``--json FILE`` writes the result object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.common import (
    fmt,
    machine_load,
    print_rich_table,
    recover_cmd,
    round_orders,
    run_child,
    stderr_log,
    write_json,
)
from recover.errors import ConfigError

SYSTEMS = ("recover", "plain")
PRESETS = ("125m", "1b")
MODULE = "recover.bench.gpu"

PEAK_BF16: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name, dense bf16 FLOP/s), the first match wins
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)
"""Dense (no sparsity) bf16 tensor-core peaks from the vendor's data sheets."""


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (None: unknown)."""
    for key, flops in PEAK_BF16:
        if key in device_name:
            return flops
    return None


def overrides(args: argparse.Namespace, vocab_size: int | None = None) -> list[str]:
    """The config every system of a preset runs with (one replica on one device). ``vocab_size``: the
    preset's, given explicitly so that a small tokenizer's data (the built-in corpus) does not shrink
    the model's vocabulary (:func:`recover.data.layout.resolve_vocab`): the preset's shape is measured."""
    given = [f"--model.vocab_size={vocab_size}"] if vocab_size else []
    return [*given, f"--training.steps={args.steps}", f"--training.global_microbatches={args.microbatches}",
            f"--training.dtype={args.dtype}", f"--training.compile={str(args.compile).lower()}",
            "--training.warmup_steps=0", "--training.eval_every=0", "--training.eval_batches=1",
            "--training.checkpoint_every=0", "--parallel.replicas=1", "--parallel.fsdp=1", "--parallel.tp=1",
            "--parallel.pp=1", *args.overrides]


# ---------------------------------------------------------------- the plain loop (a child process)

def plain_worker(args: argparse.Namespace) -> int:
    """The plain PyTorch loop of a preset; writes ``{"time_s": [...], "peak_gb": ...}`` to ``--result``."""
    from contextlib import nullcontext

    import torch

    from recover.config import load_config
    from recover.data.layout import given, resolve_vocab
    from recover.data.prepare import resolve_data_dir
    from recover.data.sampler import open_samplers
    from recover.model import build_model, lm_loss
    from recover.train.loop import configure_torch
    from recover.train.optim import build_optimizer, lr_at, set_lr

    cfg = load_config(args.config, args.overrides)
    data_dir = resolve_data_dir(cfg.data, prepare=True, quiet=True)
    cfg = resolve_vocab(cfg, data_dir, given(args.overrides, "model.vocab_size"))  # as `recover train` does
    tc, M = cfg.training, cfg.training.global_microbatches
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    configure_torch(cfg, 1)
    sampler, _ = open_samplers(cfg.data, data_dir, cfg.model.vocab_size, M, tc.seed)
    model = build_model(cfg.model, tc.seed, device)
    if tc.compile:
        for block in model.layers.values():
            block.compile(backend=tc.compile_backend)
    optimizer = build_optimizer(model, tc)  # fused AdamW when every parameter is on a GPU
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if tc.dtype == "bfloat16" else nullcontext
    times = []
    for step in range(tc.steps):
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, tc))
        loss_sum = torch.zeros((), device=device)
        for mb in range(M):
            x, y = sampler.microbatch(step, mb)
            if device.type == "cuda":
                x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
            with autocast():
                loss = lm_loss(model(x), y)
            (loss / M).backward()
            loss_sum += loss.detach()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss_sum)  # the one host synchronisation of the step
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    Path(args.result).write_text(json.dumps({"time_s": times, "peak_gb": peak, "vocab_size": cfg.model.vocab_size}),
                                 encoding="utf-8")
    return 0


# ---------------------------------------------------------------- the benchmark

def device_info(device: str) -> dict[str, Any]:
    import torch

    if device == "cpu":
        return {"device": "cpu", "name": "CPU", "peak_flops": None}
    if not torch.cuda.is_available():
        raise ConfigError("recover bench gpu: no CUDA GPU is visible; run it on a GPU node, or smoke-test the "
                          "benchmark on this machine with --device cpu --presets debug")
    name = torch.cuda.get_device_name(0)
    return {"device": "cuda", "name": name, "peak_flops": peak_flops(name)}


def run_system(system: str, preset: str, out: Path, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """One run of ``system``: its per-step times and peak memory."""
    extra = overrides(args, vocab_size)
    timeout = args.timeout
    if system == "plain":
        result = out / "plain.json"
        code = run_child([sys.executable, "-m", MODULE, "plain-worker", "--config", preset, "--result", str(result),
                          *extra], out / "plain.log", timeout)
        if code != 0:
            raise RuntimeError(f"the plain loop of {preset} exited {code}: see {out / 'plain.log'}")
        return json.loads(result.read_text())
    run = out / "recover"
    code = run_child(recover_cmd("train", "--config", preset, "--out", str(run), "--no-progress", "--overwrite",
                                 *extra), out / "recover.log", timeout)
    if code != 0:
        raise RuntimeError(f"recover train of {preset} exited {code}: see {out / 'recover.log'}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"time_s": [r["time_s"] for r in rows], "peak_gb": rows[-1].get("gpu_mem_gb")}


def kill_run(preset: str, out: Path, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """2 replicas of ``preset`` sharing the device, replica 1 SIGKILLed mid-run."""
    step = max(1, args.steps // 2)
    run = out / "kill"
    extra = [o for o in overrides(args, vocab_size) if not o.startswith("--parallel.replicas")]
    cmd = recover_cmd("launch", "--config", preset, "--replicas", "2", "--out", str(run), "--no-progress",
                      "--overwrite", "--fail", f"1@{step}:backward", *extra)
    if args.device == "cuda":
        cmd.append("--share-gpus")
    code = run_child(cmd, out / "kill.log", args.timeout)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    counts = [r["microbatches"] for r in rows]
    return {"exit": code, "kill_step": step, "steps": len(rows), "microbatches": sorted(set(counts)),
            "ok": code == 0 and len(rows) == args.steps and set(counts) == {args.microbatches},
            "live_after": rows[-1]["live_replicas"] if rows else None}


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median step time over rounds (each round's median after ``warmup``) and the largest peak."""
    per_round = [statistics.median(r["time_s"][warmup:] or r["time_s"]) for r in runs]
    peaks = [r["peak_gb"] for r in runs if r.get("peak_gb") is not None]
    return {"step_s": statistics.median(per_round), "per_round_s": per_round, "peak_gb": max(peaks) if peaks else None}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from recover.config import load_config
    from recover.model import model_stats

    info = device_info(args.device)
    out = Path(args.out)
    result: dict[str, Any] = {"machine": info, "load_before": machine_load(), "steps": args.steps,
                              "warmup": args.warmup, "rounds": args.rounds, "microbatches": args.microbatches,
                              "dtype": args.dtype, "compile": args.compile, "presets": {}}
    for preset in args.presets:
        cfg = load_config(preset, overrides(args))  # the preset's shape, as every run is given it
        tokens = args.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
        flops_per_token = model_stats(cfg.model, cfg.data.seq_len).flops_per_token
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for r, order in enumerate(round_orders(SYSTEMS, args.rounds)):
            for system in order:
                stderr_log(f"[{time.strftime('%H:%M:%S')}] {preset} round {r + 1}: {system}")
                runs[system].append(run_system(system, preset, out / preset / f"round{r + 1}", args,
                                               cfg.model.vocab_size))
        rows = {}
        for system, rs in runs.items():
            s = summarise(rs, args.warmup)
            s["tokens_per_s"] = tokens / s["step_s"]
            peak = info["peak_flops"]
            s["mfu"] = flops_per_token * s["tokens_per_s"] / peak if peak else None
            rows[system] = s
        entry: dict[str, Any] = {"vocab_size": cfg.model.vocab_size, "tokens_per_step": tokens,
                                 "flops_per_token": flops_per_token, "systems": rows,
                                 "recover_over_plain": rows["recover"]["step_s"] / rows["plain"]["step_s"]}
        result["presets"][preset] = entry
    if args.kill:
        stderr_log(f"[{time.strftime('%H:%M:%S')}] {args.presets[0]}: 2 replicas on one device, one killed")
        first = args.presets[0]
        result["kill"] = kill_run(first, out / first, args, result["presets"][first]["vocab_size"])
    result["load_after"] = machine_load()
    return result


def print_result(res: dict[str, Any]) -> None:
    m = res["machine"]
    rows = []
    for preset, entry in res["presets"].items():
        for system, s in entry["systems"].items():
            ratio = entry["recover_over_plain"] if system == "recover" else None
            rows.append([f"{preset} {system}", fmt(s["step_s"] * 1000, ".1f"), fmt(s["tokens_per_s"], ".0f"),
                         fmt(s["peak_gb"], ".2f"), fmt(s["mfu"] * 100 if s["mfu"] is not None else None, ".1f"),
                         fmt(ratio, ".3f")])
    peak = f"bf16 peak {m['peak_flops'] / 1e12:.0f} TFLOP/s" if m["peak_flops"] else "no known peak: no MFU"
    notes = [f"{m['name']} ({peak}); "
             f"dtype {res['dtype']}, compile {res['compile']}, M = {res['microbatches']}, {res['steps']} steps "
             f"({res['warmup']} warm-up), {res['rounds']} round(s); load {res['load_before']} -> {res['load_after']}"]
    if "kill" in res:
        k = res["kill"]
        notes.append(f"2 replicas sharing the device, replica 1 killed at step {k['kill_step']}: exit {k['exit']}, "
                     f"{k['steps']} steps committed, microbatches per step {k['microbatches']}, "
                     f"{'every step M' if k['ok'] else 'NOT every step M'}")
    print_rich_table("recover bench gpu", ["preset / system", "step ms", "tokens/s", "peak GiB", "MFU %",
                                           "recover / plain"], rows, notes)


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "gpu", help="one GPU: recover's trainer vs a plain PyTorch loop (step time, tokens/s, memory, MFU), and a kill",
        description="Trains each preset with one replica as recover's trainer and as a plain PyTorch loop (same model, "
                    "samples, M, dtype, compile) in alternating rounds, then 2 replicas sharing the GPU with one "
                    "killed. Config overrides: --section.field VALUE (applied to every run).")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (default 125m,1b)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed: compilation (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each system, alternating order (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each block in both systems (default on)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="also run 2 replicas sharing the device with one killed (default on)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default) or cpu: a smoke test of the benchmark with a small preset")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run (default 1800)")
    p.add_argument("--out", default="runs/bench-gpu", help="directory of the runs (default runs/bench-gpu)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args, accepts_overrides=True)
    return p


def run_from_args(args: argparse.Namespace) -> int:
    args.presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    if not args.presets or args.steps <= args.warmup or args.rounds < 1 or args.microbatches < 1:
        raise ConfigError("recover bench gpu: give at least one preset, --steps > --warmup, --rounds >= 1 and "
                          "--microbatches >= 1")
    args.overrides = list(getattr(args, "overrides", []) or [])
    res = run_bench(args)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    return 0 if res.get("kill", {"ok": True})["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m recover.bench.gpu plain-worker ...`` (the plain loop, in its own process)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("plain-worker")
    w.add_argument("--config", required=True)
    w.add_argument("--result", required=True)
    args, extra = parser.parse_known_args(argv)
    args.overrides = extra
    return plain_worker(args)


if __name__ == "__main__":
    sys.exit(main())
