"""The live progress display of a training run.

On a terminal: a rich progress bar with step, loss, tokens/s, live replicas and ETA, redrawn in
place. Elsewhere (CI logs, pipes): one plain line every ``every`` steps and at the end, so logs
stay readable. ``update`` takes the same record that goes to ``metrics.jsonl`` and, from the
launcher, the job's goodput so far (:func:`recover.observe.goodput.describe`).
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt(record: dict[str, Any], goodput: str | None = None) -> str:
    parts = [f"loss {record['loss']:.4f}"]
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    parts.append(f"{record.get('tokens_per_s', 0):,.0f} tok/s")
    if record.get("live_replicas") is not None:
        parts.append(f"replicas {record['live_replicas']}")
    if record.get("generation"):
        parts.append(f"gen {record['generation']}")
    if record.get("stragglers"):
        quotas = record.get("quotas", {})
        parts.append("slow " + ", ".join(f"r{r} {s:.1f}x" + (f" ({quotas[r]} mb)" if r in quotas else "")
                                         for r, s in record["stragglers"].items()))
    if record.get("recovery_ms") is not None:
        parts.append(f"last recovery {record['recovery_ms']:.0f} ms")
    if goodput:
        parts.append(goodput)
    return "  ".join(parts)


class ProgressDisplay:
    def __init__(self, total_steps: int, first_step: int = 0, title: str = "train", every: int = 10,
                 enabled: bool = True, force_plain: bool = False) -> None:
        self.total = total_steps
        self.every = max(1, every)
        self.enabled = enabled
        self.console = Console(file=sys.stdout)
        self.live = enabled and self.console.is_terminal and not force_plain
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._task = self._progress.add_task(title, total=total_steps, completed=first_step, info="")
            self._progress.start()

    def update(self, record: dict[str, Any], goodput: str | None = None) -> None:
        if not self.enabled:
            return
        step = record["step"] + 1
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=_fmt(record, goodput))
        elif step % self.every == 0 or step == self.total or record.get("val_loss") is not None:
            print(f"step {step:>5}/{self.total}  {_fmt(record, goodput)}", flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
