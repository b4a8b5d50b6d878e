"""``recover collect RUN_DIR``: the run records of a job started without ``recover launch``.

Across machines (``recover coordinator`` and one ``recover worker`` job per replica, as the Slurm
and Kubernetes recipes in ``examples/`` start them) no launcher merges the step records: rank 0 of
every replica appends its own to ``replicas/replica_R.jsonl`` and the coordinator and the workers
append their events to ``events.jsonl``. This command does what the launcher does at the end of a
run on one machine: ``metrics.jsonl`` (one record per committed step, in step order),
``summary.json`` and the plots.

Contract: it only reads the replica logs and the events and rewrites those three outputs, so it may
run at any time (during a run it shows the steps committed so far) and any number of times. The
records merge by the launcher's rule (:mod:`recover.launch.records`): a step recorded by several
replicas, or recorded again after a resume from an older checkpoint (the steps since that checkpoint
are redone), appears once, as its newest record: the one the run went on from.
``elapsed_s`` counts from the run's first event (the coordinator's start), so a requeued job's time
in the queue is part of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from recover.errors import RecoverError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="metrics.jsonl, summary.json and plots of a job run across machines",
                       description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1])
    p.add_argument("run_dir", help="the --out of the job's workers")
    p.set_defaults(func=run_collect)


def collect(run_dir: Path) -> dict[str, Any]:
    """Writes ``metrics.jsonl``, ``summary.json`` and the plots of ``run_dir``; returns the summary.

    Raises:
        RecoverError: no replica has recorded a step under ``run_dir/replicas``.
    """
    from recover.launch.records import StepRecords, read_step_logs, write_metrics
    from recover.launch.report import plot_run, summarize
    from recover.observe.events import read_jsonl

    run_dir = Path(run_dir)
    logs = sorted((run_dir / "replicas").glob("replica_*.jsonl"))
    records = StepRecords(read_step_logs(logs))
    merged = records.merged()
    if not merged:
        raise RecoverError(f"{run_dir}: no step records under {run_dir / 'replicas'}; give the --out of the "
                           "job's `recover worker` processes (their rank 0 writes replicas/replica_R.jsonl)")
    events_path = run_dir / "events.jsonl"
    first_event = next(iter(read_jsonl(events_path)), None) if events_path.is_file() else None
    t0 = min([rec["t"] - rec.get("time_s", 0.0) for rec in merged.values()]
             + ([first_event["t"]] if first_event and "t" in first_event else []))
    write_metrics(run_dir / "metrics.jsonl", records, t0)
    wall_s = max(rec["t"] for rec in merged.values()) - t0
    summary = summarize(run_dir, run_dir.name, wall_s)
    try:
        plot_run(run_dir)
    except Exception as exc:  # a plot never fails the records
        print(f"warning: plots not written: {exc}")
    return summary


def run_collect(args: argparse.Namespace) -> int:
    """``recover collect``: one line with the committed steps, the wall time and where the outputs are."""
    from recover.observe.plots import load_metrics

    run_dir = Path(args.run_dir)
    s = collect(run_dir)
    steps = [r["step"] for r in load_metrics(run_dir)]
    missing = sorted(set(range(steps[-1] + 1)) - set(steps))
    print(f"{s['committed_steps']} steps committed in {s['wall_s']:.1f} s"
          f"{f' (steps {missing} not recorded)' if missing else ''}; microbatches per step "
          f"{s['min_microbatches']}..{s['max_microbatches']}; final loss {s['final_loss']}"
          f"{'; stopped on request' if s['stopped'] else ''}; outputs in {run_dir}", flush=True)
    return 0
