"""The report of ``recover bench paper``: ``PAPER.md`` with its PNG plots, and the console summary.

Contract: reads only the result object of :func:`recover.bench.paper.assemble` (plus ``wall_s``,
``load``, ``out``); writes ``trajectory.png`` (loss per step, seed mean and min-max band per
system), ``budget.png`` (tokens at a fraction of the GPU-time budget and recover's gain over
checkpoint-and-restart, the widening gap), ``simulator.png`` (simulated over measured per run) and
``PAPER.md`` into the output directory. A plot that cannot be drawn is left out with a line in
the markdown; it never fails the benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recover.bench.common import fmt, print_rich_table

COLORS = {"failure-free": "0.45", "recover": "C0", "checkpoint-and-restart": "C3", "shrink-and-drop": "C1"}
STYLES = {"failure-free": {"lw": 4.0, "alpha": 0.45}, "checkpoint-and-restart": {"ls": "--"}}
"""Line styles of the loss curves: recover and checkpoint-and-restart keep the failure-free trajectory, so
their curves lie on it; the reference is drawn wide and faint, checkpoint-and-restart dashed."""
PAPER_CLAIMS = ("trajectory preserved with 256 of 512 GPUs lost", "2.23x the effective throughput of "
                "checkpoint-and-restart after successive failures", "+74.9% tokens at 234 GPU-hours")


def write_report(res: dict[str, Any], out: Path) -> list[Path]:
    """Writes the plots and ``PAPER.md``; returns the paths written."""
    paths, missing = [], []
    for name, draw in (("trajectory.png", _plot_trajectory), ("budget.png", _plot_budget),
                       ("simulator.png", _plot_simulator)):
        try:
            draw(res, out / name)
            paths.append(out / name)
        except Exception as exc:  # a plot never fails a benchmark
            missing.append(f"{name} not drawn: {type(exc).__name__}: {exc}")
    md = out / "PAPER.md"
    md.write_text(markdown(res, [p.name for p in paths], missing), encoding="utf-8")
    return [*paths, md]


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _small(x: float) -> str:
    """A signed loss difference: 4 decimals, or 2 significant digits when smaller than that."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 1e-4 else f"{x:+.1e}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def markdown(res: dict[str, Any], plots: Sequence[str], missing: Sequence[str] = ()) -> str:
    """The text of ``PAPER.md``."""
    plan, inputs = res["plan"], res.get("inputs") or {}
    lines = [f"# recover bench paper ({plan['label']})", "",
             f"`recover bench paper{' --quick' if plan['label'] == 'quick' else ''}`: preset `{plan['config']}`, "
             f"{plan['replicas']} replicas on emulated devices ({plan['device_time_s']:g} s per microbatch), "
             f"{plan['steps']} steps, seeds {list(plan['seeds'])}; half the replicas lost at evenly spaced steps "
             f"(the paper's 256 of 512 GPUs, scaled). Wall time of its runs {fmt(res.get('stages_s'), '.0f')} s "
             f"(every stage's own, whether run now or read back with --resume; this invocation "
             f"{fmt(res.get('wall_s'), '.0f')} s); load average before/after {res.get('load', {}).get('before')} / "
             f"{res.get('load', {}).get('after')}.", ""]
    if plan["label"] == "quick":
        lines += ["**A quick run** (fewer seeds, steps and a smaller model): it proves the pipeline; its numbers "
                  "are not the paper's results.", ""]
    lines += ["The paper's claims: " + "; ".join(PAPER_CLAIMS) + ".", "", "## Trajectory under failures", "",
              "Final validation loss per seed against the failure-free seeds: the two-sided 95% prediction "
              "interval of one more failure-free seed (mean +- t(0.975, n-1) x sd x sqrt(1 + 1/n)), each seed's "
              "z-score, and an exact permutation test of the difference of the means; then seed by seed against "
              "the failure-free run of the same seed (same initialisation, data order and trace): the mean "
              "difference, how many seeds ended worse, and the exact sign-flip test of the mean difference.", ""]
    rows = []
    for r in res["trajectory"]:
        if r.get("deterministic"):
            continue
        t = r.get("test") or {}
        rows.append([r["system"], ", ".join(f"{v:.4f}" for v in r["final_val_loss"]),
                     f"[{fmt(t.get('low'), '.4f')}, {fmt(t.get('high'), '.4f')}]" if t else "(the reference)",
                     ", ".join(f"{z:+.2f}" for z in t.get("z", [])) or "-",
                     ("yes" if t.get("all_inside") else "no") if t else "-", fmt(t.get("p_permutation"), ".3f"),
                     str(r["min_microbatches"]), fmt(r.get("max_rel_loss_dev"), ".1e"),
                     fmt(r.get("first_loss"), ".3f") + " -> " + fmt(r.get("last_loss"), ".3f")])
    lines += _table(("system", "final val loss per seed", "failure-free 95% PI", "z", "all inside",
                     "p (permutation)", "min mb/step", "max rel. loss dev. per step", "train loss first -> last"), rows)
    paired = [r for r in res["trajectory"] if r.get("paired")]
    if paired:
        lines += _table(("system", "minus failure-free, per seed", "mean difference", "seeds worse",
                         "p (paired sign-flip)"),
                        [[r["system"], ", ".join(_small(d) for d in r["paired"]["diffs"]),
                          _small(r["paired"]["mean_diff"]), f"{r['paired']['worse']} of {len(r['paired']['diffs'])}",
                          fmt(r["paired"]["p_paired"], ".3f")] for r in paired])
    bw = res.get("bitwise")
    if bw:
        lines += [f"Deterministic mode (seed {bw['seed']}, same trace): recover's loss is "
                  f"{'bitwise equal' if bw['bitwise_equal'] else 'NOT bitwise equal'} to the failure-free run's at "
                  f"every one of {bw['steps']} steps.", ""]
    if "trajectory.png" in plots:
        lines += ["![loss per step, seed mean and min-max band](trajectory.png)", ""]
    lines += ["## Effective throughput after successive failures", "",
              "Medians over seeds (each seed a round). After failures: model tokens gained from the first kill to "
              "the end / that time.", ""]
    lines += _table(("system", "eff. tok/s", "after failures tok/s", "x failure-free", "x ckpt-restart (after)"),
                    [[r["system"], fmt(r["effective_tokens_per_s"], ",.0f"),
                      fmt(r["after_failures_tokens_per_s"], ",.0f"), fmt(r.get("vs_failure_free"), ".3f"),
                      fmt(r.get("vs_checkpoint_restart"), ".3f")] for r in res["throughput"]])
    lines += ["## Tokens at a GPU-time budget", "",
              "Budget B per seed: the fewest device-seconds any failure system held by its end (one replica = one "
              "emulated device). Gain over checkpoint-and-restart at 0.1 B ... B (medians over seeds):", ""]
    lines += _table(("system", "B (device-s)", "tokens at B", "gain at 0.5 B", "gain at B"),
                    [[r["system"], fmt(r["budget_gpu_s"], ".0f"), fmt(r["tokens_at_budget"], ",.0f"),
                      _pct(r["gain_vs_checkpoint_restart"][4]), _pct(r["gain_vs_checkpoint_restart"][-1])]
                     for r in res["budget"]])
    if "budget.png" in plots:
        lines += ["![tokens at the budget and the widening gap](budget.png)", ""]
    lines += _simulator_md(res, inputs, "simulator.png" in plots)
    lines += [f"- {m}" for m in missing]
    return "\n".join(lines) + "\n"


