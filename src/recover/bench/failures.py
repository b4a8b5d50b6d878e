"""``recover bench failures``: recover against checkpoint-and-restart, shrink-and-drop and torchft,
side by side in one run, on the same seed, model, data and failure schedule.

Contract:
- The systems run one after another, each as its own job on this machine (``recover launch``, or
  the torchft runner), into ``OUT/<name>/``: first the failure-free ``reference`` (recover with no
  failure), then ``recover``, ``restart`` and ``restart-async`` (checkpoint-and-restart with
  synchronous and with asynchronous DCP saves, ``training.checkpoint_async``), ``shrink``
  (shrink-and-drop, torchft's semantics in recover's code) and ``torchft`` (torchft 0.2.0 DDP +
  Lighthouse, when an interpreter with torchft is found). Every system gets the exact same ``--fail R@STEP:PHASE``
  specs: the ``successive`` schedule (lose half the replicas at evenly spaced steps, 2 of 4 by
  default) or a ``random`` MTBF schedule drawn once by :func:`recover.faults.random_schedule` from
  the reference's step time.
- Checkpoint-and-restart saves every K steps, K by Young/Daly from the measured save cost C of
  this model in the mode it runs (:func:`measure_save_cost`: the time ``Checkpointer.save`` blocks
  training, median of 3 after a warm-up; synchronous: the whole DCP save; asynchronous: the state
  dict and its copy to CPU memory, the write runs in the background) and the schedule's MTBF:
  ``K_s = sqrt(2 C MTBF)``, ``K = max(1, round(K_s / step_time))`` (:func:`young_daly_steps`).
  A cheaper blocking cost gives the asynchronous mode a smaller K, hence less work to redo.
- Per system (:func:`system_row`): wall time (whole job), start-up and training time (see
  :mod:`recover.bench.common`), effective throughput = committed training tokens / training
  time, its ratio to recover's and to the failure-free reference's, time lost per failure =
  (training time - committed tokens / reference throughput) / failures, min microbatches per
  committed step, max relative per-step loss deviation from the reference, final validation loss.
- ``ideal`` (:func:`ideal_tokens_per_s`): the surviving replicas' share of failure-free
  throughput: step ``s`` ideally takes ``t_ref * N / live(s)``, ``t_ref`` the reference's
  training time per step and ``live(s)`` the replicas alive at step ``s`` under the schedule.
- Outputs: a rich table on stdout, ``OUT/loss.png`` (loss curves overlaid), ``OUT/throughput.png``
  (throughput and committed tokens over time, failures marked), ``OUT/results.json`` and
  ``--json FILE`` (the same object: ``systems`` holds one object per system).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recover.bench.common import (
    Log,
    fmt,
    launch_run,
    machine_load,
    print_rich_table,
    stderr_log,
    windows,
    write_json,
)
from recover.errors import ConfigError
from recover.faults import FailureSchedule, FailureSpec, random_schedule
from recover.names import Baseline, Phase
from recover.observe.plots import load_events, load_metrics

SYSTEMS = ("recover", Baseline.RESTART.value, "restart-async", Baseline.SHRINK.value, "torchft")
RESTARTS = {Baseline.RESTART.value: False, "restart-async": True}
"""The checkpoint-and-restart systems: whether their periodic saves are asynchronous."""
"""The checkpoint-and-restart systems and whether their DCP saves are asynchronous."""
LABELS = {
    "reference": "failure-free reference (recover, no failure)",
    "recover": "recover",
    "restart": "checkpoint-and-restart (sync DCP saves)",
    "restart-async": "checkpoint-and-restart (async DCP saves)",
    "shrink": "shrink-and-drop (recover's implementation of torchft semantics)",
    "torchft": "torchft 0.2.0 DDP + Lighthouse (real torchft)",
}
SHORT = {"reference": "reference", "recover": "recover", "restart": "ckpt-restart (sync)",
         "restart-async": "ckpt-restart (async)", "shrink": "shrink-and-drop", "torchft": "torchft"}
SUCCESSIVE_PHASES = (Phase.BACKWARD.value, Phase.REDUCE.value)


# ---------------------------------------------------------------- pure parts

def young_daly_steps(save_cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Checkpoint interval in steps by Young/Daly: ``max(1, round(sqrt(2 C MTBF) / step_time))``.

    Raises:
        ConfigError: a cost, MTBF or step time that is not finite and > 0 (cost may be 0).
    """
    if not (math.isfinite(save_cost_s) and save_cost_s >= 0):
        raise ConfigError(f"save cost {save_cost_s!r} s must be finite and >= 0")
    for name, value in (("MTBF", mtbf_s), ("step time", step_time_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} {value!r} s must be finite and > 0")
    return max(1, round(math.sqrt(2.0 * save_cost_s * mtbf_s) / step_time_s))


def successive_schedule(replicas: int, steps: int, min_replicas: int = 1) -> FailureSchedule:
    """Loses ``replicas // 2`` replicas (at least 1, keeping ``min_replicas``) at evenly spaced steps.

    With 4 replicas and 60 steps: ``1@20:backward`` and ``2@40:reduce``.

    Raises:
        ConfigError: fewer than 2 replicas, or too few steps to space the failures.
    """
    lose = min(max(1, replicas // 2), replicas - min_replicas)
    if replicas < 2 or lose < 1:
        raise ConfigError(f"the successive schedule needs at least 2 replicas above min_replicas = "
                          f"{min_replicas}; got replicas = {replicas}")
    if steps < lose + 2:
        raise ConfigError(f"--steps {steps} is too short for {lose} failures; use at least {lose + 2}")
    specs = [FailureSpec(1 + i, steps * (i + 1) // (lose + 1), SUCCESSIVE_PHASES[i % len(SUCCESSIVE_PHASES)])
             for i in range(lose)]
    return FailureSchedule(specs).validate(replicas, steps, min_replicas)


def live_timeline(schedule: FailureSchedule, replicas: int, steps: int) -> list[int]:
    """Replicas alive at each step: a replica killed at step ``s`` no longer counts from ``s`` on."""
    dead_at = sorted(spec.step for spec in schedule)
    return [replicas - sum(1 for d in dead_at if d <= s) for s in range(steps)]


def ideal_tokens_per_s(ref_tokens_per_s: float, live: Sequence[int], replicas: int) -> float:
    """Failure-free throughput scaled, step by step, by the surviving replicas' share ``live / N``.

    Every step holds the same tokens, so the ideal time of step ``s`` is ``t_ref * N / live(s)``
    and the ideal throughput is the harmonic mean of ``ref * live(s) / N``.
    """
    if not live or ref_tokens_per_s <= 0:
        return 0.0
    return ref_tokens_per_s * len(live) / sum(replicas / max(n, 1) for n in live)


def system_row(name: str, run_dir: Path, ref: dict[str, Any] | None, exit_code: int = 0,
               label: str | None = None) -> dict[str, Any]:
    """The measured row of one system from its run directory (see the module docstring).

    Args:
        ref: the reference's row (None for the reference itself).
    """
    import json

    from recover.launch.report import compare

    rows = load_metrics(run_dir)
    events = load_events(run_dir)
    win = windows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    tokens = sum(r["tokens"] for r in rows)
    eff = tokens / win["train_s"]
    kills = sum(1 for e in events if e.get("kind") == "kill")
    dropped = {(e.get("step"), e.get("from_generation", e.get("participants"))) for e in events
               if e.get("kind") == "step_dropped"}
    restarts = [e for e in events if e.get("kind") == "job_restart"]
    row: dict[str, Any] = {
        "name": name, "label": label or LABELS.get(name, name), "exit_code": exit_code,
        "completed": exit_code == 0 and bool(rows) and rows[-1]["step"] + 1 == len(rows),
        "wall_s": round(summary.get("wall_s", win["end_t"] - win["launch_t"]), 3),
        "startup_s": round(win["startup_s"], 3), "train_s": round(win["train_s"], 3),
        "committed_steps": len(rows), "committed_tokens": tokens, "effective_tokens_per_s": round(eff, 2),
        "failures": kills, "restarts": len(restarts), "redone_steps": sum(e.get("lost_steps", 0) for e in restarts),
        "dropped_steps": len(dropped), "min_microbatches": min((r["microbatches"] for r in rows), default=0),
        "recovery_ms_median": summary.get("recovery_latency_ms_median"),
        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None),
        "max_rel_loss_dev": 0.0, "time_lost_per_failure_s": None, "vs_failure_free": 1.0, "run_dir": str(run_dir),
    }
    if ref is not None:
        cmp = compare(Path(ref["run_dir"]), run_dir)
        row["max_rel_loss_dev"] = cmp["max_rel_loss_diff"]
        row["vs_failure_free"] = round(eff / ref["effective_tokens_per_s"], 4)
        if kills:
            lost = win["train_s"] - tokens / ref["effective_tokens_per_s"]
            row["time_lost_per_failure_s"] = round(lost / kills, 3)
    return row


def assemble(rows: list[dict[str, Any]], schedule: FailureSchedule, replicas: int, steps: int) -> dict[str, Any]:
    """Adds ``ratio_vs_recover`` to every row and returns the ``ideal`` entry.

    Returns:
        ``{"tokens_per_s", "recover_fraction", "recover_vs_failure_free"}``; fractions None
        without a reference or a recover row.
    """
    by = {r["name"]: r for r in rows}
    rec = by.get("recover")
    for r in rows:
        r["ratio_vs_recover"] = (round(r["effective_tokens_per_s"] / rec["effective_tokens_per_s"], 4)
                                 if rec and rec["effective_tokens_per_s"] > 0 else None)
    ref = by.get("reference")
    if ref is None:
        return {"tokens_per_s": None, "recover_fraction": None, "recover_vs_failure_free": None}
    ideal = ideal_tokens_per_s(ref["effective_tokens_per_s"], live_timeline(schedule, replicas, steps), replicas)
    return {"tokens_per_s": round(ideal, 2),
            "recover_fraction": round(rec["effective_tokens_per_s"] / ideal, 4) if rec and ideal else None,
            "recover_vs_failure_free": rec["vs_failure_free"] if rec else None}


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append([
            SHORT.get(r["name"], r["name"]) + (f" K={r['checkpoint_every']}" if r.get("checkpoint_every") else "")
            + ("" if r["completed"] else " (INCOMPLETE)"), fmt(r["wall_s"], ".1f"),
            fmt(r["train_s"], ".1f"), fmt(r["effective_tokens_per_s"], ",.0f"), fmt(r.get("ratio_vs_recover"), ".3f"),
            fmt(r["vs_failure_free"], ".3f"), fmt(r["time_lost_per_failure_s"], ".2f"), str(r["min_microbatches"]),
            fmt(r["max_rel_loss_dev"], ".2e"), fmt(r["final_val_loss"], ".4f"),
        ])
    return out


COLUMNS = ("system", "wall s", "train s", "eff. tok/s", "x recover", "x failure-free", "lost s/failure",
           "min mb/step", "max rel loss dev", "final val loss")


def print_result(res: dict[str, Any]) -> None:
    ideal, yd, sched = res["ideal"], res["young_daly"], res["schedule"]
    notes = [f"{SHORT.get(r['name'], r['name'])}: {r['label']}" for r in res["systems"]]
    notes += [
        f"schedule {sched['kind']}: {' '.join(sched['fails']) or '(none)'}"
        + (f" (MTBF {sched['mtbf_s']:.1f} s)" if sched.get("mtbf_s") else ""),
    ]
    for mode, m in (("sync", yd), ("async", yd.get("async"))):
        if m and m.get("save_cost_s") is not None:
            notes.append(f"checkpoint-and-restart ({mode}): save blocks C = {m['save_cost_s'] * 1000:.0f} ms"
                         + (f" (whole save {m['save_total_s'] * 1000:.0f} ms)" if m.get("save_total_s") else "")
                         + f", MTBF {yd['mtbf_s']:.1f} s, step {yd['step_time_s']:.3f} s -> Young/Daly K = "
                         f"{m['checkpoint_every']} steps" + (" (overridden)" if yd.get("overridden") else ""))
    if ideal["tokens_per_s"]:
        notes.append(f"ideal (surviving replicas' share of failure-free throughput): "
                     f"{ideal['tokens_per_s']:,.0f} tok/s; recover = {fmt(ideal['recover_fraction'], '.3f')} of ideal, "
                     f"{fmt(ideal['recover_vs_failure_free'], '.3f')} of failure-free")
    for name, why in res.get("skipped", {}).items():
        notes.append(f"{name}: not run ({why})")
    notes.append(f"load average before/after: {res['load']['before']} / {res['load']['after']}; "
                 f"benchmark wall {res['bench_wall_s']:.0f} s; outputs in {res['out']}")
    title = (f"bench failures: {res['config']} x{res['replicas']} replicas, {res['steps']} steps, "
             f"M = {res['microbatches']}")
    print_rich_table(title, COLUMNS, table_rows(res["systems"]), notes)


# ---------------------------------------------------------------- plots

def plot_results(out: Path, rows: Sequence[dict[str, Any]]) -> list[Path]:
    """``loss.png`` (every system's loss per step over the reference) and ``throughput.png``."""
    from recover.observe.plots import _pyplot

    plt = _pyplot()
    colors = {"reference": "0.55", "recover": "C0", "restart": "C3", "restart-async": "C4", "shrink": "C1",
              "torchft": "C2"}
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for r in rows:
        m = load_metrics(r["run_dir"])
        ref = r["name"] == "reference"
        ax.plot([x["step"] + 1 for x in m], [x["loss"] for x in m], color=colors.get(r["name"]),
                lw=3.5 if ref else 1.2, alpha=0.5 if ref else 0.9, label=r["label"])
    for spec in {e.get("step") for r in rows for e in load_events(r["run_dir"]) if e.get("kind") == "kill"}:
        ax.axvline((spec or 0) + 1, color="tab:red", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("loss per committed step (red dotted: replica killed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    loss_png = out / "loss.png"
    fig.savefig(loss_png)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), dpi=110, sharex=True)
    for r in rows:
        color = colors.get(r["name"])
        t, rate, cum = throughput_series(Path(r["run_dir"]))
        ax1.plot(t, rate, color=color, lw=1.3, label=r["label"])
        ax2.plot(t, cum, color=color, lw=1.3)
        start = windows(Path(r["run_dir"]))["start_t"]
        for e in load_events(r["run_dir"]):
            if e.get("kind") == "kill":
                for ax in (ax1, ax2):
                    ax.axvline(e["t"] - start, color=color, ls="--", lw=1, alpha=0.8)
    ax1.set_ylabel("committed tokens/s (sliding)")
    ax1.set_title("throughput over time (dashed: a replica killed, in the system's colour)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("committed tokens")
    ax2.set_xlabel("seconds since training started")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    tput_png = out / "throughput.png"
    fig.savefig(tput_png)
    plt.close(fig)
    return [loss_png, tput_png]


def throughput_series(run_dir: Path, window: int | None = None) -> tuple[list[float], list[float], list[float]]:
    """(seconds since training start, sliding committed tokens/s, cumulative committed tokens) per step."""
    rows = sorted(load_metrics(run_dir), key=lambda r: r["elapsed_s"])
    win = windows(run_dir)
    t = [win["launch_t"] + r["elapsed_s"] - win["start_t"] for r in rows]
    cum, total = [], 0
    for r in rows:
        total += r["tokens"]
        cum.append(total)
    k = window or max(2, len(rows) // 15)
    rate = []
    for i in range(len(rows)):
        j = max(-1, i - k)
        t0 = t[j] if j >= 0 else 0.0
        done = cum[i] - (cum[j] if j >= 0 else 0)
        rate.append(done / (t[i] - t0) if t[i] > t0 else 0.0)
    return t, rate, cum


# ---------------------------------------------------------------- measurement

def measure_save_cost(config: str, overrides: Sequence[str], replicas: int, repeats: int = 3,
                      asynchronous: bool = False) -> tuple[float, float]:
    """(blocking, whole) median seconds of ``Checkpointer.save`` (a DCP checkpoint) of this model, after a warm-up save.

    ``blocking`` is how long the call holds training: the whole save when synchronous; with
    ``asynchronous`` the state dict, its copy to CPU memory and starting the writer thread.
    ``whole`` runs until the checkpoint is committed (equal to ``blocking`` when synchronous).
    Each asynchronous save is awaited before the next one starts, outside the blocking time.
    """
    from recover.config import load_config
    from recover.data.prepare import resolve_data_dir
    from recover.train.checkpoint import Checkpointer
    from recover.train.dist import DistContext
    from recover.train.trainer import build_replica

    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}",
                               f"--training.checkpoint_async={str(asynchronous).lower()}"])
    with tempfile.TemporaryDirectory(prefix="recover-save-cost-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        replica, _ = build_replica(cfg, DistContext(local_world_size=replicas),
                                   resolve_data_dir(cfg.data, quiet=True))
        checkpointer = Checkpointer(tmp, replica, cfg)
        checkpointer.save(0, 0, 0, blocking=True)
        blocking, whole = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            checkpointer.save(i + 1, i + 1, 0, blocking=False)
            blocking.append(time.perf_counter() - t0)
            checkpointer.wait()
            whole.append(time.perf_counter() - t0)
    return statistics.median(blocking), statistics.median(whole)


def find_torchft_python(explicit: str | None) -> tuple[str | None, str]:
    """The interpreter for torchft: ``explicit``, ``$RECOVER_TORCHFT_PYTHON`` or this one, if torchft imports."""
    from recover.bench.torchft_runner import torchft_available

    python = explicit or os.environ.get("RECOVER_TORCHFT_PYTHON") or sys.executable
    ok, why = torchft_available(python)
    return (python, why) if ok else (None, f"torchft does not import: {why}; pip install 'recover-llm[bench]' "
                                           "or pass --torchft-python")


def run_bench(config: str = "tiny", replicas: int = 4, steps: int = 60, schedule_kind: str = "successive",
              mtbf_s: float | None = None, seed: int = 0, out: Path = Path("runs/bench-failures"),
              systems: Sequence[str] = SYSTEMS, overrides: Sequence[str] = (), checkpoint_every: int | None = None,
              torchft_python: str | None = None, timeout_s: float = 1200.0, log: Log = stderr_log) -> dict[str, Any]:
    """Runs the reference and ``systems`` on one schedule; returns the result object (see the module docstring).

    Raises:
        ConfigError: a bad argument (named with the fix).
        RuntimeError: the failure-free reference did not complete.
    """
    from recover.config import load_config

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ConfigError(f"--systems {','.join(unknown)}: unknown; choose from {','.join(SYSTEMS)}")
    if schedule_kind not in ("successive", "random"):
        raise ConfigError(f"--schedule {schedule_kind!r}: use successive or random")
    if mtbf_s is not None and not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ConfigError(f"--mtbf {mtbf_s}: a positive number of seconds")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every {checkpoint_every}: at least 1 (or leave it to Young/Daly)")
    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}", f"--training.steps={steps}"])
    min_rep = cfg.fault_tolerance.min_replicas
    if schedule_kind == "successive":
        successive_schedule(replicas, steps, min_rep)  # refuse a bad size before running anything
    t_bench = time.time()
    load_before = machine_load()
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    tft_python = None
    if "torchft" in systems:
        tft_python, why = find_torchft_python(torchft_python)
        if tft_python is None:
            skipped["torchft"] = why
            log(f"torchft: skipped ({why})")

    def run_one(name: str, fails: Sequence[str], baseline: str | None = None, extra: Sequence[str] = ()) -> int:
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        log(f"[{time.strftime('%H:%M:%S')}] {name}: running (load {machine_load()})")
        t0 = time.time()
        if name == "torchft":
            from recover.bench.torchft_runner import run_torchft

            code = run_torchft(run_dir, config, replicas, steps, fails, overrides, tft_python, timeout_s)
        else:
            code = launch_run(run_dir, config, replicas, steps, fails, baseline, [*overrides, *extra], timeout_s)
        log(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code} after {time.time() - t0:.0f} s")
        return code

    code = run_one("reference", [])
    ref = system_row("reference", out / "reference", None, code)
    if not ref["completed"]:
        raise RuntimeError(f"the failure-free reference did not complete (exit {code}); see {out / 'reference.log'}")
    step_time = ref["train_s"] / steps
    if schedule_kind == "successive":
        schedule = successive_schedule(replicas, steps, min_rep)
        mtbf = ref["train_s"] / len(schedule)
    else:
        mtbf = mtbf_s or ref["train_s"] / 3
        schedule = random_schedule(replicas, steps, mtbf, step_time, seed, min_rep)
    fails = [str(s) for s in schedule]
    log(f"schedule {schedule_kind}: {' '.join(fails) or '(no failure drawn)'}")
    young_daly: dict[str, Any] = {"save_cost_s": None, "save_total_s": None, "mtbf_s": round(mtbf, 3),
                                  "step_time_s": round(step_time, 4), "interval_s": None, "checkpoint_every": None,
                                  "overridden": checkpoint_every is not None}
    ks: dict[str, int] = {}
    for name, asynchronous in RESTARTS.items():
        if name not in systems:
            continue
        cost, whole = measure_save_cost(config, overrides, replicas, asynchronous=asynchronous)
        ks[name] = checkpoint_every or young_daly_steps(cost, mtbf, step_time)
        mode = {"save_cost_s": round(cost, 4), "save_total_s": round(whole, 4),
                "interval_s": round(math.sqrt(2 * cost * mtbf), 3), "checkpoint_every": ks[name]}
        if asynchronous:
            young_daly["async"] = mode
        else:
            young_daly.update(mode)
        log(f"{name}: save blocks {cost * 1000:.0f} ms (whole save {whole * 1000:.0f} ms) -> K = {ks[name]}")
    rows = [ref]
    for name in systems:
        if name in skipped:
            continue
        extra, label = [], None
        if name in RESTARTS:
            extra = [f"--training.checkpoint_every={ks[name]}",
                     f"--training.checkpoint_async={str(RESTARTS[name]).lower()}"]
            label = f"{LABELS[name]}, checkpoint every K = {ks[name]} steps"
        baseline = Baseline.RESTART if name in RESTARTS else Baseline.SHRINK if name == Baseline.SHRINK else None
        code = run_one(name, fails, baseline, extra)
        try:
            rows.append(system_row(name, out / name, ref, code, label))
            if name in RESTARTS:
                rows[-1]["checkpoint_every"] = ks[name]
                rows[-1]["checkpoint_async"] = RESTARTS[name]
        except ValueError as exc:
            skipped[name] = f"no result: {exc}"
    ideal = assemble(rows, schedule, replicas, steps)
    res: dict[str, Any] = {
        "benchmark": "failures", "config": config, "replicas": replicas, "steps": steps,
        "microbatches": cfg.training.global_microbatches, "overrides": list(overrides),
        "schedule": {"kind": schedule_kind, "fails": fails, "mtbf_s": round(mtbf, 3), "seed": seed},
        "young_daly": young_daly,
        "ideal": ideal, "systems": rows, "skipped": skipped,
        "load": {"before": load_before, "after": machine_load()}, "bench_wall_s": round(time.time() - t_bench, 1),
        "out": str(out),
    }
    try:
        res["plots"] = [str(p) for p in plot_results(out, rows)]
    except Exception as exc:  # a plot never fails a benchmark
        log(f"warning: plots not written: {exc}")
    write_json(out / "results.json", res)
    return res


# ---------------------------------------------------------------- command line

def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench failures`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "failures", help="recover vs checkpoint-and-restart vs shrink-and-drop vs torchft, same failures",
        description="Runs a failure-free reference, recover, checkpoint-and-restart with synchronous and with "
                    "asynchronous DCP saves (K by Young/Daly from each mode's blocking save cost), "
                    "shrink-and-drop and torchft (if importable) on the same seed, model and failure schedule; "
                    "prints wall time, effective throughput, time lost per failure, min microbatches per step, "
                    "loss deviation from the reference and final validation loss. Config overrides: "
                    "--section.field VALUE (applied to every system).")
    p.add_argument("--config", default="tiny", help="preset name or .toml path (default tiny)")
    p.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--steps", type=int, default=60, help="committed steps per system (default 60)")
    p.add_argument("--schedule", choices=("successive", "random"), default="successive",
                   help="successive: lose half the replicas at evenly spaced steps; random: MTBF schedule")
    p.add_argument("--mtbf", type=float, default=None,
                   help="random schedule: job MTBF in seconds (default: a third of the reference's training time)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random schedule")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, besides the reference (default {','.join(SYSTEMS)})")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="checkpoint-and-restart interval in steps (default: Young/Daly)")
    p.add_argument("--torchft-python", default=None,
                   help="interpreter with torchft installed (default: $RECOVER_TORCHFT_PYTHON or this one)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per system (default 1200)")
    p.add_argument("--out", default="runs/bench-failures", help="directory of the runs and plots")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args, accepts_overrides=True)
    return p




def run_from_args(args: argparse.Namespace) -> int:
    if args.replicas < 2:
        raise ConfigError(f"--replicas {args.replicas}: at least 2, so that one can fail")
    if args.steps < 4:
        raise ConfigError(f"--steps {args.steps}: at least 4")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    res = run_bench(config=args.config, replicas=args.replicas, steps=args.steps, schedule_kind=args.schedule,
                    mtbf_s=args.mtbf, seed=args.seed, out=Path(args.out), systems=systems,
                    overrides=getattr(args, "overrides", []) or [], checkpoint_every=args.checkpoint_every,
                    torchft_python=args.torchft_python, timeout_s=args.timeout)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    return 0 if all(r["completed"] for r in res["systems"]) else 1
