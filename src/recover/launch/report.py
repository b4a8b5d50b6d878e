"""What a run directory says: summary, goodput, faults, recovery latencies, plots, comparison with a
reference, and ``recover report RUN_DIR``.

Contract: pure readers of ``metrics.jsonl`` and ``events.jsonl`` (docs/DESIGN.md §9); they never
change a run directory except to write ``summary.json`` (the launcher, at the end of a run) and PNGs
(``recover report`` writes only PNGs).

Recovery latency of a kill = time from the kill (``kind: kill``) to the moment the LAST survivor
has re-formed its group and re-planned the orphans (``kind: recovered`` naming the dead replica),
i.e. kill -> all survivors computing again; in a replica of several ranks, every rank counts.

A fault's detection time (:func:`incidents`) = from its injection (the event its kind writes when it
strikes: ``kill`` for a crash, hang or freeze; ``injected`` for a corruption, NaN or miscomputation;
``slowed`` for a straggler; ``link_cut``) to the coordinator naming the replica (the kind's ``detection``:
``failure_detected``; ``straggler`` for a slow one); its recovery time = from then to the last survivor
computing again (``recovered``; ``rebalanced`` for a straggler); its rejoin = from the injection to the
replica training again with the others' state (``state_received``). Each kind's row is named by the kind
(:mod:`recover.faults.kinds`); events are matched as :class:`~recover.names.Event` members.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from recover.errors import RecoverError
from recover.faults import struck_by
from recover.names import Event
from recover.observe.goodput import CAUSES, Goodput, goodput
from recover.observe.plots import load_events, load_metrics, plot_goodput, plot_loss, plot_throughput


def _unseen_losses(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The coordinator's detections of a replica's loss that no ``kill`` event accounts for, as kills from
    outside timed from the detection: a job without a launcher (a cluster recipe: a node's death, a step
    cancelled by the scheduler) has nobody to write ``kill``."""
    kills = [e for e in events if e.get("kind") == Event.KILL]
    out = []
    for det in (e for e in events if e.get("kind") == Event.FAILURE_DETECTED):
        r, t = det["replica"], det["t"]
        if any(k["replica"] == r and t - 120 <= k.get("at", k["t"]) <= t + 1 for k in kills):
            continue  # the launcher saw (or made) this one
        step = next((g.get("step") for g in events if g.get("kind") == Event.GENERATION and g["t"] >= t
                     and r in g.get("dead", [])), None)
        out.append({"kind": Event.KILL, "t": t, "replica": r, "step": step, "source": "detected",
                    "cause": det.get("cause")})
    return out


def failures_detected(events: list[dict[str, Any]]) -> dict[str, int]:
    """How many replica losses the coordinator detected, by cause (``connection_closed``, ``hung``, ...)."""
    out: dict[str, int] = {}
    for e in events:
        if e.get("kind") == Event.FAILURE_DETECTED:
            out[e.get("cause") or "unknown"] = out.get(e.get("cause") or "unknown", 0) + 1
    return out


def coordinator_restarts(events: list[dict[str, Any]]) -> int:
    """Starts of a coordinator while its job still ran: after an earlier start and before that run ended
    (a replica's ``finished`` or ``stopped``, or a new ``launch``). A requeued or resumed job's first start
    is none; a start by the launcher or a cluster recipe's script after the coordinator died is one."""
    restarts, running = 0, False
    for e in events:
        kind = e.get("kind")
        if kind == Event.COORDINATOR_START:
            restarts += running
            running = True
        elif kind in (Event.LAUNCH, Event.FINISHED, Event.STOPPED):
            running = False
    return restarts


