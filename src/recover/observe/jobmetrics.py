"""The job's metrics as the coordinator sees them: for Prometheus and the ``job`` TensorBoard run.

Contract: :meth:`JobMetrics.on_event` takes every record the coordinator logs (``events.jsonl``'s
kind and fields), in order, from the coordinator's loop thread; it only counts and appends (O(1)) and,
with a ``board``, writes the job's TensorBoard records: ``job/generation`` and ``job/members`` at each
new generation, ``job/step_s`` (commit to commit) at each commit, and each failure, leave and join as a
text entry under ``faults`` (TensorBoard's Text tab), at the step in progress.

Goodput (:mod:`recover.observe.goodput`) is computed from the coordinator's own records only: its commits
(with the members of their generation) and events, from the launch's start (``started``: the run's last
``launch`` event, the wall time ``recover status`` counts from too), else this coordinator's; checkpoint and
evaluation time, which only replicas log, count as ``other``. It costs O(steps) (2-4 s for 100,000
steps), so :meth:`goodput` keeps its value for 20 x its own cost (``min_age_s`` more while no step
commits) and is never computed in the loop thread: a reader (a scrape, :meth:`sample`) pays for it, at
most 5% of a core. A commit costs the loop thread ~3 us and 24 bytes kept. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import Counter
from typing import Any

from recover.names import Event
from recover.observe.goodput import goodput
from recover.observe.prometheus import Family
from recover.observe.tensorboard import EventFileWriter

_FAULTS = {Event.FAILURE_DETECTED: "failure", Event.LEAVE: "leave", Event.DIVERGENT: "divergent",
           Event.NONFINITE: "non-finite", Event.QUORUM_LOST: "quorum lost"}


class JobMetrics:
    """Tallies of one coordinator's events (see the module docstring)."""

    def __init__(self, board: EventFileWriter | None = None, min_age_s: float = 1.0,
                 started: float | None = None) -> None:
        self.board = board
        self.min_age_s = min_age_s
        self.started = time.time() if started is None else started
        """When the job's wall time starts: the launch's (its ``launch`` event), else this coordinator's start."""
        self.failures: Counter[str] = Counter()
        self.step_s: float | None = None
        """Seconds from the previous commit to the last (None before two commits)."""
        self._lock = threading.Lock()
        self._members = 0
        self._step = 0  # the step in progress
        self._commits = (array("q"), array("d"), array("q"))  # step, time, members: 24 bytes per commit
        self._events: list[dict[str, Any]] = [{"kind": Event.LAUNCH, "t": self.started}]
        self._cached: tuple[float, float, float, int] | None = None  # (computed at, its cost, ratio, commits)

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """One record the coordinator logged (its loop thread)."""
        now = time.time()
        with self._lock:
            if kind == Event.COMMIT:
                self._commit(fields, now)
                return
            self._events.append({"kind": kind, "t": now, **fields})
            if kind == Event.FAILURE_DETECTED:
                self.failures[str(fields.get("cause", "unknown"))] += 1
            elif kind == Event.GENERATION:
                self._members = len(fields.get("members", ()))
                if self.board is not None:
                    self.board.scalars(self._step, {"job/generation": fields["generation"],
                                                    "job/members": self._members}, now)
        if self.board is not None and (kind in _FAULTS or (kind == Event.GENERATION and fields.get("joined"))):
            self.board.text(self._step, "faults", _fault_line(kind, fields), now)

    def _commit(self, fields: dict[str, Any], now: float) -> None:
        steps, times, members = self._commits
        if times:
            self.step_s = now - times[-1]
        steps.append(fields["step"])
        times.append(now)
        members.append(self._members)
        self._step = fields["step"] + 1
        if self.board is not None and self.step_s is not None:
            self.board.scalars(fields["step"], {"job/step_s": self.step_s}, now)

    def goodput(self) -> float:
        """The goodput so far, from a copy of the records (see the module docstring for its cache)."""
        now = time.time()
        with self._lock:
            n, cached = len(self._commits[0]), self._cached
            if cached is not None and now < cached[0] + 20 * cached[1] + (self.min_age_s if n == cached[3] else 0):
                return cached[2]
            steps, times, members = (list(a) for a in self._commits)
            events = list(self._events)
        rows = [{"step": s, "t": t, "live_replicas": m} for s, t, m in zip(steps, times, members, strict=True)]
        events += [{"kind": Event.COMMIT, "t": t, "step": s} for s, t in zip(steps, times, strict=True)]
        ratio = goodput(rows, events, now=now).ratio
        with self._lock:
            self._cached = (now, time.time() - now, ratio, n)
        return ratio

    def sample(self) -> None:
        """Writes the goodput so far to the board (a reader's thread: :func:`sample_every`)."""
        if self.board is not None and self._commits[0]:
            self.board.scalars(self._step, {"job/goodput": self.goodput()})

    def families(self, snapshot: dict[str, Any]) -> list[Family]:
        """The Prometheus families of the coordinator's ``snapshot`` (generation, members, committed step,
        live replicas: :meth:`recover.coord.server.Coordinator.snapshot`) and of these tallies."""
        with self._lock:
            failures, step_s = dict(self.failures), self.step_s
        out = [Family("recover_generation", "The membership generation (grows at every membership change).",
                      "gauge", [({}, snapshot["generation"])]),
               Family("recover_members", "Replicas in the current generation.", "gauge",
                      [({}, len(snapshot["members"]))]),
               Family("recover_live_replicas", "Replicas registered and alive (members and joiners).", "gauge",
                      [({}, len(snapshot["live"]))]),
               Family("recover_committed_step", "The last committed step (-1: none yet).", "gauge",
                      [({}, snapshot["committed_step"])]),
               Family("recover_failures_total", "Replica failures detected since this coordinator started, "
                      "by cause.", "counter", [({"cause": c}, n) for c, n in sorted(failures.items())]),
               Family("recover_goodput", "Useful training time over wall time since this coordinator started "
                      "(0..1).", "gauge", [({}, self.goodput())])]
        if step_s is not None:
            out.append(Family("recover_step_seconds", "Seconds between the last two commits.", "gauge",
                              [({}, step_s)]))
        return out


def sample_every(metrics: JobMetrics, seconds: float) -> threading.Thread:
    """A daemon thread that calls ``metrics.sample()`` every ``seconds``."""
    def loop() -> None:
        while True:
            time.sleep(seconds)
            metrics.sample()

    thread = threading.Thread(target=loop, name="recover-job-metrics", daemon=True)
    thread.start()
    return thread


def _fault_line(kind: str, fields: dict[str, Any]) -> str:
    """``failure: replica 1 (hung), generation 3``."""
    what = _FAULTS.get(kind, "joined")
    who = fields.get("replica", fields.get("replicas", fields.get("joined", "")))
    cause = fields.get("cause")
    gen = fields.get("generation")
    return (f"{what}: replica {who}" + (f" ({cause})" if cause else "")
            + (f", generation {gen}" if gen is not None else ""))
