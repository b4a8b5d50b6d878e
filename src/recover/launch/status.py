"""``recover status RUN_DIR``: a job's state now, read from its run directory (while it runs or after).

Contract: it only reads ``events.jsonl`` and the replicas' step records (``replicas/replica_R.jsonl``,
merged by the launcher's rule, :mod:`recover.launch.records`), so it works for a job of ``recover launch``
and for one run across machines (the recipes' ``recover coordinator`` and ``recover worker`` processes
writing to shared storage), any number of times. :func:`job_status` is pure. A replica's state is the
last word the events say about it:

  ``training``  a member of the newest generation;
  ``draining``  a member an operator drains (``recover drain``): it leaves at the next commit;
  ``joining``   registered or restarted and not yet admitted (it takes the state at the next commit);
  ``lost``      declared dead (fenced, hung, silent, crashed) and not back;
  ``left``      said goodbye (trained to the end, or stopped).

Per replica: its state, the last step it recorded and its planned (relative) time per microbatch (the
newest the coordinator agreed, ``rebalanced``: the median replica's is 1.0; the run directory holds no
measured seconds). For the job: the generation and its members, the
committed steps of the planned ones, goodput so far (:mod:`recover.observe.goodput`) and the last
faults. ``--json`` prints the same as one JSON object; ``--watch S`` refreshes it every S seconds.

With ``--coordinator HOST:PORT`` (and the job's ``--token-file``, and ``--tls-*`` when its wire is TLS)
it asks the running coordinator instead (:mod:`recover.coord.operator`): the same figures as it sees
them now, each member ``computing``, ``waiting`` or ``draining`` by its last heartbeat, its measured
seconds per microbatch and its planned (relative) time, but no goodput (the step records are in the
run directory, not in the coordinator).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recover.coord.tls import Tls, add_tls_flags
from recover.errors import RecoverError
from recover.launch.records import LogEpochs, StepRecords
from recover.names import Event

FAULT_KINDS = (Event.KILL, Event.FAILURE_DETECTED, Event.FENCED, Event.RESTORED, Event.DIVERGENT,
               Event.NONFINITE, Event.QUORUM_LOST, Event.COORDINATOR_EXIT)
"""The events :func:`job_status` lists as the last faults."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a job's state now: members, step, speeds, goodput, the last faults",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", nargs="?", default=None, help="the job's --out (while it runs, or after)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="ask the running job's coordinator instead of reading RUN_DIR (with --token-file)")
    p.add_argument("--token-file", default=None, help="with --coordinator: the file holding the job's token")
    add_tls_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--watch", type=float, default=None, metavar="S", help="refresh every S seconds (Ctrl-C ends)")
    p.add_argument("--faults", type=int, default=5, metavar="N", help="how many of the last faults (default 5)")
    p.set_defaults(func=run_status)


def job_status(events: list[dict[str, Any]], records: StepRecords, last_steps: dict[int, int],
               now: float, faults: int = 5) -> dict[str, Any]:
    """The job's state from its events (file order), merged step records and the last step each replica
    recorded itself (replica -> step)."""
    from recover.observe.goodput import goodput

    replicas: dict[int, dict[str, Any]] = {}
    members: list[int] = []
    generation, planned, speeds = 0, None, {}

    def at(r: int) -> dict[str, Any]:
        return replicas.setdefault(r, {"replica": r, "state": "joining", "last_step": None, "planned": None})

    for e in events:
        kind, r = e.get("kind"), e.get("replica")
        if kind == Event.LAUNCH:
            planned = e.get("steps")
        elif kind == Event.GENERATION:
            generation, members = e["generation"], list(e["members"])
            for m in members:
                at(m)["state"] = "training"
        elif kind == Event.REBALANCED:
            speeds = {int(k): v for k, v in e.get("speeds", {}).items()}
        elif r is None:
            continue
        elif kind in (Event.REGISTER, Event.JOIN_REQUEST, Event.REJOIN_STARTED) and r not in members:
            at(r)["state"] = "joining"
        elif kind == Event.DRAIN_REQUESTED and r in members:
            at(r)["state"] = "draining"
        elif kind == Event.FAILURE_DETECTED:
            at(r)["state"] = "left" if e.get("cause") == "left" else "lost"
        elif kind in (Event.LEFT, Event.FINISHED, Event.STOPPED):
            at(r)["state"] = "left"
    for r, step in last_steps.items():
        at(r)["last_step"] = step
    for r, rep in replicas.items():
        rep["planned"] = speeds.get(r)  # relative planned times (the median replica's 1.0), not seconds
    merged = records.merged()
    rows = [merged[s] for s in sorted(merged)]
    g = goodput(rows, events, now=now) if rows else None
    return {"generation": generation, "members": members, "committed_steps": records.committed(),
            "planned_steps": planned,
            "replicas": [replicas[r] for r in sorted(replicas)],
            "goodput": g.to_dict() if g is not None else None,
            "faults": [e for e in events if e.get("kind") in FAULT_KINDS][-faults:] if faults > 0 else []}