def recovery_latencies(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per kill that survivors recovered from: step, replica, latency_ms, survivors.

    A kill's recoveries are those naming its replica dead before the same replica's next kill (a
    replica killed, rejoined and killed again is two kills, each with its own latency). A kill from
    outside (``source: external``) is timed from ``at``, when the coordinator saw the replica go; a loss
    that only the coordinator saw (``source: detected``), from its detection."""
    out = []
    kills = sorted((e for e in [*events, *_unseen_losses(events)] if e.get("kind") == Event.KILL),
                   key=lambda k: k.get("at", k["t"]))
    recovered = [e for e in events if e.get("kind") == Event.RECOVERED]
    for i, kill in enumerate(kills):
        start = kill.get("at", kill["t"])
        until = next((k.get("at", k["t"]) for k in kills[i + 1:] if k["replica"] == kill["replica"]), math.inf)
        after = [e for e in recovered if start <= e["t"] < until and kill["replica"] in e.get("dead", [])]
        firsts: dict[tuple[int, int], float] = {}  # (replica, rank) -> first recovery after the kill
        for e in after:
            firsts.setdefault((e["replica"], e.get("rank", 0)), e["t"])
        if firsts:
            out.append({"replica": kill["replica"], "step": kill.get("step"), "phase": kill.get("phase"),
                        "latency_ms": round((max(firsts.values()) - start) * 1000, 2),
                        "survivors": sorted({r for r, _ in firsts})})
    return out


def _injections(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every injected fault, in time order: kind (:class:`~recover.faults.FaultKind`), replica, step, t (when
    it struck)."""
    out, seen = [], set()
    for e in events:
        how = struck_by(e)
        key = (how, e.get("replica"), e.get("step"))
        if how is not None and key not in seen:  # every rank of a replica logs its slow-down: one fault
            seen.add(key)
            out.append({"kind": how, "replica": e["replica"], "step": e.get("step"), "t": e.get("at", e["t"])})
    return sorted(out, key=lambda x: x["t"])


def _detected_by(det: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """How the coordinator found a replica: the cause of its ``failure_detected`` (``connection_closed``,
    ``hung``, ...); for a fence, the check that named it (``divergent``, ``audit``, ``nonfinite``)."""
    if det.get("cause") != "fenced":
        return det.get("cause") or det["kind"]
    checks = [e["kind"] for e in events if e.get("kind") in (Event.DIVERGENT, Event.AUDIT, Event.NONFINITE)
              and det["t"] - 5 <= e["t"] <= det["t"] and det["replica"] in e.get("replicas", [e.get("replica")])]
    return checks[-1] if checks else "fenced"


def incidents(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per injected fault (see the module docstring): ``fault`` (its kind's ``report`` name),
    ``replica``, ``step``, ``detected_by``, ``detection_ms``, ``recovery_ms``, ``rejoin_s`` (None where it did
    not happen)."""
    out = []
    for inj in _injections(events):
        r, t, how = inj["replica"], inj["t"], inj["kind"]
        slow = how.detection == Event.STRAGGLER
        det = next((e for e in events if e["t"] >= t and e.get("replica") == r and e.get("kind") == how.detection),
                   None)
        rec, back = None, None
        if det is not None and slow:  # the rebalance is logged with the naming, in the same commit
            rec = next((e["t"] for e in events if e.get("kind") == Event.REBALANCED
                        and (e.get("step") == det.get("step") or e["t"] >= det["t"])), None)
            rec = max(rec, det["t"]) if rec is not None else None
        elif det is not None:
            survivors = {(e["replica"], e.get("rank", 0)): e["t"] for e in events
                         if e.get("kind") == Event.RECOVERED and e["t"] >= det["t"] and r in e.get("dead", [])
                         and e["t"] - det["t"] < 60}
            rec = max(survivors.values(), default=None)
            back = next((e["t"] for e in events if e["t"] > det["t"] and e.get("kind") == Event.STATE_RECEIVED
                         and e.get("replica") == r and not e.get("rank")), None)
        out.append({"fault": how.report, "replica": r, "step": inj["step"],
                    "detected_by": _detected_by(det, events) if det else None,
                    "detection_ms": round((det["t"] - t) * 1000, 1) if det else None,
                    "recovery_ms": round((rec - det["t"]) * 1000, 1) if det and rec is not None else None,
                    "rejoin_s": round(back - t, 2) if back is not None else None})
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _stopped(events: list[dict[str, Any]]) -> bool:
    """Whether the last launch in ``events`` (a resumed run appends to them) ended in a graceful stop
    (a job without a launcher: whether its replicas' last word was ``stopped`` or ``finished``)."""
    stopped = False
    for e in events:
        if e.get("kind") in (Event.LAUNCH, Event.STOPPED, Event.FINISHED):
            stopped = e["kind"] == Event.STOPPED
    return stopped


def summarize(run_dir: Path, name: str, wall_s: float, write: bool = True) -> dict[str, Any]:
    """The run's summary (committed steps, faults, recoveries, goodput), written to ``summary.json`` unless
    ``write`` is false (the launcher writes it itself, to end in one line when the storage refuses it)."""
    rows = load_metrics(run_dir)
    events = load_events(run_dir)
    lat = recovery_latencies(events)
    normal = [r["time_s"] for r in rows if not r.get("failures")]
    failed = [r["time_s"] for r in rows if r.get("failures")]
    base = statistics.median(normal) if normal else 0.0
    tokens = sum(r["tokens"] for r in rows)
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    joins = [e for e in events if e.get("kind") == Event.STARTED and e.get("joined") and not e.get("rank")]
    launched = next((e["replicas"] for e in events if e.get("kind") == Event.LAUNCH), math.inf)
    summary = {
        "name": name, "committed_steps": len(rows), "wall_s": round(wall_s, 3),
        "min_microbatches": min((r["microbatches"] for r in rows), default=0),
        "max_microbatches": max((r["microbatches"] for r in rows), default=0),
        "kills": sum(1 for e in events if e.get("kind") == Event.KILL),
        "failures_detected": failures_detected(events),
        "out_of_memory": [{k: e.get(k) for k in ("replica", "step", "pid", "cgroup", "peak_bytes")} for e in events
                          if e.get("kind") == Event.KILL and e.get("cause") == "out of memory"],
        "rejoins": sum(1 for e in joins if e["replica"] < launched),
        "grown": sorted({e["replica"] for e in joins if e["replica"] >= launched}),  # beyond the launch's count
        "recoveries": lat,
        "recovery_latency_ms_median": _median([x["latency_ms"] for x in lat]),
        "recovery_latency_ms_max": max((x["latency_ms"] for x in lat), default=None),
        "step_time_s_median": round(base, 4),
        "failed_step_extra_s_median": _median([f - base for f in failed]),
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": val[-1] if val else None,
        "final_live_replicas": rows[-1]["live_replicas"] if rows else 0,
        "max_live_replicas": max((r["live_replicas"] for r in rows), default=0),
        "drained": sorted({r for e in events if e.get("kind") == Event.DRAINED for r in e["replicas"]}),
        "final_generation": rows[-1]["generation"] if rows else 0,
        "committed_tokens": tokens,
        "effective_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "coordinator_restarts": coordinator_restarts(events),
        "restores": list({e["generation"]: {"step": e["step"], "redo": e["redo"]} for e in events
                          if e.get("kind") == Event.RESTORED}.values()),  # one per generation (every member logs it)
        "coordinator_outage_ms_max": max((e["outage_ms"] for e in events
                                          if e.get("kind") == Event.COORDINATOR_RECONNECTED), default=None),
        "stopped": _stopped(events),
        "goodput": goodput(rows, events).to_dict(),
        "faults": incidents(events),
    }
    if write:
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot_run(run_dir: Path, reference: Path | None = None) -> list[Path]:
    """``loss.png`` (over the reference when given) and ``throughput.png``, both with event markers, and
    ``goodput.png`` (where the wall time went)."""
    return [plot_loss(run_dir, reference=reference), plot_throughput(run_dir),
            plot_goodput(run_dir, goodput(load_metrics(run_dir), load_events(run_dir)))]


def compare(ref_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Per-step relative loss difference of ``run_dir`` against ``ref_dir`` and both final val losses."""
    ref, run = load_metrics(ref_dir), load_metrics(run_dir)
    if not ref:
        raise RecoverError(f"{ref_dir}/metrics.jsonl has no steps: is it a run directory?")
    if not run:
        raise RecoverError(f"{run_dir}/metrics.jsonl has no steps: is it a run directory?")
    ref_by = {r["step"]: r for r in ref}
    common = [r for r in run if r["step"] in ref_by]
    diffs = [(r["step"], abs(r["loss"] - ref_by[r["step"]]["loss"]) / max(abs(ref_by[r["step"]]["loss"]), 1e-30))
             for r in common]
    worst_step, worst = max(diffs, key=lambda d: d[1]) if diffs else (None, math.inf)
    bitwise = all(r["loss"] == ref_by[r["step"]]["loss"] for r in common)
    val = lambda rows: next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None)  # noqa: E731
    return {"steps_compared": len(common), "steps_ref": len(ref), "steps_run": len(run),
            "max_rel_loss_diff": worst, "worst_step": worst_step, "bitwise_equal": bitwise and len(common) == len(ref),
            "final_val_loss_ref": val(ref), "final_val_loss_run": val(run),
            "min_microbatches_run": min(r["microbatches"] for r in run)}


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x / 1000:.2f} s" if x >= 1000 else f"{x:.0f} ms")


def goodput_rows(g: Goodput) -> list[tuple[str, str]]:
    """(label, value) rows: the ratio, useful and wall time, tokens, then the lost time by cause."""
    d = g.to_dict()
    rows = [("goodput (effective training time ratio)", f"{100 * g.ratio:.1f}%"),
            ("goodput after start-up", f"{100 * g.ratio_after_startup:.1f}%"),
            ("useful time / wall time", f"{g.useful_s:.1f} s / {g.wall_s:.1f} s"),
            ("planned (failure-free) step time", f"{1000 * g.planned_step_s:.0f} ms"),
            ("tokens committed", f"{g.tokens:,} ({d['tokens_per_s']:,.0f}/s)")]
    for cause in CAUSES:
        secs = g.lost_s.get(cause, 0.0)
        if secs > 0:
            rows.append((f"  lost: {cause}", f"{secs:.2f} s ({100 * secs / g.wall_s:.1f}%)"))
    return rows


def goodput_table(g: Goodput, title: str) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    for label, value in goodput_rows(g):
        table.add_row(label, value)
    return table


SHORT_CAUSES = {"connection_closed": "connection lost", "process_died": "process died",
                "heartbeat_timeout": "no heartbeat"}


def faults_table(faults: list[dict[str, Any]], title: str = "faults") -> Table:
    """Per injected fault: replica, step, what detected it, detection, recovery and rejoin times."""
    table = Table(title=title)
    for name in ("fault", "at", "found as", "detection", "recovery", "rejoin"):
        table.add_column(name, justify="left" if name in ("fault", "found as") else "right", no_wrap=True)
    for f in faults:
        found = SHORT_CAUSES.get(f["detected_by"], f["detected_by"] or "-")
        table.add_row(f["fault"], f"{f['replica']}@{f['step']}", found, _ms(f["detection_ms"]),
                      _ms(f["recovery_ms"]), "-" if f["rejoin_s"] is None else f"{f['rejoin_s']:.1f} s")
    return table


def register(sub: Any) -> None:
    r = sub.add_parser("report", help="goodput, faults and plots of a run directory",
                       description="Print a run's goodput (effective training time ratio, tokens committed, time "
                                   "lost by cause) and its faults (detection and recovery times) as tables, and "
                                   "write loss.png, throughput.png and goodput.png into the run directory.")
    r.add_argument("run", help="a run directory (recover launch/train --out)")
    r.add_argument("--reference", default=None, help="a failure-free run: drawn under loss.png and compared")
    r.add_argument("--json", action="store_true", help="print the goodput and faults as JSON instead of tables")
    r.set_defaults(func=run_report)


def run_report(args: Any) -> int:
    """``recover report RUN_DIR``: tables on stdout, plots into RUN_DIR; 2 when it holds no steps."""
    from rich.console import Console

    run = Path(args.run)
    rows, events = load_metrics(run), load_events(run)
    if not rows:
        raise RecoverError(f"{run}/metrics.jsonl has no steps: is {run} a run directory?")
    g, faults = goodput(rows, events), incidents(events)
    reference = Path(args.reference) if args.reference else None
    cmp = compare(reference, run) if reference is not None else None
    if args.json:
        print(json.dumps({"goodput": g.to_dict(), "faults": faults, "compare": cmp}, indent=1))
    else:
        console = Console()
        console.print(goodput_table(g, f"{run}: {len(rows)} steps, {min(r['microbatches'] for r in rows)}.."
                                       f"{max(r['microbatches'] for r in rows)} microbatches per step"))
        if faults:
            console.print(faults_table(faults))
        if cmp is not None:
            console.print(f"max relative loss deviation from {reference}: {cmp['max_rel_loss_diff']:.2e}"
                          + (" (bitwise equal)" if cmp["bitwise_equal"] else ""))
    try:
        paths = plot_run(run, reference)
    except Exception as exc:  # noqa: BLE001 - the tables stand without the plots
        print(f"warning: plots not written: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0
