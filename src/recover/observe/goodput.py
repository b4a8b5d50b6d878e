"""Goodput: how much of a job's wall time went into training, and where the rest went.

Pure functions over a run's records (``metrics.jsonl`` rows, ``events.jsonl`` events); no I/O, so the
launcher's live display, ``summary.json`` and ``recover report`` compute the same numbers.

Definitions (the effective training time ratio, ETTR, of Llama 3 and ByteRobust: productive training
time over the job's wall-clock time):

* **wall time** W: the time the job ran, from each ``launch`` event to its ``end`` event, summed over
  the launches of the run directory (a resumed run adds its own; the time nothing ran in between is
  not the job's). Without launch events (``recover train``), from the first step's start to the last
  commit.
* **step interval**: the time from one commit to the next (commit times from the coordinator's
  ``commit`` events; without them the step records' times); a launch's first step starts at the launch.
* **planned step time** T: the median interval of the *clean* steps: all of the job's replicas live,
  and nothing below in the interval (no failure, join, restart, slow replica, checkpoint, evaluation).
  It is the failure-free step time this run itself shows.
* **useful (productive) time** U = sum over committed steps of min(interval, T): every committed
  step counts as the time a failure-free step takes, never more. **ETTR = U / W**, in [0, 1].
* **tokens committed**: the tokens of the committed steps (each step once).
* ``ettr_after_startup`` = U / (W - startup): a short run's start-up (processes, imports, model
  build: seconds) dominates its wall time but not a long job's.

The lost time W - U is split by cause; the causes add up to it exactly. In each interval the excess
over T goes first to the checkpoint saves it holds (their measured blocking seconds, ``checkpoint``
events), then to the evaluation that ran in it (``eval_s`` of the step before), then the rest to the
first cause that applies, in this order:

``startup``     the launch's first step (process start, imports, model build, registration);
``restart``     a resumed launch's first step, a coordinator restart (``coordinator_exit``), a
                checkpoint-and-restart (``job_restart``), the restore of a checkpoint after every replica
                holding the state was lost (``restored``), and what a stopped launch did after its last
                step that counts (steps redone after the resume are lost here);
``recovery``    a failure in the step: detection (a crash in ms, a hang after the hang timeout, a
                corrupted replica at the vote) and the in-step recompute of the orphaned microbatches;
``rejoin``      a replica admitted: the state transfer to the joiner;
``stragglers``  a replica was slow (named by the coordinator, ``stragglers`` in the step record, or an
                injected ``--slow`` in effect): the time over T despite the rebalanced plan;
``degraded``    fewer replicas live than the job started with (a lost one not yet back);
``other``       everything else: jitter above T, and after the last commit the shutdown.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from recover.names import Event, slowing

CAUSES = ("startup", "restart", "recovery", "rejoin", "checkpoint", "evaluation", "stragglers", "degraded",
          "other")
"""Causes of lost time, in the order tables list them."""

_RESTART = frozenset({Event.COORDINATOR_EXIT, Event.JOB_RESTART, Event.RESYNCED, Event.RESTORED})
_REJOIN = frozenset({Event.GREW, Event.STATE_RECEIVED})


@dataclass(frozen=True)
class StepTime:
    """One committed step's interval on the job clock (seconds since the run's first launch, offline
    time left out), its useful part and its lost part by cause."""

    step: int
    start: float
    end: float
    useful: float
    lost: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Goodput:
    """A run's goodput (see the module docstring); ``to_dict`` is what ``summary.json`` holds."""

    wall_s: float
    useful_s: float
    planned_step_s: float
    committed_steps: int
    tokens: int
    lost_s: dict[str, float]
    steps: tuple[StepTime, ...] = ()

    @property
    def ratio(self) -> float:
        """Effective training time ratio U / W (0 for an empty run)."""
        return min(1.0, self.useful_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def ratio_after_startup(self) -> float:
        """U / (W - startup): the ratio once the job first trains (a short run's start-up dominates W)."""
        rest = self.wall_s - self.lost_s.get("startup", 0.0)
        return min(1.0, self.useful_s / rest) if rest > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"ettr": round(self.ratio, 4), "ettr_after_startup": round(self.ratio_after_startup, 4),
                "wall_s": round(self.wall_s, 3), "useful_s": round(self.useful_s, 3),
                "planned_step_s": round(self.planned_step_s, 4), "committed_steps": self.committed_steps,
                "tokens_committed": self.tokens,
                "tokens_per_s": round(self.tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0,
                "lost_s": {c: round(self.lost_s.get(c, 0.0), 3) for c in CAUSES}}


@dataclass(frozen=True)
class _Segment:
    """One launch: [start, end] in Unix time, and where it starts on the job clock."""

    start: float
    end: float
    offset: float = 0.0


def _segments(events: list[dict[str, Any]], last_t: float) -> list[_Segment]:
    """The launches, each from its ``launch`` to its ``end`` event; one with no end (killed, or still
    running) ends at the next launch, or at ``last_t``."""
    spans: list[list[float | None]] = []
    for e in events:
        if e.get("kind") == Event.LAUNCH:
            spans.append([e["t"], None])
        elif e.get("kind") == Event.END and spans and spans[-1][1] is None:
            spans[-1][1] = e["t"]
    segs, offset = [], 0.0
    for i, (start, end) in enumerate(spans):
        assert start is not None
        if end is None:
            end = spans[i + 1][0] if i + 1 < len(spans) else max(last_t, start)
        segs.append(_Segment(start, end, offset))  # type: ignore[arg-type]
        offset += end - start  # type: ignore[operator]
    return segs


def _step_ends(rows: list[dict[str, Any]], events: list[dict[str, Any]], t0: float | None) -> dict[int, float]:
    """Unix time at which each committed step committed: its last ``commit`` event, else its record's."""
    commits = {e["step"]: e["t"] for e in events if e.get("kind") == Event.COMMIT and "step" in e}
    ends = {}
    for r in rows:
        if r["step"] in commits:
            ends[r["step"]] = commits[r["step"]]
        elif "t" in r:
            ends[r["step"]] = r["t"]
        else:
            ends[r["step"]] = (t0 or 0.0) + r.get("elapsed_s", 0.0)
    return ends


def _slow_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """[from, to] of every injected slow-down (``slowed`` events, whichever fault kind wrote them), ended by
    factor 1 or the replica's loss."""
    spans: list[tuple[float, float]] = []
    open_: dict[int, float] = {}
    for e in events:
        r = e.get("replica")
        if slowing(e):
            open_.setdefault(r, e["t"])
        elif e.get("kind") in (Event.SLOWED, Event.FAILURE_DETECTED) and r in open_:
            spans.append((open_.pop(r), e["t"]))
    spans += [(t, float("inf")) for t in open_.values()]
    return spans


def _within(events: list[dict[str, Any]], ts: list[float], a: float, b: float) -> list[dict[str, Any]]:
    """The events (sorted by time; ``ts`` their times) in (a, b]."""
    return events[bisect.bisect_right(ts, a):bisect.bisect_right(ts, b)]


def _flags(row: dict[str, Any], inside: list[dict[str, Any]], a: float, b: float, full: int,
           slow: list[tuple[float, float]]) -> list[str]:
    """The causes that apply to the interval (a, b] of step ``row`` (``inside``: its events), in priority order."""
    kinds = {e.get("kind") for e in inside}
    flags = []
    if kinds & _RESTART:
        flags.append("restart")
    if row.get("failures") or any(e.get("kind") == Event.FAILURE_DETECTED and e.get("cause") != "left" for e in inside):
        flags.append("recovery")
    if kinds & _REJOIN:
        flags.append("rejoin")
    if row.get("stragglers") or any(s < b and a < t for s, t in slow):
        flags.append("stragglers")
    if row.get("live_replicas", full) < full:
        flags.append("degraded")
    return flags


def _io(inside: list[dict[str, Any]]) -> float:
    """Blocking seconds of the checkpoint saves among ``inside``."""
    return sum(e.get("blocking_s", 0.0) for e in inside if e.get("kind") == Event.CHECKPOINT)


def _split(excess: float, ckpt: float, evals: float, cause: str) -> dict[str, float]:
    """``excess`` seconds over T: checkpoint first, evaluation next, the rest to ``cause``."""
    lost: dict[str, float] = {}
    for name, part in (("checkpoint", ckpt), ("evaluation", evals)):
        take = min(max(part, 0.0), excess)
        if take > 0:
            lost[name] = take
            excess -= take
    if excess > 0:
        lost[cause] = lost.get(cause, 0.0) + excess
    return lost


@dataclass
class _Interval:
    """A committed step's interval: its record, launch (index), [start, end] in Unix time, whether it is
    its launch's first, the causes that apply, and the checkpoint and evaluation seconds it holds."""

    row: dict[str, Any]
    seg: int
    start: float
    end: float
    first: bool
    flags: list[str] = field(default_factory=list)
    ckpt: float = 0.0
    eval_s: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.first or self.flags or self.ckpt or self.eval_s)


