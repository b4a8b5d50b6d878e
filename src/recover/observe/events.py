"""Append-only JSON-lines logs (``metrics.jsonl``, ``events.jsonl``).

Contract: one JSON object per line, each with ``t`` (unix time, seconds) first; lines are written
whole and flushed at once, so a reader (the launcher, a plot, a test) never sees half a record
and a killed writer loses at most the record it was writing. Thread-safe.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonlWriter:
    """Appends JSON objects to ``path``, one per line, flushed after each write. A last line that a killed
    writer left torn (no newline) is closed first, so the first new record does not join it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if _ends_torn(self.path):
            self._file.write("\n")

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps({"t": round(time.time(), 6), **record}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
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

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self.write({"kind": kind, **fields})


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the complete records of a JSONL file; a torn last line (killed writer) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


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
