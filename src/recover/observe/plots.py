"""Plots people look at instead of reading JSONL: loss curves and throughput with event markers.

Contract: every function reads the run directory's JSONL files and writes one PNG; it never
fails a run (callers treat an exception as a warning) and uses the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from recover.names import Event
from recover.observe.events import read_jsonl


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(path):
        if "step" in rec and "loss" in rec:
            by_step[int(rec["step"])] = rec  # a resumed run rewrites steps: keep the latest
    return [by_step[s] for s in sorted(by_step)]


def load_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / "events.jsonl"
    return list(read_jsonl(path)) if path.is_file() else []


def _marker_kind(e: dict[str, Any]) -> str | None:
    """Which marker an event gets: a kill (a hang or freeze: the replica is lost too), a rejoin, a
    fault injected (a corruption, a NaN, muted heartbeats, ...), a slow-down injected (not its end), or none."""
    kind = e.get("kind")
    if kind == Event.STARTED and e.get("joined"):
        return "rejoined"
    if kind == Event.SLOWED:
        return "slowed" if e.get("factor", 1.0) > 1.0 and not e.get("rank") else None
    return str(kind) if kind in (Event.KILL, Event.INJECTED) else None


def _markers(ax: Any, events: list[dict[str, Any]], by: str) -> None:
    """Dashed lines at replica kills (red), corruptions (purple), slow-downs (orange) and rejoins
    (green), placed by step or by elapsed seconds."""
    t0 = min((e["t"] for e in events if e.get("kind") == Event.LAUNCH), default=None)
    styles = {"kill": ("tab:red", "replica lost (crash, hang)"), "rejoined": ("tab:green", "replica rejoined"),
              "injected": ("tab:purple", "fault injected"), "slowed": ("tab:orange", "replica slowed")}
    for e in events:
        kind = _marker_kind(e)
        if kind is None:
            continue
        pos = (e.get("step") or 0) + 1 if by == "step" else (e["t"] - t0 if t0 is not None else None)
        if pos is not None:
            color, label = styles[kind]
            ax.axvline(pos, color=color, ls="--", lw=1, alpha=0.8, label=label)


def _legend(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8)


def plot_loss(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
              reference: str | os.PathLike[str] | None = None, title: str | None = None) -> Path:
    """``loss.png``: training loss per step (and validation points), optionally over a reference run,
    with failure and rejoin markers from ``events.jsonl`` when there are any."""
    plt = _pyplot()
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if reference is not None:
        ref = load_metrics(reference)
        ax.plot([r["step"] + 1 for r in ref], [r["loss"] for r in ref], color="0.6", lw=3,
                alpha=0.6, label="failure-free reference")
    rows = load_metrics(run_dir)
    ax.plot([r["step"] + 1 for r in rows], [r["loss"] for r in rows], color="C0", lw=1.2, label="train loss")
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] + 1 for r in val], [r["val_loss"] for r in val], "o-", color="C1", ms=4,
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or f"{run_dir.name}: loss")
    ax.grid(alpha=0.3)
    _markers(ax, load_events(run_dir), "step")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_throughput(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """``throughput.png``: tokens/s per step and live replicas over elapsed time, with event markers."""
    plt = _pyplot()
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "throughput.png"
    rows = load_metrics(run_dir)
    events = load_events(run_dir)
    elapsed = [r.get("elapsed_s", 0.0) for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, sharex=True)
    tps = [r["tokens_per_s"] for r in rows]
    ax1.plot(elapsed, tps, color="C0", lw=0.8, alpha=0.4, label="tokens/s (per step)")
    window = max(1, len(rows) // 20)
    smooth = [sum(tps[max(0, i - window + 1):i + 1]) / len(tps[max(0, i - window + 1):i + 1]) for i in range(len(tps))]
    ax1.plot(elapsed, smooth, color="C0", lw=1.8, label=f"tokens/s ({window}-step mean)")
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"{run_dir.name}: throughput and live replicas")
    ax1.grid(alpha=0.3)
    _markers(ax1, events, "time")
    _legend(ax1)
    ax2.step(elapsed, [r["live_replicas"] for r in rows], where="post", color="C2")
    ax2.set_ylabel("live replicas")
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("elapsed time (s)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


CAUSE_COLORS = {"useful": "tab:green", "startup": "0.65", "restart": "tab:brown", "recovery": "tab:red",
                "rejoin": "tab:purple", "checkpoint": "tab:blue", "evaluation": "tab:cyan",
                "stragglers": "tab:orange", "degraded": "tab:pink", "other": "0.85"}


def plot_goodput(run_dir: str | os.PathLike[str], g: Any, out: str | os.PathLike[str] | None = None) -> Path:
    """``goodput.png``: useful time against wall time over the run (the lost part of every step
    interval shaded by its cause), and the whole wall time split into useful time and lost time by
    cause. ``g`` is the run's :class:`~recover.observe.goodput.Goodput`."""
    plt = _pyplot()
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "goodput.png"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, gridspec_kw={"height_ratios": [3, 1]})
    xs, ys, used = [0.0], [0.0], 0.0
    for s in g.steps:
        xs.append(s.end)
        used += s.useful
        ys.append(used)
        at = s.start + s.useful
        for cause, secs in s.lost.items():
            ax1.axvspan(at, at + secs, color=CAUSE_COLORS[cause], alpha=0.5, lw=0, label=cause)
            at += secs
    ax1.plot(xs, ys, color=CAUSE_COLORS["useful"], lw=1.8, label="useful (committed) time")
    ax1.plot([0, g.wall_s], [0, g.wall_s], color="0.5", ls=":", lw=1, label="wall time")
    ax1.set_xlabel("job time (s)")
    ax1.set_ylabel("useful time (s)")
    ax1.set_title(f"{run_dir.name}: goodput {100 * g.ratio:.1f}% (planned step {g.planned_step_s * 1000:.0f} ms)")
    ax1.grid(alpha=0.3)
    _legend(ax1)
    left = 0.0
    for cause, secs in [("useful", g.useful_s), *g.lost_s.items()]:
        if secs <= 0:
            continue
        ax2.barh(0, secs, left=left, color=CAUSE_COLORS[cause], edgecolor="white")
        if secs / max(g.wall_s, 1e-9) > 0.06:
            ax2.text(left + secs / 2, 0, f"{cause}\n{100 * secs / g.wall_s:.0f}%", ha="center", va="center", fontsize=7)
        left += secs
    ax2.set_yticks([])
    ax2.set_xlabel("wall time (s)")
    ax2.set_xlim(0, max(g.wall_s, 1e-9))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