def read_status(run_dir: Path, faults: int = 5) -> dict[str, Any]:
    """:func:`job_status` of ``run_dir``. Raises RecoverError when it holds no job's events."""
    from recover.observe.events import read_jsonl

    path = run_dir / "events.jsonl"
    if not path.is_file():
        raise RecoverError(f"{run_dir}: no events.jsonl; give the --out of a job (recover launch, or the "
                           "recipes' coordinator and workers)")
    records, last_steps, epochs = StepRecords(), {}, LogEpochs()
    for log in sorted((run_dir / "replicas").glob("replica_*.jsonl")):
        steps = [rec["step"] for rec in epochs.mark(log, read_jsonl(log)) if records.add(rec)]
        if steps:
            last_steps[int(log.stem.removeprefix("replica_"))] = max(steps)
    return {**job_status(list(read_jsonl(path)), records, last_steps, time.time(), faults),
            "holder": lease_holder(run_dir)}


def lease_holder(run_dir: Path) -> dict[str, Any] | None:
    """Who holds the run directory (:mod:`recover.observe.lease`): ``describe``, ``pid``, ``host`` and ``gone``
    (why the holder is provably gone, None while it may run); None when nobody does."""
    from dataclasses import asdict

    from recover.observe.lease import NAME, TTL_S, gone_why, holder

    h = holder(run_dir)
    if h is None:
        return None
    return {**asdict(h), "describe": h.describe(), "gone": gone_why(h, run_dir / NAME, TTL_S)}


COLUMNS = (("state", "state"), ("last_step", "last step"), ("activity", "activity"), ("mb_s", "s / microbatch"),
           ("planned", "planned"))
"""The per-replica columns a table shows, when its rows carry them (a run directory's or a coordinator's)."""


def status_table(s: dict[str, Any], where: Any) -> Any:
    """The status (of a run directory or a coordinator: ``where``) as a rich table: one row per replica,
    the job's figures in the title and caption."""
    from rich.table import Table

    of = f" of {s['planned_steps']}" if s.get("planned_steps") else ""
    g = s["goodput"]
    table = Table(title=f"{where}: generation {s['generation']}, members {s['members']}, "
                        f"{s['committed_steps']}{of} steps committed"
                        + (f", goodput {100 * g['ettr']:.1f}%" if g else ""))
    rows = s["replicas"]
    cols = [(key, name) for key, name in COLUMNS if any(key in rep for rep in rows)]
    table.add_column("replica", justify="right")
    for key, name in cols:
        table.add_column(name, justify="left" if key in ("state", "activity") else "right")
    for rep in rows:
        cells = ["-" if rep.get(key) is None else f"{rep[key]:.4f}" if key in ("mb_s", "planned") else str(rep[key])
                 for key, _ in cols]
        table.add_row(str(rep["replica"]), *cells)
    lines = []
    for e in s["faults"]:
        detail = ", ".join(f"{k} {e[k]}" for k in ("step", "cause", "fault", "reason") if e.get(k) is not None)
        when = time.localtime(e["t"] if "t" in e else time.time() - e["ago_s"])
        lines.append(f"{time.strftime('%H:%M:%S', when)} {e['kind']} replica "
                     f"{e.get('replica', '-')}" + (f": {detail}" if detail else ""))
    table.caption = "last faults:\n" + "\n".join(lines) if lines else "no faults"
    if s.get("holder"):  # a run directory's: who runs the job in it
        h = s["holder"]
        table.caption = f"held by {h['describe']}" + (f" (gone: {h['gone']})" if h["gone"] else "") + \
            "\n" + table.caption
    return table


def status_source(args: argparse.Namespace) -> tuple[Any, Callable[[], dict[str, Any]]]:
    """Where the status comes from (a run directory, or a coordinator asked with the token) and how to
    read it now. Raises RecoverError (one line) for a command line naming neither or both."""
    if (args.run_dir is None) == (args.coordinator is None):
        raise RecoverError("give a run directory (RUN_DIR) or --coordinator HOST:PORT with --token-file, not both")
    if args.run_dir is not None:
        run_dir = Path(args.run_dir)
        return run_dir, lambda: read_status(run_dir, args.faults)
    from recover.coord.cli import read_token
    from recover.coord.operator import ask

    if args.token_file is None:
        raise RecoverError("--coordinator needs --token-file (the file holding the job's token)")
    token, tls = read_token(args.token_file), Tls.from_flags(args.tls_cert, args.tls_key, args.tls_ca)

    def live() -> dict[str, Any]:
        s = ask(args.coordinator, token, {"type": "status"}, tls)["status"]
        return {**s, "faults": s["faults"][-args.faults:] if args.faults > 0 else []}
    return args.coordinator, live


def run_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    where, read = status_source(args)
    console = Console()
    while True:
        s = read()
        if args.json:
            print(json.dumps(s), flush=True)
        else:
            if args.watch:
                console.clear()
            console.print(status_table(s, where))
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
