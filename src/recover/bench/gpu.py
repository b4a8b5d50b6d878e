"""``recover bench gpu``: what recover costs on one GPU against a plain PyTorch loop, and a kill with a rejoin.

Contract:
- For each preset (default ``125m`` and ``1b``, with one replica: ``parallel.replicas = fsdp = tp =
  pp = 1``), three systems train the same model, samples, microbatches per step, dtype and compile
  setting, each in a fresh child process, in ``rounds`` rounds of alternating order:

  * ``plain``: :func:`plain_worker`, the loop a PyTorch user writes: for each microbatch forward
    under autocast, ``(loss / M).backward()``, then ``clip_grad_norm_`` and fused AdamW; one host
    synchronisation per step (the loss);
  * ``train``: ``recover train``: the step protocol and its payload buffers on a static group that
    commits every step (``StaticGroup`` + ``CommitAll``): no coordinator, no fault-tolerant group, no
    parameter fingerprint; no validation or checkpoint inside the window;
  * ``launch``: ``recover launch --replicas 1``: a coordinator process, the fault-tolerant group of
    one rank (NCCL on a GPU), a vote per step and the launch defaults (a parameter fingerprint with
    every vote, ``fault_tolerance.fingerprint_every = 1``): what a fault-tolerant job pays.

- Per system: step time = median over rounds of the median ``time_s`` after ``warmup`` steps (the
  first steps pay compilation); tokens/s = tokens per step / step time; peak memory =
  ``torch.cuda.max_memory_allocated``; MFU = model FLOPs per token (:func:`recover.model.model_stats`:
  6 N + 12 L d T, full attention as PaLM and torchtitan count it; a causal kernel executes half of
  the attention term, so MFU overstates the executed FLOPs by :func:`attention_overstatement`, 5% at
  ``1b``) x tokens/s / the GPU's dense bf16 peak (:func:`peak_flops`; unknown GPUs and the CPU get
  none). ``train / plain`` and ``launch / plain`` are ratios of step times.
- The kill run: ``recover launch`` of 2 replicas of the first preset sharing the first visible GPU
  (``--gpus ID --share-gpus``: gloo across them), replica 1 SIGKILLed in the backward of step ``steps // 2``
  and restarted at once (``--rejoin-after 0``); the run goes on long enough for it to rejoin
  (:func:`rejoin_steps`, or ``--rejoin-steps``). It passes when every step is committed with M
  microbatches, a step ran on 1 live replica and the last step on 2.
- The benchmark's own process creates no CUDA context: the device is described by a child process.
- ``--device cpu`` runs the same on the CPU with one thread per process (a smoke test of the
  benchmark itself with a small preset: no MFU). Without ``--device cpu`` and without a CUDA GPU it
  refuses in one line.
- ``--json FILE`` writes the result object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.common import (
    child_env,
    fmt,
    machine_load,
    print_rich_table,
    recover_cmd,
    round_orders,
    run_child,
    stderr_log,
    windows,
    write_json,
)
from recover.errors import ConfigError
from recover.observe.events import read_jsonl

SYSTEMS = ("plain", "train", "launch")
PRESETS = ("125m", "1b")
MODULE = "recover.bench.gpu"
CPU_REJOIN_STEPS = 20
"""Steps after the kill on the CPU: a spare process is started in advance there and joins within a few."""
MAX_REJOIN_STEPS = 2000

Peaks = tuple[tuple[str, float | None], ...]

PEAK_BF16: Peaks = (
    # (substring of torch.cuda.get_device_name, dense bf16 FLOP/s); the longest matching key wins, so a
    # variant ("H100 NVL") is never credited its family's figure ("H100")
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)
"""Dense (no sparsity) bf16 tensor-core peaks from the vendor's data sheets."""

