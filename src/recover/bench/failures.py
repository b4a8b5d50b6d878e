"""``recover bench failures``: recover against checkpoint-and-restart, shrink-and-drop and torchft,
side by side, on the same seed, model, data and failure schedule, on emulated devices, in rounds.

Contract:
- Emulated devices (``device_time_s``, ``--device-time-s``, default :data:`DEVICE_TIME_S`): every
  system runs with ``training.device_time_s`` = T, so every microbatch takes at least T of wall
  time (real compute, then a sleep; the arithmetic is unchanged): replicas then behave like
  dedicated accelerators, and survivors do not speed up by inheriting the CPU cores of dead
  replicas. ``recover``, ``restart`` and ``shrink`` get it as the launcher override
  ``--training.device_time_s=T``, torchft through its runner (which honours the same setting). T = 0
  means real compute only (replicas share this machine's cores). Before the runs the real compute
  of one microbatch is measured once (:func:`measure_compute_s`) and reported; a warning is logged
  and printed when T is below :data:`DOMINANCE` x that time scaled by the replicas sharing the
  cores (:func:`device_dominates`). Setting ``training.device_time_s`` as a config override is
  refused: the option is the one way to set it.
- Rounds (``rounds``, ``--rounds``, default :data:`ROUNDS`, at least 1): every system, the
  failure-free ``reference`` included, runs once per round, each as its own job on this machine
  (``recover launch``, or the torchft runner) into ``OUT/round<r>/<name>/``; round ``r`` runs the
  systems forward for even ``r`` and reversed for odd ``r`` (:func:`recover.bench.common.round_orders`),
  so a drift of the machine's load is spread evenly. The systems, in forward order: ``reference``
  (recover with no failure), ``recover``, ``restart`` and ``restart-async`` (checkpoint-and-restart
  with synchronous and with asynchronous DCP saves, ``training.checkpoint_async``), ``shrink``
  (shrink-and-drop, torchft's semantics in recover's code) and ``torchft`` (torchft 0.2.0 DDP +
  Lighthouse, when an interpreter with torchft is found).
- One schedule and one K for all rounds, fixed after the first round's reference (which runs first):
  every system gets the exact same ``--fail R@STEP:PHASE`` specs in every round, from the
  ``successive`` schedule (lose half the replicas at evenly spaced steps, 2 of 4 by default) or a
  ``random`` MTBF schedule drawn once by :func:`recover.faults.random_schedule` from that
  reference's step time. Checkpoint-and-restart saves every K steps, K by Young/Daly from the
  measured save cost C of this model in the mode it runs (:func:`measure_save_cost`: the time
  ``Checkpointer.save`` blocks training, median of 3 after a warm-up; synchronous: the whole DCP
  save; asynchronous: the state dict and its copy to CPU memory, the write runs in the background)
  and the schedule's MTBF: ``K_s = sqrt(2 C MTBF)``, ``K = max(1, round(K_s / step_time))``
  (:func:`young_daly_steps`), measured once.
- Per run (:func:`system_row`, against the same round's reference): wall time (whole job), start-up
  and training time (see :mod:`recover.bench.common`), effective throughput = committed training
  tokens / training time, time lost per failure = (training time - committed tokens / reference
  throughput) / failures, min microbatches per committed step, max relative per-step loss deviation
  from the reference, final validation loss, and the load average when it started.
- Per system (:func:`aggregate_rounds`): ``effective_tokens_per_s`` is the median over rounds, with
  ``tokens_per_s_min``, ``tokens_per_s_max`` and ``rel_spread`` = (max - min) / median; wall, start-up
  and training time and time lost per failure are medians; ``min_microbatches`` the fewest and
  ``max_rel_loss_dev`` the largest over rounds; ``completed`` only if every round completed; the
  other fields are those of the system's median round (the round of the median throughput, the
  lower of the two middle ones for an even count), which is also the one plotted; ``rounds`` keeps
  the per-round rows.
- Ratios (:func:`assemble`), all of medians: ``vs_ideal`` = throughput / ideal, ``ratio_vs_recover``
  = throughput / recover's, ``vs_failure_free`` = throughput / the reference's. ``ideal``
  (:func:`ideal_tokens_per_s`) is the surviving replicas' share of the reference's median
  throughput: step ``s`` ideally takes ``t_ref * N / live(s)``, ``t_ref`` the reference's training
  time per step and ``live(s)`` the replicas alive at step ``s`` under the schedule. Each per-round
  row also gets its paired ``vs_ideal`` and ``ratio_vs_recover`` (against the same round's reference
  and recover).
- Outputs: a rich table on stdout (medians, spread, ratios), ``OUT/loss.png`` (loss curves
  overlaid) and ``OUT/throughput.png`` (throughput and committed tokens over time, failures
  marked), both of each system's median round, ``OUT/results.json`` and ``--json FILE`` (the same
  object: ``systems`` holds one object per system, with its per-round rows in ``rounds``).
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
    contended_compute_s,
    fmt,
    launch_run,
    machine_load,
    measure_compute_s,
    median,
    print_rich_table,
    round_orders,
    spread,
    stderr_log,
    windows,
    write_json,
)
from recover.errors import ConfigError
from recover.faults import FailureSchedule, FailureSpec, random_schedule
from recover.names import Baseline, Event, Phase
from recover.observe.plots import load_events, load_metrics
from recover.train.checkpoints.cadence import young_daly_interval_s, young_daly_steps

SYSTEMS = ("recover", Baseline.RESTART.value, "restart-async", Baseline.SHRINK.value, "torchft")
RESTARTS = {Baseline.RESTART.value: False, "restart-async": True}
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
DEVICE_TIME_S = 0.25
"""Default emulated device time per microbatch, a fixed value (comparable across runs) chosen for the
``tiny`` preset on the 2-core CI machine: one microbatch's real compute there is ~50-70 ms on one
thread when the machine is quiet, ~100-140 ms when 4 replicas share the 2 cores. A failure-free
4-replica step then took 0.52-0.58 s at T = 0.25 s (2 microbatches + ~33 ms of all-reduce, optimizer
and vote: the emulated time dominates), against 0.33-0.44 s at T = 0.15 s and 0.26-0.38 s at T = 0."""
DOMINANCE = 1.5
"""The emulated time dominates real compute when T >= this x the contended compute per microbatch."""
ROUNDS = 3
RUN_KEYS = ("round", "load", "exit_code", "error")
"""Per-round fields that an aggregated row does not copy from its median round."""


# ---------------------------------------------------------------- pure parts

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
    """The measured row of one run of a system, from its run directory (see the module docstring).

    Args:
        ref: the same round's reference row (None for the reference itself); the loss deviation,
            ``vs_failure_free`` and the time lost per failure are against it.
    Raises:
        ValueError: the run directory has no launch event or no committed step.
    """
    import json

    from recover.launch.report import compare

    rows = load_metrics(run_dir)
    events = load_events(run_dir)
    win = windows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    tokens = sum(r["tokens"] for r in rows)
    eff = tokens / win["train_s"]
    kills = sum(1 for e in events if e.get("kind") == Event.KILL)
    dropped = {(e.get("step"), e.get("from_generation", e.get("participants"))) for e in events
               if e.get("kind") == Event.STEP_DROPPED}
    restarts = [e for e in events if e.get("kind") == Event.JOB_RESTART]
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


def median_round(round_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round of the median throughput (the lower of the two middle ones for an even count).

    Raises:
        ValueError: ``round_rows`` is empty.
    """
    if not round_rows:
        raise ValueError("no round to choose from")
    ordered = sorted(round_rows, key=lambda r: (r["effective_tokens_per_s"], r["round"]))
    return ordered[(len(ordered) - 1) // 2]


def aggregate_rounds(round_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's row over its rounds (see the module docstring).

    Args:
        round_rows: the system's per-round rows (:func:`system_row` plus ``round``); a round without
            a result is a row without ``effective_tokens_per_s`` (it only makes ``completed`` False).
    Raises:
        ValueError: no round has a result.
    """
    measured = [r for r in round_rows if "effective_tokens_per_s" in r]
    if not measured:
        raise ValueError("no round produced a result")
    mid = median_round(measured)
    row = {k: v for k, v in mid.items() if k not in RUN_KEYS}
    tps = spread([r["effective_tokens_per_s"] for r in measured])
    row.update({
        "effective_tokens_per_s": round(tps["median"], 2), "tokens_per_s_min": tps["min"],
        "tokens_per_s_max": tps["max"],
        "rel_spread": round(tps["rel_spread"], 4) if tps["rel_spread"] is not None else None,
        "completed": all(r.get("completed") for r in round_rows),
        "min_microbatches": min(r["min_microbatches"] for r in measured),
        "max_rel_loss_dev": max(r["max_rel_loss_dev"] for r in measured),
        "median_round": mid["round"], "exit_codes": [r.get("exit_code") for r in round_rows],
        "rounds": list(round_rows),
    })
    for key in ("wall_s", "startup_s", "train_s", "time_lost_per_failure_s"):
        value = median([r[key] for r in measured if r.get(key) is not None])
        row[key] = round(value, 3) if value is not None else None
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def assemble(rows: list[dict[str, Any]], schedule: FailureSchedule, replicas: int, steps: int) -> dict[str, Any]:
    """Adds the ratios to every aggregated row and its rounds; returns the ``ideal`` entry.

    Sets ``vs_ideal``, ``ratio_vs_recover`` and ``vs_failure_free`` (ratios of medians; None without
    the reference or recover) on each row of :func:`aggregate_rounds`, and the paired ``vs_ideal``
    and ``ratio_vs_recover`` on each of its per-round rows (against that round's reference and recover).

    Returns:
        ``{"tokens_per_s", "reference_tokens_per_s", "recover_fraction", "recover_fraction_per_round",
        "recover_vs_failure_free"}``; None where the reference or recover is missing.
    """
    by = {r["name"]: r for r in rows}
    live = live_timeline(schedule, replicas, steps)

    def per_round(name: str) -> dict[int, float]:
        return {x["round"]: x["effective_tokens_per_s"] for x in by[name]["rounds"]
                if "effective_tokens_per_s" in x} if name in by else {}

    ref_by_round, rec_by_round = per_round("reference"), per_round("recover")
    ref_tps = by["reference"]["effective_tokens_per_s"] if "reference" in by else None
    rec_tps = by["recover"]["effective_tokens_per_s"] if "recover" in by else None
    ideal = ideal_tokens_per_s(ref_tps, live, replicas) if ref_tps else None
    for r in rows:
        tps = r["effective_tokens_per_s"]
        r.update(vs_ideal=_ratio(tps, ideal), ratio_vs_recover=_ratio(tps, rec_tps),
                 vs_failure_free=_ratio(tps, ref_tps))
        for x in r["rounds"]:
            if "effective_tokens_per_s" in x:
                ref_x = ref_by_round.get(x["round"])
                x["vs_ideal"] = _ratio(x["effective_tokens_per_s"],
                                       ideal_tokens_per_s(ref_x, live, replicas) if ref_x else None)
                x["ratio_vs_recover"] = _ratio(x["effective_tokens_per_s"], rec_by_round.get(x["round"]))
    rec = by.get("recover")
    return {"tokens_per_s": round(ideal, 2) if ideal else None, "reference_tokens_per_s": ref_tps,
            "recover_fraction": rec["vs_ideal"] if rec else None,
            "recover_fraction_per_round": [x.get("vs_ideal") for x in rec["rounds"]] if rec else None,
            "recover_vs_failure_free": rec["vs_failure_free"] if rec else None}


def device_dominates(device_time_s: float, contended_s: float) -> bool:
    """Whether the emulated device time hides real compute: ``T >= DOMINANCE x contended`` (T = 0: no)."""
    return device_time_s > 0 and device_time_s >= DOMINANCE * contended_s


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One table row per system (the cells of :data:`COLUMNS`)."""
    out = []
    for r in rows:
        several = len(r["rounds"]) > 1  # the spread of a single round says nothing
        out.append([
            SHORT.get(r["name"], r["name"]) + (f" K={r['checkpoint_every']}" if r.get("checkpoint_every") else "")
            + ("" if r["completed"] else " (INCOMPLETE)"), fmt(r["wall_s"], ".1f"),
            fmt(r["train_s"], ".1f"), fmt(r["effective_tokens_per_s"], ",.0f"),
            f"{r['rel_spread'] * 100:.1f}%" if several and r["rel_spread"] is not None else "-",
            fmt(r.get("vs_ideal"), ".3f"), fmt(r.get("ratio_vs_recover"), ".3f"), fmt(r.get("vs_failure_free"), ".3f"),
            fmt(r["time_lost_per_failure_s"], ".2f"), str(r["min_microbatches"]),
            fmt(r["max_rel_loss_dev"], ".2e"), fmt(r["final_val_loss"], ".4f"),
        ])
    return out


COLUMNS = ("system", "wall s", "train s", "eff. tok/s", "spread", "x ideal", "x recover", "x failure-free",
           "lost s/failure", "min mb/step", "max rel loss dev", "final val loss")


def device_note(device: dict[str, Any]) -> str:
    """One line on the emulated devices (or real compute) and the measured compute per microbatch."""
    real = (f"real compute {device['compute_s'] * 1000:.0f} ms per microbatch on {device['threads']} thread(s), "
            f"~{device['contended_s'] * 1000:.0f} ms with {device['replicas']} replicas sharing "
            f"{device['cores']} cores")
    if not device["time_s"]:
        return (f"real compute only (--device-time-s 0): {real}; survivors run faster once others die, "
                "so ratios to ideal are not those of dedicated devices")
    line = (f"emulated devices: every microbatch takes >= {device['time_s'] * 1000:.0f} ms "
            f"(training.device_time_s, all systems); {real}")
    if not device["dominates"]:
        line += (f"; WARNING: below {DOMINANCE:g} x the contended compute, real compute still shows: "
                 "raise --device-time-s")
    return line


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
    notes.append(device_note(res["device"]))
    if res["rounds"] > 1:
        notes.append(f"medians over {res['rounds']} rounds, run in alternating order (forward, then reversed); "
                     "spread = (max - min) / median of eff. tok/s; x ideal, x recover, x failure-free: ratios of "
                     "medians; plots: each system's median round")
    else:
        notes.append("one round (--rounds 1): single runs, no spread; on a shared machine use 3 or more")
    if ideal["tokens_per_s"]:
        per_round = ", ".join(fmt(x, ".3f") for x in ideal.get("recover_fraction_per_round") or [])
        notes.append(f"ideal (surviving replicas' share of the reference's median throughput): "
                     f"{ideal['tokens_per_s']:,.0f} tok/s; recover = {fmt(ideal['recover_fraction'], '.3f')} of ideal"
                     + (f" (per round: {per_round})" if per_round else "")
                     + f", {fmt(ideal['recover_vs_failure_free'], '.3f')} of failure-free")
    for name, why in res.get("skipped", {}).items():
        notes.append(f"{name}: not run ({why})")
    notes.append(f"load average before/after: {res['load']['before']} / {res['load']['after']}; "
                 f"benchmark wall {res['bench_wall_s']:.0f} s; outputs in {res['out']}")
    title = (f"bench failures: {res['config']} x{res['replicas']} replicas, {res['steps']} steps, "
             f"M = {res['microbatches']}, {res['rounds']} round(s), device time {res['device']['time_s']:g} s")
    print_rich_table(title, COLUMNS, table_rows(res["systems"]), notes)


# ---------------------------------------------------------------- plots

def plot_results(out: Path, rows: Sequence[dict[str, Any]], which: str = "") -> list[Path]:
    """``loss.png`` (every system's loss per step over the reference) and ``throughput.png``.

    Each row's ``run_dir`` is plotted; ``which`` names that run in the titles (e.g. "median round").
    """
    which = f", {which}" if which else ""
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
    for spec in {e.get("step") for r in rows for e in load_events(r["run_dir"]) if e.get("kind") == Event.KILL}:
        ax.axvline((spec or 0) + 1, color="tab:red", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"loss per committed step{which} (red dotted: replica killed)")
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
            if e.get("kind") == Event.KILL:
                for ax in (ax1, ax2):
                    ax.axvline(e["t"] - start, color=color, ls="--", lw=1, alpha=0.8)
    ax1.set_ylabel("committed tokens/s (sliding)")
    ax1.set_title(f"throughput over time{which} (dashed: a replica killed, in the system's colour)")
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

def _build_replica(config: str, overrides: Sequence[str], replicas: int) -> tuple[Any, Any]:
    """(config, replica) of this model built in this process as replica 0 of ``replicas`` (no process group)."""
    from recover.config import load_config
    from recover.data.prepare import prepared_data_dir
    from recover.train.processes.trainer import build_replica
    from recover.train.replicas.dist import DistContext

    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}"])
    replica, _ = build_replica(cfg, DistContext(local_world_size=replicas), prepared_data_dir(cfg.data, quiet=True))
    return cfg, replica


def measure_save_cost(config: str, overrides: Sequence[str], replicas: int, repeats: int = 3,
                      asynchronous: bool = False) -> tuple[float, float]:
    """(blocking, whole) median seconds of ``Checkpointer.save`` (a DCP checkpoint) of this model, after a warm-up save.

    ``blocking`` is how long the call holds training: the whole save when synchronous; with
    ``asynchronous`` the state dict, its copy to CPU memory and starting the writer thread.
    ``whole`` runs until the checkpoint is committed (equal to ``blocking`` when synchronous).
    Each asynchronous save is awaited before the next one starts, outside the blocking time.
    """
    from recover.train.checkpoints.checkpoint import Checkpointer

    with tempfile.TemporaryDirectory(prefix="recover-save-cost-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        cfg, replica = _build_replica(
            config, [*overrides, f"--training.checkpoint_async={str(asynchronous).lower()}"], replicas)
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


def system_args(name: str, ks: dict[str, int]) -> tuple[str | None, list[str], str]:
    """(``--baseline``, extra config overrides, label) of a system run by ``recover launch``.

    Args:
        ks: the checkpoint interval K of each checkpoint-and-restart system.
    """
    if name in RESTARTS:
        return (Baseline.RESTART.value, [f"--training.checkpoint_every={ks[name]}",
                                         f"--training.checkpoint_async={str(RESTARTS[name]).lower()}"],
                f"{LABELS[name]}, checkpoint every K = {ks[name]} steps")
    return Baseline.SHRINK.value if name == Baseline.SHRINK.value else None, [], LABELS.get(name, name)


def run_bench(config: str = "tiny", replicas: int = 4, steps: int = 60, schedule_kind: str = "successive",
              mtbf_s: float | None = None, seed: int = 0, out: Path = Path("runs/bench-failures"),
              systems: Sequence[str] = SYSTEMS, overrides: Sequence[str] = (), checkpoint_every: int | None = None,
              torchft_python: str | None = None, timeout_s: float = 1200.0, device_time_s: float = DEVICE_TIME_S,
              rounds: int = ROUNDS, log: Log = stderr_log) -> dict[str, Any]:
    """Runs the reference and ``systems`` for ``rounds`` rounds on one schedule, on emulated devices of
    ``device_time_s`` per microbatch; returns the result object (see the module docstring).

    Raises:
        ConfigError: a bad argument (named with the fix), before anything runs.
        RuntimeError: the first round's failure-free reference did not complete.
    """
    from recover.bench.torchft_runner import run_torchft
    from recover.config import load_config, parse_overrides

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ConfigError(f"--systems {','.join(unknown)}: unknown; choose from {','.join(SYSTEMS)}")
    if schedule_kind not in ("successive", "random"):
        raise ConfigError(f"--schedule {schedule_kind!r}: use successive or random")
    if mtbf_s is not None and not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ConfigError(f"--mtbf {mtbf_s}: a positive number of seconds")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every {checkpoint_every}: at least 1 (or leave it to Young/Daly)")
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: at least 1 (every system runs once per round)")
    if not (math.isfinite(device_time_s) and device_time_s >= 0):
        raise ConfigError(f"--device-time-s {device_time_s}: seconds per microbatch, >= 0 (0: real compute only)")
    if "training.device_time_s" in parse_overrides(list(overrides)):
        raise ConfigError("--training.device_time_s: set the emulated device time with --device-time-s instead")
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
    _, compute_s, threads = measure_compute_s(config, overrides, replicas, repeats=5)
    cores = os.cpu_count() or 1
    contended = contended_compute_s(compute_s, replicas, threads, cores)
    device = {"time_s": device_time_s, "compute_s": round(compute_s, 4), "threads": threads, "replicas": replicas,
              "cores": cores, "contended_s": round(contended, 4),
              "dominates": device_dominates(device_time_s, contended)}
    log(device_note(device))
    run_overrides = [*overrides, f"--training.device_time_s={device_time_s}"]
    active = ["reference", *dict.fromkeys(s for s in systems if s not in skipped)]
    runs: dict[str, list[tuple[int, int, list[float]]]] = {name: [] for name in active}  # (round, exit, load)
    plan: dict[str, Any] = {}

    def fix_plan(ref: dict[str, Any]) -> dict[str, Any]:
        """The schedule, its MTBF and K of each checkpoint-and-restart system, from the first reference."""
        if not ref.get("completed"):
            raise RuntimeError(f"the failure-free reference did not complete (exit {ref.get('exit_code')}); "
                               f"see {out / 'round0' / 'reference.log'}")
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
                                      "step_time_s": round(step_time, 4), "interval_s": None,
                                      "checkpoint_every": None, "overridden": checkpoint_every is not None}
        ks: dict[str, int] = {}
        for name, asynchronous in RESTARTS.items():
            if name not in active:
                continue
            cost, whole = measure_save_cost(config, overrides, replicas, asynchronous=asynchronous)
            ks[name] = checkpoint_every or young_daly_steps(cost, mtbf, step_time)
            mode = {"save_cost_s": round(cost, 4), "save_total_s": round(whole, 4),
                    "interval_s": round(young_daly_interval_s(cost, mtbf), 3), "checkpoint_every": ks[name]}
            if asynchronous:
                young_daly["async"] = mode
            else:
                young_daly.update(mode)
            log(f"{name}: save blocks {cost * 1000:.0f} ms (whole save {whole * 1000:.0f} ms) -> K = {ks[name]}")
        return {"schedule": schedule, "fails": fails, "mtbf_s": mtbf, "young_daly": young_daly, "ks": ks}

    def measured(name: str, r: int, code: int, load: list[float], ref: dict[str, Any] | None) -> dict[str, Any]:
        """The per-round row of one run (one without a result holds ``error``)."""
        try:
            row = system_row(name, out / f"round{r}" / name, ref, code, system_args(name, plan.get("ks", {}))[2])
        except ValueError as exc:
            row = {"name": name, "completed": False, "exit_code": code, "error": str(exc)}
        row.update(round=r, load=load)
        if name in RESTARTS:
            row.update(checkpoint_every=plan["ks"][name], checkpoint_async=RESTARTS[name])
        return row

    for r, order in enumerate(round_orders(active, rounds)):
        for name in order:
            run_dir = out / f"round{r}" / name
            shutil.rmtree(run_dir, ignore_errors=True)
            load = machine_load()
            log(f"[{time.strftime('%H:%M:%S')}] round {r}: {name} running (load {load})")
            t0 = time.time()
            fails = [] if name == "reference" else plan["fails"]
            if name == "torchft":
                code = run_torchft(run_dir, config, replicas, steps, fails, run_overrides, tft_python, timeout_s)
            else:
                baseline, extra, _ = system_args(name, plan.get("ks", {}))
                code = launch_run(run_dir, config, replicas, steps, fails, baseline, [*run_overrides, *extra],
                                  timeout_s)
            log(f"[{time.strftime('%H:%M:%S')}] round {r}: {name} exit {code} after {time.time() - t0:.0f} s")
            runs[name].append((r, code, load))
            if not plan:  # round 0 runs the reference first: the schedule and K are fixed from it, once
                plan = fix_plan(measured("reference", r, code, load, None))

    refs = {r: measured("reference", r, code, load, None) for r, code, load in runs["reference"]}
    rows = []
    for name in active:
        per_round = [refs[r] if name == "reference" else
                     measured(name, r, code, load, refs[r] if refs[r].get("completed") else refs[0])
                     for r, code, load in runs[name]]
        try:
            rows.append(aggregate_rounds(per_round))
        except ValueError as exc:
            skipped[name] = f"no result: {exc}"
    ideal = assemble(rows, plan["schedule"], replicas, steps)
    res: dict[str, Any] = {
        "benchmark": "failures", "config": config, "replicas": replicas, "steps": steps, "rounds": rounds,
        "microbatches": cfg.training.global_microbatches, "overrides": list(overrides), "device": device,
        "schedule": {"kind": schedule_kind, "fails": plan["fails"], "mtbf_s": round(plan["mtbf_s"], 3), "seed": seed},
        "young_daly": plan["young_daly"],
        "ideal": ideal, "systems": rows, "skipped": skipped,
        "load": {"before": load_before, "after": machine_load()}, "bench_wall_s": round(time.time() - t_bench, 1),
        "out": str(out),
    }
    try:
        which = f"median round of {rounds}" if rounds > 1 else ""
        res["plots"] = [str(p) for p in plot_results(out, rows, which)]
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
                    "shrink-and-drop and torchft (if importable) on the same seed, model and failure schedule, "
                    "on emulated devices, for several rounds in alternating order; prints per system the medians "
                    "over rounds of wall time and effective throughput, its spread, its ratio to the ideal "
                    "(surviving replicas' share of failure-free throughput), to recover and to failure-free, "
                    "time lost per failure, min microbatches per step, loss deviation from the reference and "
                    "final validation loss. Config overrides: --section.field VALUE (applied to every system).")
    p.add_argument("--config", default="tiny", help="preset name or .toml path (default tiny)")
    p.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--steps", type=int, default=60, help="committed steps per system (default 60)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"runs of every system, in alternating order; the table shows medians (default {ROUNDS})")
    p.add_argument("--device-time-s", type=float, default=DEVICE_TIME_S,
                   help=f"emulated device time: every microbatch of every system takes at least this many seconds, "
                        f"so replicas behave like dedicated devices (default {DEVICE_TIME_S:g}, a fixed value "
                        f"chosen for the tiny preset on 2 CPU cores, ~2x its real compute per microbatch with 4 "
                        f"replicas; the run measures that compute and warns when the value is too small; 0: real "
                        f"compute only, replicas share the cores)")
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
                    torchft_python=args.torchft_python, timeout_s=args.timeout, device_time_s=args.device_time_s,
                    rounds=args.rounds)
    print_result(res)
    if args.json:
        write_json(args.json, res)
    return 0 if all(r["completed"] for r in res["systems"]) else 1