def _intervals(rows: list[dict[str, Any]], ends: dict[int, float], segs: list[_Segment],
               events: list[dict[str, Any]], ts: list[float], full: int) -> list[_Interval]:
    """The committed steps' intervals in commit order, each with what happened in it."""
    out: list[_Interval] = []
    for r in sorted(rows, key=lambda r: ends[r["step"]]):
        end = ends[r["step"]]
        k = max((i for i, s in enumerate(segs) if s.start <= end), default=0)
        prev = out[-1] if out and out[-1].seg == k else None
        # an evaluation runs after its step's commit: it delays the next interval
        out.append(_Interval(r, k, prev.end if prev else segs[k].start, end, prev is None,
                             eval_s=prev.row.get("eval_s", 0.0) if prev else 0.0))
    slow = _slow_spans(events)
    for iv in out:
        inside = _within(events, ts, iv.start, iv.end)
        iv.flags, iv.ckpt = _flags(iv.row, inside, iv.start, iv.end, full, slow), _io(inside)
    return out


def _tail_losses(segs: list[_Segment], intervals: list[_Interval], events: list[dict[str, Any]],
                 ts: list[float]) -> dict[str, float]:
    """Lost time after each launch's last commit (all of a launch that committed nothing): its last
    evaluation and saves; the rest is ``other`` for the last launch, ``restart`` for a stopped one."""
    lost: dict[str, float] = {}
    for k, seg in enumerate(segs):
        mine = [iv for iv in intervals if iv.seg == k]
        since = mine[-1].end if mine else seg.start
        last = k == len(segs) - 1
        cause = ("other" if last else "restart") if mine else ("startup" if k == 0 else "restart")
        last_eval = mine[-1].row.get("eval_s", 0.0) if mine else 0.0
        parts = _split(max(0.0, seg.end - since), _io(_within(events, ts, since, seg.end)), last_eval, cause)
        for c, v in parts.items():
            lost[c] = lost.get(c, 0.0) + v
    return lost