PEAK_MEM_BW: Peaks = (
    # (substring of the device name, memory bandwidth in bytes/s); None: the name does not tell (memory
    # sizes of one name differ), so no peak rather than a wrong one
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H200 NVL", 4.8e12),
    ("GH200", None),
    ("H200", 4.8e12),
    ("H20", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", None),
    ("A10G", 600e9),
    ("L40S", 864e9),
    ("L40", 864e9),
    ("L4", 300e9),
)
"""Memory bandwidth from the vendor's data sheets (what ``recover check``'s copy is compared with)."""


def lookup_peak(table: Peaks, device_name: str) -> float | None:
    """The value of the longest key of ``table`` contained in ``device_name`` (None: none, or unknown)."""
    keys = [(len(key), value) for key, value in table if key in device_name]
    return max(keys, key=lambda kv: kv[0])[1] if keys else None


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (None: unknown)."""
    return lookup_peak(PEAK_BF16, device_name)


def peak_bandwidth(device_name: str) -> float | None:
    """The memory bandwidth of a GPU by its name, bytes/s (None: unknown)."""
    return lookup_peak(PEAK_MEM_BW, device_name)


def attention_overstatement(n_layers: int, dim: int, seq_len: int, flops_per_token: int) -> float:
    """How much MFU's FLOP count (full attention, ``12 L d T``) exceeds what a causal kernel executes
    (half of that term), relative to the executed FLOPs: 0.05 is 5%."""
    half = 6 * n_layers * dim * seq_len
    return half / (flops_per_token - half)


def overrides(args: argparse.Namespace, vocab_size: int | None = None, steps: int | None = None) -> list[str]:
    """The config every system of a preset runs with (one replica on one device). ``vocab_size``: the
    preset's, given explicitly so that a small tokenizer's data (the built-in corpus) does not shrink
    the model's vocabulary (:func:`recover.data.layout.resolve_vocab`): the preset's shape is measured.
    On the CPU every process gets one thread (the systems share the cores with a coordinator and a
    launcher, and threads spinning on taken cores would measure the machine, not the system)."""
    given = [f"--model.vocab_size={vocab_size}"] if vocab_size else []
    threads = ["--training.threads=1"] if getattr(args, "device", "cuda") == "cpu" else []
    return [*given, f"--training.steps={steps or args.steps}", f"--training.global_microbatches={args.microbatches}",
            f"--training.dtype={args.dtype}", f"--training.compile={str(args.compile).lower()}",
            "--training.warmup_steps=0", "--training.eval_every=0", "--training.eval_batches=1",
            "--training.checkpoint_every=0", "--parallel.replicas=1", "--parallel.fsdp=1", "--parallel.tp=1",
            "--parallel.pp=1", *threads, *args.overrides]
# ---------------------------------------------------------------- the plain loop (a child process)

def plain_worker(args: argparse.Namespace) -> int:
    """The plain PyTorch loop of a preset; writes ``{"time_s": [...], "peak_gb": ...}`` to ``--result``."""
    from contextlib import nullcontext

    import torch

    from recover.config import load_config
    from recover.data.layout import given, resolve_vocab
    from recover.data.prepare import prepared_data_dir
    from recover.data.sampler import open_samplers
    from recover.model import build_model, lm_loss
    from recover.model.spec import spec_of
    from recover.train.processes.loop import configure_torch
    from recover.train.replicas.optim import build_optimizer, lr_at, set_lr

    cfg = load_config(args.config, args.overrides)
    data_dir = prepared_data_dir(cfg.data, quiet=True)
    cfg = resolve_vocab(cfg, data_dir, given(args.overrides, "model.vocab_size"))  # as `recover train` does
    tc, M = cfg.training, cfg.training.global_microbatches
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    configure_torch(cfg, 1)
    sampler, _ = open_samplers(cfg.data, data_dir, cfg.model.vocab_size, M, tc.seed)
    model = build_model(cfg.model, tc.seed, device)
    if tc.compile:
        for block in spec_of(model).block_dict(model).values():
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

DEVICE_INFO_TIMEOUT_S = 300.0


def describe_cuda() -> dict[str, Any]:
    """(in the child process) Whether this torch sees a CUDA GPU, and GPU 0's name."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    return {"cuda": True, "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}


def device_info(device: str) -> dict[str, Any]:
    """The device the systems run on. A GPU is described by a child process, so this one creates no CUDA
    context (a GPU in exclusive-process mode stays free for the runs)."""
    if device == "cpu":
        return {"device": "cpu", "name": "CPU", "peak_flops": None}
    proc = subprocess.run([sys.executable, "-m", MODULE, "device-info"], capture_output=True, text=True,
                          env=child_env(), timeout=DEVICE_INFO_TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    info = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"cuda": False}
    if not info["cuda"]:
        raise ConfigError("recover bench gpu: no CUDA GPU is visible; run it on a GPU node, or smoke-test the "
                          "benchmark on this machine with --device cpu --presets debug")
    return {"device": "cuda", "name": info["name"], "peak_flops": peak_flops(info["name"])}


def read_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return list(read_jsonl(path)) if path.exists() else []  # a torn last line (a killed run) is skipped


def one_gpu(device: str) -> list[str]:
    """``recover launch``'s flag placing every replica on the first visible GPU (none on the CPU): the kill
    run's 2 replicas then share it (gloo) even on a node with more GPUs."""
    from recover.launch.placement import visible_gpus

    gpus = visible_gpus() if device == "cuda" else []
    return ["--gpus", gpus[0]] if gpus else []


def run_system(system: str, preset: str, out: Path, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """One run of ``system``: its per-step times and peak memory (and, for ``launch``, its start-up)."""
    extra = overrides(args, vocab_size)
    log = out / f"{system}.log"
    if system == "plain":
        result = out / "plain.json"
        code = run_child([sys.executable, "-m", MODULE, "plain-worker", "--config", preset, "--result", str(result),
                          *extra], log, args.timeout)
        if code != 0:
            raise RuntimeError(f"the plain loop of {preset} exited {code}: see {log}")
        return json.loads(result.read_text())
    run = out / system
    common = ("--config", preset, "--out", str(run), "--no-progress", "--overwrite", "--observe.plots=false")
    cmd = recover_cmd("train", *common, *extra) if system == "train" else \
        recover_cmd("launch", *common, "--replicas", "1", *one_gpu(args.device), *extra)
    code = run_child(cmd, log, args.timeout)
    if code != 0:
        raise RuntimeError(f"recover {system} of {preset} exited {code}: see {log}")
    rows = read_rows(run)
    res: dict[str, Any] = {"time_s": [r["time_s"] for r in rows], "peak_gb": rows[-1].get("gpu_mem_gb")}
    if system == "launch":
        res["startup_s"] = windows(run)["startup_s"]
    return res


def rejoin_steps(device: str, startup_s: float, time_s: list[float], step_s: float, warmup: int) -> int:
    """Steps the kill run goes on after the kill, so that the killed replica is back before the end. On a
    GPU the replica restarts as a fresh process: its start-up (the 1-replica launch's, coordinator to
    first step) plus its compilation (the warm-up steps' time beyond a step's), twice over, in steps."""
    if device == "cpu":
        return CPU_REJOIN_STEPS
    compile_s = sum(max(0.0, t - step_s) for t in time_s[:warmup])
    return min(MAX_REJOIN_STEPS, math.ceil(2 * (startup_s + compile_s) / max(step_s, 1e-3)) + 5)


def kill_verdict(rows: list[dict[str, Any]], code: int, steps: int, microbatches: int) -> str | None:
    """What is wrong with a kill-and-rejoin run (None: nothing): every step committed with M
    microbatches, a step on 1 live replica (the kill) and the last step on 2 (the rejoin)."""
    live = [r["live_replicas"] for r in rows]
    short = sorted({r["microbatches"] for r in rows} - {microbatches})
    if code != 0:
        return f"recover launch exited {code}"
    if len(rows) != steps:
        return f"{len(rows)} of {steps} steps committed"
    if short:
        return f"steps committed with {short} microbatches instead of {microbatches}"
    if min(live) != 1:
        return "no step ran on 1 replica: the kill did not happen"
    if live[-1] != 2:
        return "the killed replica had not rejoined by the last step: raise --rejoin-steps"
    return None


def kill_run(preset: str, out: Path, args: argparse.Namespace, vocab_size: int, after: int) -> dict[str, Any]:
    """2 replicas of ``preset`` sharing the device, replica 1 SIGKILLed mid-run and restarted at once;
    ``after`` steps follow the kill."""
    step = max(1, args.steps // 2)
    total = step + 1 + after
    run = out / "kill"
    extra = [o for o in overrides(args, vocab_size, steps=total) if not o.startswith("--parallel.replicas")]
    cmd = recover_cmd("launch", "--config", preset, "--replicas", "2", "--out", str(run), "--no-progress",
                      "--overwrite", "--observe.plots=false", "--fail", f"1@{step}:backward", "--rejoin-after", "0",
                      *extra)
    if args.device == "cuda":
        cmd += [*one_gpu(args.device), "--share-gpus"]
    code = run_child(cmd, out / "kill.log", args.timeout)
    rows = read_rows(run)
    live = [r["live_replicas"] for r in rows]
    back = next((r["step"] for r in rows if r["step"] > step and r["live_replicas"] == 2), None)
    problem = kill_verdict(rows, code, total, args.microbatches)
    return {"exit": code, "kill_step": step, "steps": len(rows), "expected_steps": total, "rejoined_at": back,
            "microbatches": sorted({r["microbatches"] for r in rows}), "live_min": min(live) if live else None,
            "live_after": live[-1] if live else None, "ok": problem is None, "problem": problem}


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median step time over rounds (each round's median after ``warmup``) and the largest peak."""
    per_round = [statistics.median(r["time_s"][warmup:] or r["time_s"]) for r in runs]
    peaks = [r["peak_gb"] for r in runs if r.get("peak_gb") is not None]
    return {"step_s": statistics.median(per_round), "per_round_s": per_round, "peak_gb": max(peaks) if peaks else None}


def preset_entry(runs: dict[str, list[dict[str, Any]]], tokens: int, stats: dict[str, Any], warmup: int,
                 peak: float | None) -> dict[str, Any]:
    """A preset's result: per system its summary, tokens/s and MFU; the ratios to ``plain``."""
    rows = {}
    for system, rs in runs.items():
        s = summarise(rs, warmup)
        s["tokens_per_s"] = tokens / s["step_s"]
        s["mfu"] = stats["flops_per_token"] * s["tokens_per_s"] / peak if peak else None
        rows[system] = s
    plain = rows["plain"]["step_s"]
    return {**stats, "tokens_per_step": tokens, "systems": rows,
            "train_over_plain": rows["train"]["step_s"] / plain, "launch_over_plain": rows["launch"]["step_s"] / plain}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from recover.config import load_config
    from recover.model import model_stats

    info = device_info(args.device)
    out = Path(args.out)
    result: dict[str, Any] = {"machine": info, "load_before": machine_load(), "steps": args.steps,
                              "warmup": args.warmup, "rounds": args.rounds, "microbatches": args.microbatches,
                              "dtype": args.dtype, "compile": args.compile, "presets": {}}
    launches: dict[str, list[dict[str, Any]]] = {}
    for preset in args.presets:
        cfg = load_config(preset, overrides(args))  # the preset's shape, as every run is given it
        m = cfg.model
        tokens = args.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
        flops = model_stats(m, cfg.data.seq_len).flops_per_token
        stats = {"vocab_size": m.vocab_size, "flops_per_token": flops,
                 "mfu_overstates": attention_overstatement(m.n_layers, m.dim, cfg.data.seq_len, flops)}
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        for r, order in enumerate(round_orders(SYSTEMS, args.rounds)):
            for system in order:
                stderr_log(f"[{time.strftime('%H:%M:%S')}] {preset} round {r + 1}/{args.rounds}: {system}")
                runs[system].append(run_system(system, preset, out / preset / f"round{r + 1}", args, m.vocab_size))
        result["presets"][preset] = preset_entry(runs, tokens, stats, args.warmup, info["peak_flops"])
        launches[preset] = runs["launch"]
    if args.kill:
        first = args.presets[0]
        launch = launches[first][0]
        after = args.rejoin_steps or rejoin_steps(args.device, launch["startup_s"], launch["time_s"],
                                                  result["presets"][first]["systems"]["launch"]["step_s"], args.warmup)
        stderr_log(f"[{time.strftime('%H:%M:%S')}] {first}: 2 replicas on one device, one killed and rejoining "
                   f"({after} steps after the kill)")
        result["kill"] = kill_run(first, out / first, args, result["presets"][first]["vocab_size"], after)
    result["load_after"] = machine_load()
    return result


def result_rows(res: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """The result as a table: columns, rows and notes (the terminal table and ``make gpu-check``'s report)."""
    m = res["machine"]
    columns = ["preset / system", "step ms", "tokens/s", "peak GiB", "MFU %", "/ plain"]
    rows, notes = [], []
    for preset, entry in res["presets"].items():
        for system, s in entry["systems"].items():
            ratio = entry.get(f"{system}_over_plain")
            rows.append([f"{preset} {system}", fmt(s["step_s"] * 1000, ".1f"), fmt(s["tokens_per_s"], ".0f"),
                         fmt(s["peak_gb"], ".2f"), fmt(s["mfu"] * 100 if s["mfu"] is not None else None, ".1f"),
                         fmt(ratio, ".3f")])
    peak = f"bf16 peak {m['peak_flops'] / 1e12:.0f} TFLOP/s" if m["peak_flops"] else "no known peak: no MFU"
    notes.append(f"{m['name']} ({peak}); dtype {res['dtype']}, compile {res['compile']}, M = {res['microbatches']}, "
                 f"{res['steps']} steps ({res['warmup']} warm-up), {res['rounds']} round(s); "
                 f"load {res['load_before']} -> {res['load_after']}")
    if m["peak_flops"]:
        over = ", ".join(f"{p} {e['mfu_overstates'] * 100:.1f}%" for p, e in res["presets"].items())
        notes.append(f"MFU counts 6N + 12·L·d·T FLOPs per token (full attention, the PaLM/torchtitan convention); "
                     f"a causal kernel executes half the attention term, so MFU overstates executed FLOPs by {over}")
    if "kill" in res:
        k = res["kill"]
        verdict = "every step M, 2 live replicas at the end" if k["ok"] else f"FAILED: {k['problem']}"
        notes.append(f"2 replicas sharing the device, replica 1 killed at step {k['kill_step']} and restarted: exit "
                     f"{k['exit']}, {k['steps']}/{k['expected_steps']} steps committed, back at step "
                     f"{fmt(k['rejoined_at'])}, microbatches per step {k['microbatches']}: {verdict}")
    return columns, rows, notes


def print_result(res: dict[str, Any]) -> None:
    columns, rows, notes = result_rows(res)
    print_rich_table("recover bench gpu", columns, rows, notes)


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "gpu", help="one GPU: a plain PyTorch loop vs recover train vs recover launch (step time, tokens/s, memory, "
                    "MFU), and a kill with a rejoin",
        description="Trains each preset with one replica as a plain PyTorch loop, as `recover train` and as "
                    "`recover launch --replicas 1` (same model, samples, M, dtype, compile) in alternating rounds, "
                    "then 2 replicas sharing the GPU with one killed and rejoining. Config overrides: "
                    "--section.field VALUE (applied to every run).")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (default 125m,1b)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed: compilation (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each system, alternating order (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each block in every system (default on)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="also run 2 replicas sharing the device with one killed and rejoining (default on)")
    p.add_argument("--rejoin-steps", type=int, default=None, metavar="N",
                   help="steps of the kill run after the kill (default: from the 1-replica launch's start-up and "
                        f"compilation on a GPU, {CPU_REJOIN_STEPS} on the CPU)")
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
    if args.rejoin_steps is not None and args.rejoin_steps < 1:
        raise ConfigError(f"recover bench gpu: --rejoin-steps {args.rejoin_steps} is not allowed: give N >= 1")
    args.overrides = list(getattr(args, "overrides", []) or [])
    res = run_bench(args)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    return 0 if res.get("kill", {"ok": True})["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m recover.bench.gpu plain-worker ...`` (the plain loop, in its own process) or
    ``device-info`` (one JSON line: whether CUDA is there, GPU 0's name)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("plain-worker")
    w.add_argument("--config", required=True)
    w.add_argument("--result", required=True)
    sub.add_parser("device-info")
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "device-info":
        print(json.dumps(describe_cuda()), flush=True)
        return 0
    args.overrides = extra
    return plain_worker(args)


if __name__ == "__main__":
    sys.exit(main())
