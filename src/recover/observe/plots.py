"""Plots people look at instead of reading JSONL: loss curves and throughput with event markers.

Contract: every function reads the run directory's JSONL files and writes one PNG; it never
fails a run (callers treat an exception as a warning) and uses the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def plot_loss(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
              reference: str | os.PathLike[str] | None = None, title: str | None = None) -> Path:
    """``loss.png``: training loss per step (and validation points), optionally over a reference run."""
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
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