def _simulator_md(res: dict[str, Any], inputs: dict[str, Any], plot: bool) -> list[str]:
    shown = {k: v for k, v in inputs.items() if k not in ("device_dominates", "full_point", "relaunches")}
    relaunch: dict[int, list[float]] = {}
    for seed in res.get("seeds", []):
        for k, cost in seed.get("inputs", {}).get("relaunches") or ():
            relaunch.setdefault(int(k), []).append(float(cost))
    lines = ["## The simulator against the measured runs", "",
             "Each measured run replayed by `recover simulate`'s engine, its kills at the times they happened in "
             "that run, calibrated only from measured inputs (the main runs' medians over seeds: " + ", ".join(
                 f"{k} {fmt(v, '.4g')}" for k, v in shown.items()) + "). "
             "Checkpoint-and-restart's relaunch, by replicas relaunched (kill to the relaunched job's first "
             "commit, minus one step; min..max over the seeds): " + (", ".join(
                 f"{k}: {min(v):.2f}..{max(v):.2f} s" for k, v in sorted(relaunch.items())) or "none measured") +
             ". Each run is simulated with the costs of the OTHER seeds' runs (leave one out). "
             "Within: |simulated / measured - 1| <= 10%.", ""]
    cal = [(res["plan"]["replicas"], res.get("calibration") or [])] + [
        (sc["replicas"], sc.get("calibration") or []) for sc in res.get("scale", [])]
    if any(points for _, points in cal):
        lines += ["Calibration (failure-free runs at fewer replicas, not the runs checked): the step overhead per "
                  "live replica count, which the simulator takes (linear in between); and, for comparison only, "
                  "the start of a fresh launch of that many replicas (launch to first commit, minus one step), "
                  "which a relaunch exceeds by its detection, teardown and checkpoint load.", ""]
        lines += _table(("job", "replicas", "step s", "overhead s", "start s"),
                        [[f"{n} replicas", str(p["replicas"]), fmt(p["step_time_s"], ".3f"),
                          fmt(p["overhead_s"], ".3f"), fmt(p["start_s"], ".2f")] for n, points in cal for p in points])
    rows = [[str(r.get("replicas", "-")), r["system"], str(r["seed"]), r["measure"], fmt(r["measured"], ",.1f"),
             fmt(r["simulated"], ",.1f"), _pct(r["error"]), {True: "yes", False: "**no**", None: "-"}[r["within"]]]
            for r in res["simulator"]]
    lines += _table(("replicas", "system", "seed", "measure", "measured", "simulated", "error", "within 10%"), rows)
    misses = [r for r in res["simulator"] if r["within"] is False]
    lines += [f"{len(res['simulator']) - len(misses)} of {len(res['simulator'])} within 10%."
              + (" Each miss is a finding to explain (docs/PAPER.md explains those of the runs recorded there), not "
                 "a parameter to tune." if misses else ""), ""]
    if plot:
        lines += ["![simulated over measured](simulator.png)", ""]
    if res.get("scale"):
        lines += ["## At other replica counts", "", "The same trace shape (half the replicas lost at evenly spaced "
                  "steps) at more replicas, run for the simulator's check: medians over their seeds.", ""]
        lines += _table(("replicas", "preset", "steps", "system", "after failures tok/s", "x ckpt-restart (after)",
                         "tokens at B vs ckpt-restart"),
                        [[str(sc["replicas"]), sc["config"], str(sc["steps"]), r["system"],
                          fmt(r["after_failures_tokens_per_s"], ",.0f"), fmt(r.get("vs_checkpoint_restart"), ".2f"),
                          _pct(next((b["gain_vs_checkpoint_restart"][-1] for b in sc["budget"]
                                     if b["system"] == r["system"]), None))]
                         for sc in res["scale"] for r in sc["throughput"]])
    lines += ["## Projections", "", "The presets of `recover simulate` (job shape, step time, failures, repair: "
              "assumed, see docs/BENCHMARKS.md), with their assumed costs and with the measured costs (recovery "
              "latency, shrink reconfiguration, relaunch, save) carried over as multiples of the measured step "
              "time.", ""]
    basis = res.get("projection_basis") or {}
    if basis:
        lines += [f"Measured: {', '.join(basis['measured'])}. Assumed: {', '.join(basis['assumed'])}.", ""]
    proj = [r for r in res.get("projections", []) if r["system"] == "recover"]
    lines += _table(("scenario", "GPUs", "costs", "failures", "recover / ckpt-restart, throughput after failures",
                     "recover / ckpt-restart, tokens at budget"),
                    [[r["scenario"], f"{r['gpus']:,}", r["costs"], str(r["failures"]),
                      fmt(r["recover_vs_restart_throughput"], ".2f"), fmt(r["recover_vs_restart_tokens"], ".2f")]
                     for r in proj])
    return lines


