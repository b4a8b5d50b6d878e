"""What a run directory says: summary, recovery latencies, plots, and comparison with a reference.

Contract: pure readers of ``metrics.jsonl`` and ``events.jsonl`` (DESIGN section 5); they never
change a run directory except to write ``summary.json`` and PNGs.

Recovery latency of a kill = time from the kill (``kind: kill``) to the moment the LAST survivor
has re-formed its group and re-planned the orphans (``kind: recovered`` naming the dead replica),
i.e. kill -> all survivors computing again; in a replica of several ranks, every rank counts.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from recover.errors import RecoverError
from recover.observe.plots import load_events, load_metrics, plot_loss, plot_throughput


def recovery_latencies(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per kill that survivors recovered from: step, replica, latency_ms, survivors.

    A kill's recoveries are those naming its replica dead before the same replica's next kill (a
    replica killed, rejoined and killed again is two kills, each with its own latency). A kill from
    outside (``source: external``) is timed from ``at``, when the coordinator saw the replica go."""
    out = []
    kills = sorted((e for e in events if e.get("kind") == "kill"), key=lambda k: k.get("at", k["t"]))
    recovered = [e for e in events if e.get("kind") == "recovered"]
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


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _stopped(events: list[dict[str, Any]]) -> bool:
    """Whether the last launch in ``events`` (a resumed run appends to them) ended in a graceful stop
    (a job without a launcher: whether its replicas' last word was ``stopped`` or ``finished``)."""
    stopped = False
    for e in events:
        if e.get("kind") in ("launch", "stopped", "finished"):
            stopped = e["kind"] == "stopped"
    return stopped


def summarize(run_dir: Path, name: str, wall_s: float) -> dict[str, Any]:
    rows = load_metrics(run_dir)
    events = load_events(run_dir)
    lat = recovery_latencies(events)
    normal = [r["time_s"] for r in rows if not r.get("failures")]
    failed = [r["time_s"] for r in rows if r.get("failures")]
    base = statistics.median(normal) if normal else 0.0
    tokens = sum(r["tokens"] for r in rows)
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    summary = {
        "name": name, "committed_steps": len(rows), "wall_s": round(wall_s, 3),
        "min_microbatches": min((r["microbatches"] for r in rows), default=0),
        "max_microbatches": max((r["microbatches"] for r in rows), default=0),
        "kills": sum(1 for e in events if e.get("kind") == "kill"),
        "rejoins": sum(1 for e in events if e.get("kind") == "started" and e.get("joined") and not e.get("rank")),
        "recoveries": lat,
        "recovery_latency_ms_median": _median([x["latency_ms"] for x in lat]),
        "recovery_latency_ms_max": max((x["latency_ms"] for x in lat), default=None),
        "step_time_s_median": round(base, 4),
        "failed_step_extra_s_median": _median([f - base for f in failed]),
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": val[-1] if val else None,
        "final_live_replicas": rows[-1]["live_replicas"] if rows else 0,
        "final_generation": rows[-1]["generation"] if rows else 0,
        "committed_tokens": tokens,
        "effective_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "coordinator_restarts": sum(1 for e in events if e.get("kind") == "coordinator_exit"),
        "coordinator_outage_ms_max": max((e["outage_ms"] for e in events if e.get("kind") == "coordinator_reconnected"),
                                         default=None),
        "stopped": _stopped(events),
    }
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot_run(run_dir: Path, reference: Path | None = None) -> list[Path]:
    """``loss.png`` (over the reference when given) and ``throughput.png``, both with event markers."""
    return [plot_loss(run_dir, reference=reference), plot_throughput(run_dir)]


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
