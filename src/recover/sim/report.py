"""How a :class:`~recover.sim.engine.SimResult` is shown: rich tables, PNG plots, JSON.

Contract: :func:`print_report` writes tables to a rich console (nothing else), :func:`write_plots`
writes ``throughput.png``, ``tokens.png`` and ``time_lost.png`` into a directory with the Agg
backend and returns their paths, :func:`write_json` writes :meth:`SimResult.to_json` plus the
paper comparison. None of them changes the result.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from recover.sim.engine import BASELINE, SimResult
from recover.sim.model import DAY, HOUR
from recover.sim.presets import PAPER
from recover.sim.track import CAUSES

_COLORS = {"recover": "C0", "checkpoint-restart": "C3", "shrink-drop": "C2"}


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 2 * DAY:
        return f"{s / DAY:.1f} d"
    if s >= 2 * HOUR:
        return f"{s / HOUR:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def fmt_tokens(x: float) -> str:
    """``12.6T``, ``2.70M``, ``234``: three significant digits and a unit."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def paper_comparison(result: SimResult) -> dict[str, Any] | None:
    """The simulated figures next to the paper's (only when ``recover`` and the baseline ran)."""
    after = result.ratio("recover", BASELINE, "throughput_after_failures")
    tokens = result.ratio("recover", BASELINE, "tokens_at_budget")
    if after is None and tokens is None:
        return None
    return {
        "throughput_ratio_after_failures": after,
        "paper_throughput_ratio": PAPER["throughput_ratio"],
        "extra_tokens_at_budget": None if tokens is None else tokens - 1.0,
        "paper_extra_tokens": PAPER["extra_tokens"],
        "budget_gpu_h": result.spec.budget_gpu_s / HOUR,
    }


def print_report(result: SimResult, console: Any, preset: str | None = None, verbose: bool = False) -> None:
    """The results table, time lost by cause, the recover ratios, the assumptions and the wall time."""
    from rich import box
    from rich.table import Table

    spec = result.spec
    ff = result.failure_free_throughput
    end = max(r.elapsed_s for r in result.strategies.values())
    title = (f"{preset or 'custom job'}: {spec.gpus:,} GPUs = {spec.replicas:,} replicas x {spec.replica_gpus}, "
             f"{len(result.failure_times):,} GPU failures, run {fmt_duration(end)}, budget "
             f"{fmt_tokens(spec.budget_gpu_s / HOUR)} GPU-h; failure-free {fmt_tokens(ff)} tokens/s")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("strategy", "tokens/s", "vs ff", "after fail", "tokens", "GPU-h",
                f"to {fmt_tokens(result.target_tokens)}"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for name, r in result.strategies.items():
        after = r.throughput_after_failures
        table.add_row(name, fmt_tokens(r.effective_throughput), f"{r.effective_throughput / ff:.1%}",
                      "-" if after is None else f"{after / ff:.1%}", fmt_tokens(r.tokens_at_budget),
                      fmt_tokens(r.gpu_hours), fmt_duration(r.time_to_target_s))
    console.print(table)
    console.print("tokens/s: effective throughput (committed tokens / elapsed); vs ff: of the failure-free "
                  "rate; after fail: from the first failure on; tokens: in the model at the end of the "
                  "budget; to N: time to reach N tokens.", style="dim", highlight=False)
    console.print(_lost_table(result))
    _print_ratios(result, console, preset)
    if spec.notes:
        console.print("[bold]Assumptions[/bold]")
        for note in spec.notes if verbose else spec.notes[:3]:
            console.print(f"  - {note}", highlight=False)
        if not verbose and len(spec.notes) > 3:
            console.print(f"  ... {len(spec.notes) - 3} more (--assumptions, or 'assumptions' in --json)")
    end = max(r.elapsed_s for r in result.strategies.values())
    console.print(f"Simulated {fmt_duration(end)} of {spec.gpus:,} GPUs, "
                  f"{len(result.strategies)} strategies, in {result.wall_s:.2f} s.", highlight=False)


def _lost_table(result: SimResult) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title="Time lost by cause (fraction of elapsed time)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    table.add_column("cause")
    for name in result.strategies:
        table.add_column(name, justify="right")
    for cause in CAUSES:
        values = [r.time_lost_by_cause[cause] for r in result.strategies.values()]
        if any(v > 5e-5 for v in values):
            table.add_row(cause, *(f"{v:.2%}" if v else "-" for v in values))
    table.add_row("total", *(f"{sum(r.time_lost_by_cause.values()):.2%}" for r in result.strategies.values()))
    return table


def _print_ratios(result: SimResult, console: Any, preset: str | None) -> None:
    for key, ratios in result.ratios().items():
        parts = []
        for measure, label in (("effective_throughput", "effective throughput"),
                               ("throughput_after_failures", "after successive failures"),
                               ("tokens_at_budget", "tokens at budget")):
            v = ratios.get(measure)
            parts.append(f"{label} {v:.2f}x" if v is not None else f"{label} -")
        console.print(f"[bold]{key}[/bold]: " + ", ".join(parts), highlight=False)
    cmp = paper_comparison(result)
    if preset == "paper-512" and cmp is not None:
        after, extra = cmp["throughput_ratio_after_failures"], cmp["extra_tokens_at_budget"]
        console.print(
            f"[bold]vs the paper[/bold] (ReCoVer, arXiv 2605.11215): recover / checkpoint-restart effective "
            f"throughput after successive failures {after:.2f}x (paper {PAPER['throughput_ratio']:.2f}x); "
            f"extra tokens at {cmp['budget_gpu_h']:.0f} GPU-hours {extra:+.1%} (paper +{PAPER['extra_tokens']:.1%}). "
            "docs/BENCHMARKS.md explains the assumptions that move these.", highlight=False)


def write_json(result: SimResult, path: str | os.PathLike[str], preset: str | None = None) -> Path:
    """Writes the results (and, for ``paper-512``, the paper comparison) as JSON."""
    data = result.to_json()
    data["preset"] = preset
    if preset == "paper-512":
        data["paper"] = paper_comparison(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2) + "\n", encoding="utf-8")
    return path


