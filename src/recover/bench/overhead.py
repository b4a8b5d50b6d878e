"""``recover bench overhead``: failure-free step time of recover against plain PyTorch data parallelism
and torchft, on the same model, data and batch, as ratios from one run.

Contract:
- Systems, each a separate job of ``replicas`` processes on this machine, run back to back in
  ``rounds`` rounds whose order alternates (A B C D, then D C B A, ...) so a drift in machine
  load does not favour one system:

  * ``recover``: ``recover launch`` (coordinator, fault-tolerant all-reduce, commit vote with the
    parameter fingerprint of every replica);
  * ``recover-overlap``: the same with the reduction overlapping the last backward
    (``fault_tolerance.overlap_reduction = on``; its default, ``auto``, overlaps on GPUs only):
    ``recover / it`` is what the overlap gains on this machine;
  * ``recover-ckpt``: the same with an asynchronous checkpoint every :data:`CKPT_EVERY` steps:
    ``save_step_ratio`` is the median time of a step in which a save began over that of the other
    steps (``next_step_ratio``: of the step after it), the cost of saving on the training path;
  * ``recover-nofp``: the same without fingerprints (``fault_tolerance.fingerprint_every = 0``):
    ``recover / it`` is what the silent-data-corruption check costs;
  * ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` under ``torchrun`` (gloo, bucketed
    all-reduce overlapped with the last microbatch's backward, ``no_sync`` for the others,
    ``broadcast_buffers=False``: the model's only buffer is a constant RoPE table):
    :func:`ddp_worker`, run as ``torchrun -m recover.bench.overhead ddp-worker``;
  * ``allreduce``: ``recover train`` under ``torchrun`` (the plain trainer: one
    ``torch.distributed.all_reduce`` of a flattened copy of the gradients after backward);
  * ``torchft``: torchft 0.2.0 DDP with its Lighthouse (:mod:`recover.bench.torchft_runner`),
    when an interpreter with torchft is found.

  Every system computes the same M microbatches per step with the same per-process thread count,
  optimizer and clipping, and evaluates at the same steps.
- Step time of a system = median over all its rounds of the wall time between consecutive
  committed steps (``elapsed_s`` of ``metrics.jsonl``), skipping the first ``warmup`` steps.
  ``ratio_vs_recover`` = a system's step time / recover's; ``paired_ratio_vs_recover`` = the
  median over rounds of the same ratio within each round; ``recover_overhead`` = recover's step
  time / each other system's (the target is <= 1.03 against plain DDP).
- Apart from the machine's noise, each recover row carries ``own_cpu_fraction`` (:func:`own_cpu`): recover's
  own CPU seconds per replica-step over the step's compute CPU seconds, from the replicas' ``cpu_ms`` records
  and the coordinator's CPU (goal <= 0.01), with its spread over rounds and its parts.
- ``--json FILE`` writes the result object; ``systems`` holds one object per system.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from recover.bench.common import (
    LINGER_S,
    LINGERED,
    Log,
    committed,
    fmt,
    launch_run,
    machine_load,
    median,
    print_rich_table,
    round_orders,
    run_child,
    stderr_log,
    step_intervals,
    write_json,
)
from recover.errors import ConfigError
from recover.observe.plots import load_metrics

SYSTEMS = ("recover", "recover-nofp", "recover-overlap", "recover-ckpt", "ddp", "allreduce", "torchft")
CKPT_EVERY = 5
"""Steps between the asynchronous checkpoints of ``recover-ckpt``."""
LABELS = {
    "recover-ckpt": f"recover launch with an asynchronous checkpoint every {CKPT_EVERY} steps",
    "recover": "recover launch (fault-tolerant all-reduce + commit vote + parameter fingerprint)",
    "recover-nofp": "recover launch without parameter fingerprints (fault_tolerance.fingerprint_every = 0)",
    "recover-overlap": "recover launch overlapping the reduction with the last backward (overlap_reduction = on)",
    "ddp": "torch DistributedDataParallel under torchrun (gloo)",
    "allreduce": "recover train under torchrun (plain all_reduce after backward)",
    "torchft": "torchft 0.2.0 DDP + Lighthouse",
}
MODULE = "recover.bench.overhead"


def system_stats(name: str, run_dirs: Sequence[Path], warmup: int) -> dict[str, Any]:
    """Step-time statistics of one system pooled over its rounds' run directories."""
    intervals: list[float] = []
    per_round: list[float | None] = []
    val = None
    for run_dir in run_dirs:
        rows = load_metrics(run_dir)
        xs = step_intervals(rows, skip=warmup)
        intervals.extend(xs)
        per_round.append(round(median(xs), 5) if xs else None)
        val = next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), val)
    st = median(intervals)
    row = {"name": name, "label": LABELS.get(name, name), "step_time_s": round(st, 5) if st is not None else None,
           "step_time_s_per_round": per_round, "intervals": len(intervals), "final_val_loss": val,
           "run_dirs": [str(d) for d in run_dirs]}
    return row | save_step_ratios(run_dirs, warmup) | own_cpu(run_dirs, warmup)