def goodput(rows: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]], now: float | None = None,
            planned_step_s: float | None = None) -> Goodput:
    """The goodput of a run from its step records and events (see the module docstring).

    Args:
        rows: ``metrics.jsonl`` records (one per committed step; the last of a step wins).
        events: ``events.jsonl`` records, in file order.
        now: for a run still going, the current Unix time (its open launch ends there); default: the
            last commit or event seen.
        planned_step_s: T, when known from elsewhere (a failure-free reference); default: this run's.

    Returns:
        The :class:`Goodput`; an empty run has wall time 0 and ratio 0.
    """
    by_step = {int(r["step"]): r for r in rows if "step" in r}
    rows = [by_step[s] for s in sorted(by_step)]
    events = sorted((e for e in events if "t" in e), key=lambda e: e["t"])
    ts = [e["t"] for e in events]
    launches = [e for e in events if e.get("kind") == Event.LAUNCH]
    ends = _step_ends(rows, events, launches[0]["t"] if launches else None)
    last_t = max([*ends.values(), *ts], default=0.0)
    segs = _segments(events, now if now is not None else last_t)
    if not segs and rows:  # no launch recorded: from the first step's start to the last commit
        first = min(rows, key=lambda r: ends[r["step"]])
        segs = [_Segment(ends[first["step"]] - first.get("time_s", 0.0), last_t)]
    wall = sum(s.end - s.start for s in segs)
    if not rows:
        return Goodput(wall, 0.0, planned_step_s or 0.0, 0, 0, {"startup": wall} if wall > 0 else {})
    full = max([e.get("replicas", 0) for e in launches] + [r.get("live_replicas", 1) for r in rows])
    intervals = _intervals(rows, ends, segs, events, ts, full)
    clean = [iv.end - iv.start for iv in intervals if iv.clean]
    T = planned_step_s or statistics.median(clean or [r.get("time_s", 0.0) for r in rows])
    lost = _tail_losses(segs, intervals, events, ts)
    steps, useful = [], 0.0
    for iv in intervals:
        length = max(0.0, iv.end - iv.start)
        cause = ("startup" if iv.seg == 0 else "restart") if iv.first else (iv.flags[0] if iv.flags else "other")
        parts = _split(length - T, iv.ckpt, iv.eval_s, cause)
        useful += min(length, T)
        for c, v in parts.items():
            lost[c] = lost.get(c, 0.0) + v
        off = segs[iv.seg].offset - segs[iv.seg].start
        steps.append(StepTime(iv.row["step"], round(iv.start + off, 6), round(iv.end + off, 6), min(length, T), parts))
    tokens = sum(int(r.get("tokens", 0)) for r in rows)
    return Goodput(wall, useful, T, len(rows), tokens, {c: lost[c] for c in CAUSES if lost.get(c, 0.0) > 0},
                   tuple(steps))


def describe(g: Goodput) -> str:
    """One line for a progress display or a log: ``goodput 83.1% (lost: recovery 2.1 s, ...)``."""
    lost = sorted(((c, v) for c, v in g.lost_s.items() if v >= 0.05), key=lambda cv: -cv[1])[:3]
    tail = f" (lost: {', '.join(f'{c} {v:.1f} s' for c, v in lost)})" if lost else ""
    return f"goodput {100 * g.ratio:.1f}%{tail}"


__all__ = ["CAUSES", "Goodput", "StepTime", "describe", "goodput"]
