"""``recover demo``: the main job on the embedded default, meeting every kind of fault in one run.

Runs the ``tiny`` preset for 40 steps on the stdlib corpus twice with 4 replicas, both in
deterministic mode: a failure-free reference, then the same job meeting, in turn, a crash (a SIGKILL
in a backward pass), a hang (a training thread stuck for good while its heartbeats go on), a straggler (a replica 3x
slower for a while) and a corrupted replica (one parameter bit flipped); each lost replica rejoins
with the others' state. It prints, per fault, its detection and recovery times, and the two runs
side by side: microbatches per step (all M), the largest loss deviation from the reference (0:
bitwise equal), and goodput with the time lost by cause. Both launches are checked before the first
starts; the plots (loss over the reference, throughput, goodput) stay in the run directory, and so does
a complete checkpoint of the last step (``training.checkpoint_every = "auto"``: Young/Daly's interval,
which for a run this short is a save after the first step and one at the end), so the closing lines can
name what to try next on the trained model: ``recover sample``, ``recover export``, ``recover report``.
The two tables are also written as plain text to ``OUT/tables.txt`` and, with ``--readme PATH``, into PATH's
block after :data:`README_MARKER` (the README's tables are a run's, not a paste).
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from recover.faults import kind
from recover.names import Phase

if TYPE_CHECKING:
    from recover.launch.cli import LaunchRequest

REPLICAS, STEPS, REJOIN_AFTER_S, HANG_TIMEOUT_S = 4, 40, 1.0, 3.0


@dataclass(frozen=True)
class DemoFault:
    """One fault of the demo: the fault kind ``fault`` (:mod:`recover.faults.kinds`) on ``replica`` at
    ``fraction`` of the run (``arg``: what its flag takes after ``R@STEP:``, the phase or the slow-down factor)."""

    fault: str
    replica: int
    fraction: float
    arg: str = ""

    def value(self, steps: int) -> str:
        """What its ``recover launch`` flag is given, e.g. ``2@10:forward``."""
        return f"{self.replica}@{int(self.fraction * steps)}" + (f":{self.arg}" if self.arg else "")

    def spec(self, steps: int) -> str:
        """The failure spec as ``recover launch`` passes it on (``R@STEP:PHASE[=FAULT[:ARG]]``)."""
        return str(kind(self.fault).parse(self.value(steps)))

    def flag(self, steps: int) -> str:
        """The ``recover launch`` flag that injects it, e.g. ``--hang 2@10:forward``."""
        return f"{kind(self.fault).flag} {self.value(steps)}"


DEMO_FAULTS: tuple[DemoFault, ...] = (
    DemoFault("kill", 1, 0.10, Phase.BACKWARD),   # a crash: SIGKILL in a backward pass
    DemoFault("hang", 2, 0.25, Phase.FORWARD),    # a stuck training thread, heartbeats alive
    DemoFault("slow", 3, 0.40, "3"),              # a straggler: 3x slower ...
    DemoFault("slow", 3, 0.60, "1"),              # ... until 60% of the run
    DemoFault("corrupt", 0, 0.72),                # one parameter bit of replica 0 flips
)
"""At 40 steps: ``--fail 1@4:backward --hang 2@10:forward --slow 3@16:3 --slow 3@24:1 --corrupt 0@28``.
Spaced so that each lost replica is back before the next loses one (the corruption needs a strict
majority of healthy replicas to be found) and the last is back before the run ends."""


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the main job: 4 replicas meet a crash, a hang, a straggler and a corruption",
                       description=__doc__)
    d.add_argument("--out", default="runs/demo", help="directory for both runs (default runs/demo)")
    d.add_argument("--config", default="tiny", help="preset (default tiny)")
    d.add_argument("--steps", type=int, default=STEPS,
                   help=f"training.steps (default {STEPS}; the faults scale with it)")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--readme", default=None, metavar="PATH",
                   help="write the two tables into PATH's block after its marker line (README.md: its demo "
                        "tables come from a run, not from a paste)")
    d.set_defaults(func=run_demo)


def demo_failures(steps: int) -> tuple[str, ...]:
    """The demo's faults as failure specs for a run of ``steps`` steps."""
    return tuple(f.spec(steps) for f in DEMO_FAULTS)


def demo_requests(out: Path, config: str = "tiny", steps: int | None = STEPS,
                  progress: bool = True) -> tuple[LaunchRequest, LaunchRequest]:
    """The two launches of the demo: the failure-free reference and the run with every fault (both
    deterministic, so the faulty run's losses are bitwise the reference's)."""
    from recover.config import load_config
    from recover.launch.cli import LaunchRequest

    n = steps or load_config(config).training.steps
    common: dict[str, Any] = dict(  # overwrite: the demo owns its directories
        config=config, replicas=REPLICAS, steps=steps, progress=progress, overwrite=True, deterministic=True,
        overrides=(f"--fault_tolerance.hang_timeout_s={HANG_TIMEOUT_S:g}", "--training.checkpoint_every=auto"))
    reference = LaunchRequest(out=out / "reference", **common)
    faults = LaunchRequest(out=out / "failures", failures=demo_failures(n), rejoin_after_s=REJOIN_AFTER_S,
                           reference=out / "reference", **common)
    return reference, faults