def run_own_cpu(run_dir: Path, warmup: int) -> dict[str, float] | None:
    """recover's own CPU per step of one run over its compute CPU (see :func:`own_cpu`), by part; None for a run
    whose replicas recorded no ``cpu_ms`` (not a recover launch)."""
    import json

    from recover.names import Event
    from recover.observe.plots import load_events

    compute = main = background = 0.0
    timed = 0
    for path in sorted((run_dir / "replicas").glob("replica_*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ms = rec.get("cpu_ms") if isinstance(rec, dict) else None
            if ms and rec.get("step", -1) >= warmup:
                compute += ms["compute"]
                main += ms["own"]
                background += ms["background"]
                timed += 1
    if not timed or compute <= 0:
        return None
    steps = max(1, len(load_metrics(run_dir)))
    replicas = max(1, len(list((run_dir / "replicas").glob("replica_*.jsonl"))))
    events = load_events(run_dir)  # the coordinator's CPU from when it served (start) to when it was ended
    started = [float(e["cpu_s"]) for e in events if e.get("kind") == Event.COORDINATOR_START and "cpu_s" in e]
    ended = [float(e["cpu_s"]) for e in events if e.get("kind") == Event.COORDINATOR_ENDED and e.get("cpu_s")]
    coord_s = max(0.0, ended[-1] - started[-1]) if started and ended else 0.0
    coordinator = coord_s * 1000 / (steps * replicas) * timed  # its share of the timed replica-steps
    parts = {"training_thread": main / compute, "client_threads": background / compute,
             "coordinator": coordinator / compute}
    return {"own_cpu_fraction": sum(parts.values()), **parts}


def own_cpu(run_dirs: Sequence[Path], warmup: int) -> dict[str, Any]:
    """``own_cpu_fraction``: recover's own CPU seconds per replica-step (the training thread's CPU outside the
    compute, the wait on the reduction and the update: plan, reduction buffers, vote, fingerprint, hooks; the
    coordinator client's threads: heartbeats; the coordinator's process, shared out per replica-step) over the
    step's compute CPU seconds, the median over rounds; ``own_cpu_fraction_spread`` its max - min over rounds;
    ``own_cpu_parts`` the median of each part. CPU time, not wall time: it means the same at any load.
    Nothing for runs without ``cpu_ms`` records (the systems that are not recover)."""
    runs = [r for r in (run_own_cpu(d, warmup) for d in run_dirs) if r is not None]
    if not runs:
        return {}
    fractions = [r["own_cpu_fraction"] for r in runs]
    parts = {k: round(statistics.median(r[k] for r in runs), 5) for k in runs[0] if k != "own_cpu_fraction"}
    return {"own_cpu_fraction": round(statistics.median(fractions), 5),
            "own_cpu_fraction_spread": round(max(fractions) - min(fractions), 5), "own_cpu_parts": parts}


def save_step_ratios(run_dirs: Sequence[Path], warmup: int) -> dict[str, Any]:
    """``save_step_ratio`` and ``next_step_ratio`` (see the module docstring) pooled over the runs that saved
    checkpoints; nothing for runs that saved none."""
    from recover.names import Event
    from recover.observe.plots import load_events

    at: list[float] = []
    after: list[float] = []
    other: list[float] = []
    for run_dir in run_dirs:
        saved = {int(e["step"]) for e in load_events(run_dir) if e.get("kind") == Event.CHECKPOINT and "step" in e}
        if not saved:
            continue
        rows = sorted(load_metrics(run_dir), key=lambda r: r["step"])
        for a, b in zip(rows, rows[1:], strict=False):
            if b["step"] != a["step"] + 1 or a["step"] < warmup:
                continue
            dt = b["elapsed_s"] - a["elapsed_s"]
            (at if b["step"] in saved else after if b["step"] - 1 in saved else other).append(dt)
    base = median(other)
    if not at or not base:
        return {}
    nxt = median(after)
    return {"save_step_ratio": round(median(at) / base, 4),  # type: ignore[operator]
            "next_step_ratio": round(nxt / base, 4) if nxt else None, "saves_timed": len(at)}


def assemble(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Adds ``ratio_vs_recover`` to each row; returns recover's step time over each other system's."""
    rec = next((r for r in rows if r["name"] == "recover"), None)
    base = rec["step_time_s"] if rec else None
    overhead: dict[str, float | None] = {}
    for r in rows:
        st = r["step_time_s"]
        r["ratio_vs_recover"] = round(st / base, 4) if st and base else None
        pairs = [a / b for a, b in zip(r["step_time_s_per_round"], rec["step_time_s_per_round"] if rec else [],
                                       strict=False) if a and b]
        r["paired_ratio_vs_recover"] = round(median(pairs), 4) if pairs else None
        if r["name"] != "recover":
            overhead[r["name"]] = round(base / st, 4) if st and base else None
    return overhead


def print_result(res: dict[str, Any]) -> None:
    rows = [[r["name"], fmt(r["step_time_s"] * 1000 if r["step_time_s"] else None, ".1f"),
             " ".join(fmt(x * 1000 if x else None, ".0f") for x in r["step_time_s_per_round"]),
             fmt(r["ratio_vs_recover"], ".3f"), fmt(r.get("paired_ratio_vs_recover"), ".3f"),
             fmt(res["recover_overhead"].get(r["name"]), ".3f") if r["name"] != "recover" else "-",
             str(r["intervals"]), fmt(r["final_val_loss"], ".4f")] for r in res["systems"]]
    notes = [f"{r['name']}: {r['label']}" for r in res["systems"]]
    notes += [f"{name}: not run ({why})" for name, why in res.get("skipped", {}).items()]
    notes += [f"{r['name']}: a step in which a save began took {r['save_step_ratio']:.3f}x the others, the step after "
              f"it {fmt(r.get('next_step_ratio'), '.3f')}x ({r['saves_timed']} saves timed)"
              for r in res["systems"] if r.get("save_step_ratio") is not None]
    notes += [f"{r['name']}: recover's own CPU {r['own_cpu_fraction']:.4f} of the compute's per replica-step "
              f"(spread {r['own_cpu_fraction_spread']:.4f}; "
              + ", ".join(f"{k} {v:.4f}" for k, v in r["own_cpu_parts"].items()) + ")"
              for r in res["systems"] if r.get("own_cpu_fraction") is not None]
    notes.append(f"median of step-to-step wall time after {res['warmup']} warm-up steps, pooled over "
                 f"{res['rounds']} round(s) in alternating order; load average before/after: "
                 f"{res['load']['before']} / {res['load']['after']}; benchmark wall {res['bench_wall_s']:.0f} s")
    title = (f"bench overhead: {res['config']} x{res['replicas']} replicas, {res['steps']} steps, "
             f"M = {res['microbatches']}, failure-free")
    print_rich_table(title, ("system", "step ms", "per round ms", "x recover", "paired", "recover / it", "steps timed",
                             "final val loss"), rows, notes)


def _torchrun(replicas: int, *module_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(replicas),
            "-m", *module_args]


def run_system(name: str, run_dir: Path, config: str, replicas: int, steps: int, overrides: Sequence[str],
               torchft_python: str | None, timeout_s: float) -> int:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log_path = run_dir.with_name(run_dir.name + ".log")
    common = ["--config", config, "--out", str(run_dir), f"--training.steps={steps}",
              f"--parallel.replicas={replicas}", *overrides]
    if name == "recover":
        return launch_run(run_dir, config, replicas, steps, (), None, overrides, timeout_s)
    if name == "recover-nofp":
        return launch_run(run_dir, config, replicas, steps, (), None,
                          [*overrides, "--fault_tolerance.fingerprint_every=0"], timeout_s)
    if name == "recover-ckpt":
        return launch_run(run_dir, config, replicas, steps, (), None,
                          [*overrides, f"--training.checkpoint_every={CKPT_EVERY}", "--training.checkpoint_async=true"],
                          timeout_s)
    if name == "recover-overlap":
        return launch_run(run_dir, config, replicas, steps, (), None,
                          [*overrides, "--fault_tolerance.overlap_reduction=on"], timeout_s)
    done = committed(run_dir, steps)
    if name == "allreduce":
        return run_child(_torchrun(replicas, "recover", "train", "--no-progress", *common), log_path, timeout_s,
                         done=done)
    if name == "ddp":
        return run_child(_torchrun(replicas, MODULE, "ddp-worker", *common), log_path, timeout_s, done=done)
    if name == "torchft":
        from recover.bench.torchft_runner import run_torchft

        return run_torchft(run_dir, config, replicas, steps, (), overrides, torchft_python, timeout_s)
    raise ConfigError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def run_bench(config: str = "tiny", replicas: int = 4, steps: int = 30, warmup: int = 5, rounds: int = 2,
              systems: Sequence[str] = SYSTEMS, overrides: Sequence[str] = (), torchft_python: str | None = None,
              out: Path = Path("runs/bench-overhead"), timeout_s: float = 900.0, log: Log = stderr_log
              ) -> dict[str, Any]:
    """Runs every system ``rounds`` times; returns the result object (see the module docstring).

    Raises:
        ConfigError: a bad argument, named with the fix.
    """
    from recover.bench.failures import find_torchft_python
    from recover.config import load_config

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "recover" not in systems:
        raise ConfigError(f"--systems {','.join(systems)}: must include recover and only {','.join(SYSTEMS)}")
    if warmup < 0 or steps < warmup + 3:
        raise ConfigError(f"--steps {steps} / --warmup {warmup}: need warmup >= 0 and steps >= warmup + 3")
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: at least 1")
    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}", f"--training.steps={steps}"])
    t_bench, load_before = time.time(), machine_load()
    skipped: dict[str, str] = {}
    tft_python = None
    if "torchft" in systems:
        tft_python, why = find_torchft_python(torchft_python)
        if tft_python is None:
            skipped["torchft"] = why
    active = [s for s in systems if s not in skipped]
    dirs: dict[str, list[Path]] = {s: [] for s in active}
    codes: dict[str, list[int]] = {s: [] for s in active}
    for r, order in enumerate(round_orders(active, rounds)):
        for name in order:
            run_dir = out / f"round{r}" / name
            log(f"[{time.strftime('%H:%M:%S')}] round {r}: {name} (load {machine_load()})")
            code = run_system(name, run_dir, config, replicas, steps, overrides, tft_python, timeout_s)
            codes[name].append(code)
            if code == LINGERED:  # marked, not counted: its step times may be right, its end was not
                log(f"round {r}: {name}'s processes lingered {LINGER_S:g} s after its last step and were killed "
                    f"(their stacks are in {run_dir}.log); the run is not counted")
                continue
            dirs[name].append(run_dir)
    rows = [system_stats(name, dirs[name], warmup) | {"exit_codes": codes[name]} for name in active]
    res: dict[str, Any] = {
        "benchmark": "overhead", "config": config, "replicas": replicas, "steps": steps, "warmup": warmup,
        "rounds": rounds, "microbatches": cfg.training.global_microbatches, "overrides": list(overrides),
        "systems": rows, "recover_overhead": assemble(rows), "target": 1.03, "skipped": skipped,
        "load": {"before": load_before, "after": machine_load()}, "bench_wall_s": round(time.time() - t_bench, 1),
        "out": str(out),
    }
    write_json(out / "results.json", res)
    return res


# ---------------------------------------------------------------- torch DDP worker (under torchrun)

def ddp_worker(args: argparse.Namespace) -> int:
    """One rank of plain ``torch.nn.parallel.DistributedDataParallel`` training (recover's model and data)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from recover.config import load_config
    from recover.model import lm_loss
    from recover.observe.events import JsonlWriter
    from recover.train.processes.trainer import build_replica, prepare_data
    from recover.train.replicas.dist import init_from_env, shutdown
    from recover.train.replicas.optim import lr_at, set_lr
    from recover.workload import static_assignment

    cfg = load_config(args.config, args.overrides)
    tc = cfg.training
    ctx = init_from_env(cfg.parallel.backend)
    try:
        replica, eval_data = build_replica(cfg, ctx, prepare_data(cfg, ctx, quiet=True))
        optimizer, M = replica.optimizer, tc.global_microbatches
        # The only buffer is RoPE's constant table: broadcasting it before every forward (DDP's
        # default) would add a collective per microbatch that no LLM trainer pays.
        model = DistributedDataParallel(replica.model, broadcast_buffers=False)
        metrics = JsonlWriter(Path(args.out) / "metrics.jsonl") if ctx.is_main else None
        t_start = time.perf_counter()
        for step in range(tc.steps):
            t0 = time.perf_counter()
            set_lr(optimizer, lr_at(step, tc))
            optimizer.zero_grad(set_to_none=True)
            ids = static_assignment(M, ctx.world_size, step, tc.assignment, tc.seed)[ctx.rank]
            loss_sum = 0.0
            for i, mb in enumerate(ids):
                inputs, targets = replica.data.microbatch(step, mb)
                with model.no_sync() if i + 1 < len(ids) else nullcontext():
                    loss = lm_loss(model(inputs), targets)
                    (loss / len(ids)).backward()  # DDP averages over ranks: sum over all M / M
                loss_sum += float(loss)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(replica.model.parameters(), tc.grad_clip))
            optimizer.step()
            if metrics is not None:
                rec: dict[str, Any] = {
                    "step": step, "loss": loss_sum / len(ids), "loss_scope": "rank 0 microbatches",
                    "microbatches": M, "tokens": M * replica.tokens_per_microbatch,
                    "time_s": round(time.perf_counter() - t0, 6), "grad_norm": grad_norm,
                    "live_replicas": ctx.world_size, "generation": 0}
                if (tc.eval_every and (step + 1) % tc.eval_every == 0) or step + 1 == tc.steps:
                    rec["val_loss"] = replica.evaluate([eval_data.batch(i) for i in range(tc.eval_batches)])
                rec["elapsed_s"] = round(time.perf_counter() - t_start, 3)
                metrics.write(rec)
        if metrics is not None:
            metrics.close()
    finally:
        shutdown()
    return 0


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench overhead`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "overhead", help="failure-free step time of recover vs plain DDP and torchft",
        description="Runs recover, torch DDP, the plain all_reduce trainer and torchft (if importable) failure-free "
                    "on the same model and batch, back to back in alternating rounds, and prints the median step "
                    "times and their ratios. Config overrides: --section.field VALUE.")
    p.add_argument("--config", default="tiny", help="preset name or .toml path (default tiny)")
    p.add_argument("--replicas", type=int, default=4, help="data-parallel processes (default 4)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all systems, alternating order (default 2)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated (default {','.join(SYSTEMS)})")
    p.add_argument("--torchft-python", default=None,
                   help="interpreter with torchft installed (default: $RECOVER_TORCHFT_PYTHON or this one)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default 900)")
    p.add_argument("--out", default="runs/bench-overhead", help="directory of the runs")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args, accepts_overrides=True)
    return p




def run_from_args(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ConfigError(f"--replicas {args.replicas}: at least 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    res = run_bench(config=args.config, replicas=args.replicas, steps=args.steps, warmup=args.warmup,
                    rounds=args.rounds, systems=systems, overrides=getattr(args, "overrides", []) or [],
                    torchft_python=args.torchft_python, out=Path(args.out), timeout_s=args.timeout)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    return 0 if all(c == 0 for r in res["systems"] for c in r["exit_codes"]) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m recover.bench.overhead ddp-worker ...`` (what ``torchrun`` starts on every rank)."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = p.add_subparsers(dest="role", required=True)
    w = sub.add_parser("ddp-worker")
    w.add_argument("--config", required=True)
    w.add_argument("--out", required=True)
    args, extra = p.parse_known_args(argv)
    args.overrides = extra
    return ddp_worker(args)


if __name__ == "__main__":
    sys.exit(main())