def _pyplot() -> Any:
    from recover.observe.plots import _pyplot as pyplot

    return pyplot()


def _plot_trajectory(res: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    deviation = res.get("deviation") or {}
    fig, axes = plt.subplots(2 if deviation else 1, 1, figsize=(9, 8 if deviation else 5), dpi=110, sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    for name, b in res["curves"].items():
        x = list(range(1, len(b["mean"]) + 1))
        style = {"lw": 1.4, **STYLES.get(name, {})}
        ax.plot(x, b["mean"], color=COLORS.get(name), label=f"{name} (mean of seeds)", **style)
        ax.fill_between(x, b["low"], b["high"], color=COLORS.get(name), alpha=0.18)
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("loss per committed step: seed mean, band = min..max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if deviation:
        dev = axes[1][0]
        dev.axhline(0, color="0.5", lw=0.8)
        for name, b in deviation.items():
            x = list(range(1, len(b["mean"]) + 1))
            dev.plot(x, b["mean"], color=COLORS.get(name), lw=1.2, label=name, **STYLES.get(name, {}))
            dev.fill_between(x, b["low"], b["high"], color=COLORS.get(name), alpha=0.18)
        dev.set_ylabel("minus the failure-free run of the same seed")
        dev.set_title("departure from the reference trajectory (mean and min..max over seeds)")
        dev.grid(alpha=0.3)
        dev.legend(fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_budget(res: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), dpi=110, sharex=True)
    for r in res["budget"]:
        ax1.plot(r["fractions"], r["tokens"], marker="o", color=COLORS.get(r["system"]), label=r["system"])
        if r["system"] != "checkpoint-and-restart":
            gain = [g * 100 if g is not None else float("nan") for g in r["gain_vs_checkpoint_restart"]]
            ax2.plot(r["fractions"], gain, marker="o", color=COLORS.get(r["system"]), label=r["system"])
    ax1.set_ylabel("tokens in the model")
    ax1.set_title("tokens at a fraction of the GPU-time budget (medians over seeds)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.axhline(0, color="0.5", lw=0.8)
    ax2.set_ylabel("% more tokens than ckpt-restart")
    ax2.set_xlabel("fraction of the budget B")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_simulator(res: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    rows = [r for r in res["simulator"] if r["measured"] and r["simulated"] is not None]
    for i, r in enumerate(rows):
        marker = "o" if r["measure"] == "effective_tokens_per_s" else "s"
        ax.scatter(i, r["simulated"] / r["measured"], color=COLORS.get(r["system"]), marker=marker, zorder=3)
    ax.axhspan(0.9, 1.1, color="0.85", alpha=0.6, label="within 10%", zorder=1)
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{r.get('replicas', '')}r {r['system'][:7]} s{r['seed']}" for r in rows],
                  rotation=60, fontsize=7)
    ax.set_ylabel("simulated / measured")
    ax.set_title("simulator vs measured (o: effective throughput, s: tokens at budget)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_summary(res: dict[str, Any]) -> None:
    """The headline tables on stdout (rich), then where the report is."""
    rows = []
    thr = {r["system"]: r for r in res["throughput"]}
    bud = {r["system"]: r for r in res["budget"]}
    for r in res["trajectory"]:
        if r.get("deterministic"):
            continue
        t = r.get("test") or {}
        vals = r["final_val_loss"]
        rows.append([r["system"], fmt(sum(vals) / len(vals) if vals else None, ".4f"),
                     ("yes" if t.get("all_inside") else "no") if t else "(reference)",
                     fmt(thr.get(r["system"], {}).get("after_failures_tokens_per_s"), ",.0f"),
                     fmt(thr.get(r["system"], {}).get("vs_checkpoint_restart"), ".3f"),
                     _pct((bud.get(r["system"]) or {}).get("gain_vs_checkpoint_restart", [None])[-1])])
    sim = res["simulator"]
    notes = [f"simulator: {sum(1 for r in sim if r['within'])} of {len(sim)} measured runs within 10%",
             f"wall time of its runs {fmt(res.get('stages_s'), '.0f')} s (this invocation "
             f"{fmt(res.get('wall_s'), '.0f')} s), load {res.get('load')}; report: {res.get('report')}"]
    if res.get("bitwise"):
        notes.insert(0, f"deterministic mode: bitwise equal = {res['bitwise']['bitwise_equal']}")
    print_rich_table(f"bench paper ({res['plan']['label']})", ("system", "final val loss (mean)",
                     "inside failure-free 95% PI", "tok/s after failures", "x ckpt-restart", "tokens at B vs ckpt"),
                     rows, notes)