def run_demo(args: argparse.Namespace) -> int:
    from recover.launch.cli import check_launch, launch
    from recover.launch.report import compare, faults_table

    console = Console()
    out = Path(args.out)
    reference, faults = demo_requests(out, args.config, args.steps, not args.no_progress)
    for request in (reference, faults):
        opts = check_launch(request)  # refuse a bad request before the first run starts
    console.print(f"[bold]1/2[/] failure-free reference: {REPLICAS} replicas, deterministic")
    if (code := launch(reference)) != 0:
        return code
    flags = " ".join(f.flag(args.steps or opts.config.training.steps) for f in DEMO_FAULTS)
    console.print(f"[bold]2/2[/] the same job meeting a crash, a hang, a straggler and a corrupted replica "
                  f"({flags} --rejoin-after {REJOIN_AFTER_S:g})")
    if (code := launch(faults)) != 0:
        return code
    s_ref = json.loads((reference.out / "summary.json").read_text())
    s_run = json.loads((faults.out / "summary.json").read_text())
    tables = [faults_table(s_run["faults"], title="recover demo: each fault, found and recovered from in-step"),
              comparison_table(s_ref, s_run, compare(reference.out, faults.out))]
    for table in tables:
        console.print(table)
    plain = Console(record=True, width=100, file=io.StringIO(), color_system=None)
    for table in tables:
        plain.print(table)
    text = "\n".join(line.rstrip() for line in plain.export_text().splitlines()) + "\n"
    (out / "tables.txt").write_text(text)
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(with_tables(readme.read_text(), text))
        console.print(f"the tables are in {readme}")
    console.print(f"plots in {faults.out}: loss.png (over the reference), throughput.png, goodput.png")
    console.print(next_commands(faults.out), soft_wrap=True, highlight=False)
    return 0


README_MARKER = "<!-- recover demo --readme README.md writes the block below -->"
"""The line after which ``recover demo --readme`` writes its tables (the fenced block that follows)."""


def with_tables(text: str, tables: str) -> str:
    """``text`` with the fenced block after :data:`README_MARKER` replaced by ``tables``. Raises ValueError
    when the marker or its block is missing."""
    head, marker, tail = text.partition(README_MARKER + "\n")
    if not marker or not tail.startswith("```\n") or "\n```\n" not in tail[3:]:
        raise ValueError(f"no {README_MARKER!r} line followed by a ``` block")
    rest = tail[4:].split("\n```\n", 1)[1]
    return f"{head}{marker}```\n{tables.rstrip()}\n```\n{rest}"


def next_commands(run: Path) -> str:
    """The closing lines: what to try next on the run the demo trained (its final checkpoint is there)."""
    return "\n".join([
        "next, on the model the faulty run trained (its final checkpoint is in the run directory):",
        f"  recover sample {run} --prompt 'def main('      # continue a prompt",
        f"  recover export {run} --format hf --out {run.parent / 'hf'}   # a Hugging Face Llama",
        f"  recover report {run} --reference {run.parent / 'reference'}   # these tables again",
        f"  recover status {run}                            # the job's state (while a job runs, too)",
    ])


def comparison_table(s_ref: dict[str, Any], s_run: dict[str, Any], cmp: dict[str, Any]) -> Table:
    """The two runs side by side: trajectory (microbatches, loss deviation) and goodput."""
    table = Table(title="recover demo: failure-free reference vs the same job with the faults")
    table.add_column("")
    table.add_column("reference", justify="right")
    table.add_column("with faults", justify="right")
    g_ref, g_run = s_ref["goodput"], s_run["goodput"]
    rejoined = sum(1 for f in s_run["faults"] if f["rejoin_s"] is not None)
    rows = [
        ("committed steps", s_ref["committed_steps"], s_run["committed_steps"]),
        ("microbatches per step (min..max)", f"{s_ref['min_microbatches']}..{s_ref['max_microbatches']}",
         f"{s_run['min_microbatches']}..{s_run['max_microbatches']}"),
        ("faults / replicas rejoined", "0 / 0", f"{len(s_run['faults'])} / {rejoined}"),
        ("max relative loss deviation from reference", "0",
         f"{cmp['max_rel_loss_diff']:.2e}" + (" (bitwise)" if cmp["bitwise_equal"] else "")),
        ("final validation loss", f"{s_ref['final_val_loss']:.4f}", f"{s_run['final_val_loss']:.4f}"),
        ("goodput (effective training time ratio)", f"{100 * g_ref['ettr']:.1f}%", f"{100 * g_run['ettr']:.1f}%"),
        ("goodput after start-up", f"{100 * g_ref['ettr_after_startup']:.1f}%",
         f"{100 * g_run['ettr_after_startup']:.1f}%"),
        ("tokens committed", f"{g_ref['tokens_committed']:,}", f"{g_run['tokens_committed']:,}"),
    ]
    for cause, secs in g_run["lost_s"].items():
        if secs >= 0.005 or g_ref["lost_s"].get(cause, 0) >= 0.005:
            rows.append((f"  time lost: {cause} (s)", f"{g_ref['lost_s'].get(cause, 0.0):.2f}", f"{secs:.2f}"))
    rows.append(("wall time (s)", f"{s_ref['wall_s']:.1f}", f"{s_run['wall_s']:.1f}"))
    for row in rows:
        table.add_row(*(str(x) for x in row))
    return table
