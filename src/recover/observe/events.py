"""Append-only JSON-lines logs (``metrics.jsonl``, ``events.jsonl``).

Contract: one JSON object per line, each with ``t`` (unix time, seconds) first; lines are written
whole and at once (one unbuffered write each), so a reader (the launcher, a plot, a test) never sees
half a record and a killed writer loses at most the record it was writing. Thread-safe.

Storage errors never reach the caller: a write the disk refuses (full, I/O error, read-only) keeps the
record in a bounded backlog (:data:`BACKLOG` records; beyond it the oldest not yet begun are dropped and
counted) that every later write tries again, in order, after one warning line on stderr; a record cut
short by a full disk is completed, never duplicated. A file that a killed writer left torn is closed
with a newline before the first new record. A file removed under its writer (the run directory deleted
while the job runs) is created again at its path with the next record. Records reach the storage
(``fsync``) at most :data:`SYNC_S` after they are written, and at ``close``: with the first record written
that long after the last ``fsync``, or, for a writer made with ``deferred_sync`` (the coordinator's, whose
loop must not wait for the disk in the middle of a failure round), at the first :meth:`JsonlWriter.sync_due`
that long after it (its owner calls it between two turns of its loop).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recover.names import Event

BACKLOG = 10_000
"""Records a writer keeps while its disk refuses them."""
SYNC_S = 1.0
"""A writer fsyncs its file with the first record written this long or more after its last fsync, and when
it closes: a power loss takes the records since (about the last second's of a busy writer); ``recover launch
--resume`` recovers the committed steps' records from the replicas' own logs, or names those lost."""


class JsonlWriter:
    """Appends JSON objects to ``path``, one per line (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], sync_s: float = SYNC_S, deferred_sync: bool = False) -> None:
        self.path = Path(path)
        self.sync_s = sync_s
        self._synced = time.monotonic()
        self._deferred = deferred_sync
        self._dirty = False  # written since the last fsync (a deferred writer's sync_due syncs it)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._backlog: deque[bytes] = deque([b"\n"] if _ends_torn(self.path) else [])
        self._sent = 0  # bytes of the backlog's first record already written
        self.dropped = 0
        """Records lost because the backlog was full."""
        self._failing: str | None = None  # why the disk refuses, while it does

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps({"t": round(time.time(), 6), **record}, separators=(",", ":")) + "\n"
        with self._lock:
            self._reopen_if_removed()
            if len(self._backlog) >= BACKLOG:
                del self._backlog[1 if self._sent else 0]  # the oldest not begun: a begun one is completed
                self.dropped += 1
            self._backlog.append(line.encode())
            self._drain()
        return record

    def _reopen_if_removed(self) -> None:
        """A file removed under the writer (its run directory deleted) is created again at its path, so
        the records go on where readers look, not into an unlinked file. One ``fstat`` per record."""
        try:
            if os.fstat(self._file.fileno()).st_nlink:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        except OSError:
            return  # the drain names what the storage refuses
        self._file.close()
        self._file, self._sent = fresh, 0  # a record begun in the removed file is written whole in the new one

    def _drain(self) -> None:
        while self._backlog:
            head = self._backlog[0]
            try:
                written = self._file.write(head[self._sent:]) or 0
                if not written:
                    raise OSError(0, "nothing written")
            except OSError as exc:
                if self._failing is None:
                    self._failing = exc.strerror or type(exc).__name__
                    print(f"recover: warning: cannot write {self.path} ({self._failing}); keeping up to "
                          f"{BACKLOG:,} records in memory and trying again with each new one", file=sys.stderr,
                          flush=True)
                return
            self._sent += written
            if self._sent < len(head):
                continue  # a short write: the rest of the record next
            self._backlog.popleft()
            self._sent = 0
        self._failing = None
        if self._deferred:
            self._dirty = True
        elif time.monotonic() - self._synced >= self.sync_s:
            self._sync()

    def sync_due(self) -> None:
        """A ``deferred_sync`` writer: fsyncs what was written since the last fsync, if that was ``sync_s`` or
        more ago (cheap when nothing was written)."""
        if not self._dirty or time.monotonic() - self._synced < self.sync_s:
            return
        with self._lock:
            self._dirty = False
            self._sync()

    def _sync(self) -> None:
        """Flushes what was written to the storage (a power loss keeps it)."""
        self._synced = time.monotonic()
        try:
            os.fsync(self._file.fileno())
        except OSError:
            pass  # a file system without fsync, or one failing: the next write says so

    def close(self) -> None:
        with self._lock:
            self._drain()
            if not self._backlog:
                self._sync()
            if self._backlog or self.dropped:
                print(f"recover: warning: {len(self._backlog) + self.dropped} record(s) could not be written to "
                      f"{self.path} ({self._failing or 'backlog full'})", file=sys.stderr, flush=True)
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` holds bytes after its last newline."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class EventLog(JsonlWriter):
    """``events.jsonl``: membership changes, failures, detections, recoveries, joins."""

    def event(self, kind: Event, **fields: Any) -> dict[str, Any]:
        """Appends a record of ``kind``, an :class:`~recover.names.Event` member (a plain string is refused:
        every kind written is one readers can name)."""
        if not isinstance(kind, Event):
            raise TypeError(f"event kind {kind!r} is not a recover.names.Event member")
        return self.write({"kind": kind, **fields})


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the complete records (JSON objects) of a JSONL file; a torn line (a killed writer's last, or
    the start of one a later writer ended) is skipped, as is any line that is not an object."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def records_before(path: str | os.PathLike[str], step: int) -> dict[int, dict[str, Any]]:
    """The step records of ``metrics.jsonl`` at ``path`` (if any) for steps before ``step``, by step,
    the first of each (a resumed run writes the steps from its checkpoint on again)."""
    path = Path(path)
    kept: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for rec in read_jsonl(path):
            if isinstance(rec.get("step"), int) and rec["step"] < step:
                kept.setdefault(rec["step"], rec)
    return kept


def keep_records_before(path: str | os.PathLike[str], step: int) -> None:
    """Rewrites ``metrics.jsonl`` at ``path`` (if any) with only :func:`records_before` ``step``."""
    path = Path(path)
    if not path.is_file():
        return
    kept = records_before(path, step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(kept[s], separators=(",", ":")) + "\n" for s in sorted(kept)), encoding="utf-8")
    os.replace(tmp, path)
