"""``recover demo``: the main job on the embedded default, with real failures.

Runs the ``tiny`` preset on the stdlib corpus twice with 4 replicas: a failure-free reference,
then the same job with two replicas SIGKILLed at different phases (one of them rejoining), and
prints a table comparing the two: the loss curve of the failed run should lie on top of the
reference's, with M microbatches in every step. Both launches are checked before the first starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recover.names import Phase

DEMO_FAILURES: tuple[tuple[int, float, Phase], ...] = ((1, 0.2, Phase.BACKWARD), (3, 0.5, Phase.REDUCE))
"""(replica, fraction of the run, phase) of each kill: ``1@12:backward`` and ``3@30:reduce`` in 60 steps."""
REPLICAS, REJOIN_AFTER_S = 4, 3.0


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the main job: 4 replicas on the stdlib corpus, 2 killed, 1 rejoins",
                       description=__doc__)
    d.add_argument("--out", default="runs/demo", help="directory for both runs (default runs/demo)")
    d.add_argument("--config", default="tiny", help="preset (default tiny)")
    d.add_argument("--steps", type=int, default=None, help="override training.steps (the kills scale with it)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=run_demo)


def demo_failures(steps: int) -> tuple[str, ...]:
    """The demo's kills as ``R@STEP:PHASE`` for a run of ``steps`` steps."""
    return tuple(f"{replica}@{int(fraction * steps)}:{phase}" for replica, fraction, phase in DEMO_FAILURES)


def run_demo(args: argparse.Namespace) -> int:
    from recover.config import load_config
    from recover.launch.cli import LaunchRequest, check_launch, launch
    from recover.launch.report import compare

    console = Console()
    out = Path(args.out)
    ref, run = out / "reference", out / "failures"
    steps = args.steps or load_config(args.config).training.steps
    failures = demo_failures(steps)
    reference = LaunchRequest(out=ref, config=args.config, replicas=REPLICAS, steps=args.steps,
                              progress=not args.no_progress, overwrite=True)  # the demo owns its directories
    with_failures = LaunchRequest(out=run, config=args.config, replicas=REPLICAS, steps=args.steps,
                                  progress=not args.no_progress, overwrite=True, failures=failures,
                                  rejoin_after_s=REJOIN_AFTER_S, rejoin_replicas=frozenset({DEMO_FAILURES[0][0]}),
                                  reference=ref)
    for request in (reference, with_failures):
        check_launch(request)  # refuse a bad request before the first run starts
    console.print(f"[bold]1/2[/] failure-free reference: {REPLICAS} replicas")
    if (code := launch(reference)) != 0:
        return code
    console.print(f"[bold]2/2[/] same job, killing replica 1 in a backward pass and replica 3 in an all-reduce "
                  f"({', '.join(failures)}); replica 1 rejoins {REJOIN_AFTER_S:g} s after its death")
    if (code := launch(with_failures)) != 0:
        return code
    cmp = compare(ref, run)
    s_ref = json.loads((ref / "summary.json").read_text())
    s_run = json.loads((run / "summary.json").read_text())
    table = Table(title=f"recover demo: failure-free vs {s_run['kills']} replicas killed ({s_run['rejoins']} rejoined)")
    table.add_column("")
    table.add_column("reference", justify="right")
    table.add_column("with failures", justify="right")
    rows = [
        ("committed steps", s_ref["committed_steps"], s_run["committed_steps"]),
        ("microbatches per step (min..max)", f"{s_ref['min_microbatches']}..{s_ref['max_microbatches']}",
         f"{s_run['min_microbatches']}..{s_run['max_microbatches']}"),
        ("replicas killed / rejoined", "0 / 0", f"{s_run['kills']} / {s_run['rejoins']}"),
        ("recovery latency, kill -> all survivors computing (ms)", "-",
         ", ".join(f"{r['latency_ms']:.0f}" for r in s_run["recoveries"]) or "-"),
        ("max relative loss deviation from reference", "0", f"{cmp['max_rel_loss_diff']:.2e}"),
        ("final validation loss", f"{s_ref['final_val_loss']:.4f}", f"{s_run['final_val_loss']:.4f}"),
        ("wall time (s)", f"{s_ref['wall_s']:.1f}", f"{s_run['wall_s']:.1f}"),
    ]
    for row in rows:
        table.add_row(*(str(x) for x in row))
    console.print(table)
    console.print(f"plots: {run / 'loss.png'} (over the reference) and {run / 'throughput.png'}")
    return 0