def _finite(x: Any) -> Any:
    """JSON has no inf/nan: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_plots(result: SimResult, out_dir: str | os.PathLike[str], bins: int = 60) -> list[Path]:
    """``throughput.png``, ``tokens.png`` and ``time_lost.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    end = max(r.elapsed_s for r in result.strategies.values())
    unit, scale = ("days", DAY) if end > 4 * DAY else ("hours", HOUR) if end > 4 * HOUR else ("minutes", 60.0)
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    centres, series = result.throughput_series(bins)
    for name, rate in series.items():
        ax.plot(centres / scale, rate, lw=1.2, color=_COLORS.get(name), label=name)
    ax.axhline(result.failure_free_throughput, color="0.5", ls="--", lw=1, label="failure-free")
    ft = result.failure_times[result.failure_times <= end]
    if 0 < len(ft) <= 400:
        ax.plot(ft / scale, np.zeros_like(ft), "|", color="k", ms=8, label="GPU failure")
    ax.set_xlabel(f"time ({unit})")
    width = centres[1] - centres[0] if len(centres) > 1 else end
    ax.set_ylabel(f"tokens/s, net of rollbacks (per {fmt_duration(width)})")
    ax.set_title("Effective throughput over time")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, plt, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for name, r in result.strategies.items():
        t = np.linspace(0.0, r.elapsed_s, 2000)
        ax.plot(r.track.gpu_s_at(t) / HOUR, r.track.progress_at(t), lw=1.2, color=_COLORS.get(name), label=name)
    ax.axvline(result.spec.budget_gpu_s / HOUR, color="0.5", ls="--", lw=1, label="GPU-hour budget")
    ax.set_xlabel("GPU-hours held")
    ax.set_ylabel("tokens in the model state")
    ax.set_title("Training progress within the GPU-hour budget")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, plt, out / "tokens.png"))

    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    names = list(result.strategies)
    left = np.zeros(len(names))
    for i, cause in enumerate(CAUSES):
        vals = np.array([result.strategies[n].time_lost_by_cause[cause] for n in names])
        if vals.any():
            ax.barh(names, vals * 100, left=left * 100, color=plt.cm.tab20(i), label=cause)
            left += vals
    ax.set_xlabel("% of elapsed time lost")
    ax.set_title("Time lost by cause")
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.invert_yaxis()
    paths.append(_save(fig, plt, out / "time_lost.png"))
    return paths


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
