"""The run's step records: the replicas' own logs merged into ``metrics.jsonl`` by one rule.

Rank 0 of every replica appends one record per committed step to ``replicas/replica_R.jsonl``
(:func:`recover.train.processes.exits.replica_log_path`). ``recover launch`` (while its job runs and at its end)
and ``recover collect`` (after a job run across machines) both merge them with :class:`StepRecords`,
whose rule is the whole contract:

    Per step, the record of the job's latest commit of it is the step's record: the latest by the
    job's logical clock, ``(epoch, generation)``, never by a replica's wall clock (a replica whose clock
    steps an hour forward must not win); a tie goes to the higher ``replica``. Several replicas record
    the same commit, alike but for who wrote it and their own timings; a step recorded again after a
    restart from an older checkpoint was redone (in a later generation: a restore forms a new one), and
    its newer record is the one the run went on from. ``epoch`` counts, per replica log, the times its
    generations started again from 1 (a new coordinator: the checkpoint-and-restart baseline, a
    requeued job; :class:`LogEpochs`). A ``val_loss`` that the step's record lacks (only the
    replica that evaluated carries one) is taken, with its ``eval_s``, from the newest record of the
    step that has one. Anything else (an event, a line a killed writer tore, a record without an
    integer ``step`` and a ``loss``) is not a step record and is left out.

The rule does not depend on the order records are added in. The launcher stamps each record's ``t``
with its own monotonic clock (:meth:`StepRecords` then holds one clock), so ``metrics.jsonl``'s
``elapsed_s`` never jumps with a replica's clock: with the record's ``mono``, the time it was written on
the writer's monotonic clock, which on the launcher's host is the launcher's (:func:`stamp`), else when
the launcher read it (every 50 ms: too coarse to time a step). ``recover collect``, reading after the
fact, keeps the replicas' ``t``. A step nobody recorded is a gap: it is
absent from the merge (:meth:`StepRecords.committed` counts the steps before the first gap).
:class:`JsonlTail` reads the complete lines appended to a file since its last read, and
:func:`write_metrics` writes the merge as ``metrics.jsonl`` rows (``elapsed_s`` instead of ``t``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def is_step_record(rec: Any) -> bool:
    """A committed step's record: a JSON object with an integer ``step``, a ``loss`` and a time ``t``."""
    return (isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec
            and isinstance(rec.get("t"), (int, float)))


def _order(rec: Record) -> tuple[int, int, int]:
    generation = rec.get("generation")
    return rec.get("epoch", 0), generation if isinstance(generation, int) else 0, rec.get("replica", -1)


class LogEpochs:
    """The ``epoch`` of each record of the replicas' logs: per log, how many times its generations started
    again from a lower number (a new coordinator), read in file order."""

    def __init__(self) -> None:
        self._last: dict[Path, tuple[int, int]] = {}
        """path -> (the last generation read, its epoch)."""

    def mark(self, path: Path, records: Iterable[Any]) -> list[Any]:
        """``records`` (the next ones of ``path``, in file order), each step record given its ``epoch``."""
        out = []
        for rec in records:
            if is_step_record(rec) and isinstance(rec.get("generation"), int):
                last, epoch = self._last.get(path, (0, 0))
                epoch += rec["generation"] < last
                self._last[path] = (rec["generation"], epoch)
                rec = {**rec, "epoch": epoch}
            out.append(rec)
        return out


def read_step_logs(paths: Iterable[Path]) -> list[Any]:
    """Every record of the replicas' logs ``paths``, each step record with its ``epoch``."""
    from recover.observe.events import read_jsonl

    epochs = LogEpochs()
    return [rec for path in paths for rec in epochs.mark(path, read_jsonl(path))]


class StepRecords:
    """Per-step records merged by the module's rule, as records arrive (pure; no files)."""

    def __init__(self, records: Iterable[Any] = ()) -> None:
        self._newest: dict[int, Record] = {}
        """step -> the newest record of the step."""
        self._evaluated: dict[int, Record] = {}
        """step -> the newest record of the step that carries a ``val_loss``."""
        self.lost: set[int] = set()
        """Committed steps whose records are lost (:meth:`mark_lost`)."""
        for rec in records:
            self.add(rec)

    def add(self, rec: Any) -> bool:
        """Merges ``rec``; False (and nothing changes) when it is not a step record."""
        if not is_step_record(rec):
            return False
        step = rec["step"]
        if step not in self._newest or _order(rec) >= _order(self._newest[step]):
            self._newest[step] = rec
        if rec.get("val_loss") is not None and (
                step not in self._evaluated or _order(rec) >= _order(self._evaluated[step])):
            self._evaluated[step] = rec
        return True

    def mark_lost(self, steps: Iterable[int]) -> None:
        """Steps committed whose records are gone for good (a torn ``metrics.jsonl`` and no replica log
        holding them): they count as recorded for :meth:`committed` (the steps after them are not held
        back) but have no record."""
        self.lost.update(s for s in steps if s not in self._newest)

    def forget_from(self, step: int) -> list[int]:
        """Drops the records of ``step`` and later (they will be redone); returns the steps dropped."""
        gone = sorted(s for s in self._newest if s >= step)
        for s in gone:
            del self._newest[s]
            self._evaluated.pop(s, None)
        return gone

    def __contains__(self, step: object) -> bool:
        """Whether ``step`` is recorded, or known committed with its record lost."""
        return step in self._newest or step in self.lost

    def __len__(self) -> int:
        return len(self._newest)

    def steps(self) -> list[int]:
        return sorted(self._newest)

    def last_step(self) -> int:
        """The highest step recorded, -1 when none is."""
        return max(self._newest, default=-1)

    def committed(self) -> int:
        """How many steps from 0 on are recorded without a gap."""
        n = 0
        while n in self:
            n += 1
        return n

    def record(self, step: int) -> Record:
        """The merged record of ``step`` (a copy). Raises KeyError when nobody recorded it."""
        rec = dict(self._newest[step])
        val = self._evaluated.get(step)
        if rec.get("val_loss") is None and val is not None:
            rec["val_loss"] = val["val_loss"]
            if "eval_s" in val:
                rec["eval_s"] = val["eval_s"]
        return rec

    def merged(self) -> dict[int, Record]:
        """Every recorded step's merged record, by step."""
        return {step: self.record(step) for step in self.steps()}


def recover_rows(kept: dict[int, Record], replica_records: Iterable[Any],
                 before: int) -> tuple[dict[int, Record], list[int]]:
    """The ``metrics.jsonl`` rows of steps ``0 .. before - 1`` (the steps a resumed run keeps): ``kept`` (read
    from ``metrics.jsonl``), completed from the replicas' own records where it lacks a step (a torn last
    line, a power loss before the file reached the disk). Returns the rows by step and the steps that no
    record holds (lost for good). Pure."""
    rows = dict(kept)
    found = StepRecords(rec for rec in replica_records if is_step_record(rec) and rec["step"] < before)
    # the old run's start: a step in both says it exactly (elapsed_s = t - t0), else the first step's start
    both = [found.record(s)["t"] - rows[s]["elapsed_s"] for s in found.steps() if s in rows
            and isinstance(rows[s].get("elapsed_s"), (int, float))]
    firsts = [found.record(s)["t"] - found.record(s).get("time_s", 0.0) for s in found.steps()]
    t0 = both[0] if both else min(firsts, default=0.0)
    for step in found.steps():
        if step not in rows:
            rows[step] = metrics_row(found.record(step), t0)
    return rows, [s for s in range(before) if s not in rows]


def stamp(rec: Record, since: float, now: float) -> float:
    """When ``rec`` was written, on the monotonic clock of this process: its ``mono`` when that reads as this
    clock (between ``since``, this process's start, and ``now``: a record of this host written since), else
    ``now`` (another host's clock, an older run's record, or none)."""
    mono = rec.get("mono")
    return float(mono) if isinstance(mono, (int, float)) and since <= mono <= now else now


def metrics_row(rec: Record, t0: float) -> Record:
    """``rec`` as a ``metrics.jsonl`` row: its write time ``t`` becomes ``elapsed_s`` since ``t0``."""
    row = dict(rec)
    row.pop("epoch", None)
    row.pop("mono", None)
    row["elapsed_s"] = round(row.pop("t") - t0, 3)
    return row


def write_metrics(path: Path, records: StepRecords, t0: float) -> None:
    """Writes ``metrics.jsonl`` at ``path``: every recorded step's merged record, in step order. It replaces
    the file only once written whole: on a full disk the file as it was stays, with one warning line."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for step in records.steps():
                f.write(json.dumps(metrics_row(records.record(step), t0), separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"recover: warning: could not rewrite {path} ({exc.strerror or exc}); it keeps the records "
              "written as the steps committed", file=sys.stderr, flush=True)


class JsonlTail:
    """Follows append-only JSONL files: each :meth:`read` returns what was appended since the last."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        """path -> the byte offset read up to (the end of its last complete line)."""
        self.inodes: dict[Path, int] = {}
        """path -> the inode read: a file removed and created again (its run directory deleted) is read anew."""

    def read(self, path: Path) -> list[Record]:
        """The JSON objects on the complete lines appended to ``path`` since the last read; a torn last
        line waits for its end, and a line that is no JSON object (a torn line another writer appended
        to) is skipped."""
        start = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                if self.inodes.setdefault(path, ino) != ino:  # removed and created again: a new file
                    self.inodes[path], start = ino, 0
                f.seek(start)
                data = f.read()
        except OSError:  # not there (yet, or any more: its directory removed)
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[path] = start + end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out
