"""Every kind of ``events.jsonl`` is one :class:`recover.names.Event` member, and the JSON keeps plain names."""

from __future__ import annotations

import json
import re
import resource
import signal
from pathlib import Path

import pytest

from recover.names import Event
from recover.observe.events import EventLog, read_jsonl

SRC = Path(__file__).resolve().parents[2] / "src" / "recover"
READS = re.compile(r'(?:get\("kind"\)|\["kind"\])\s*(?:==|!=)\s*"([a-z_]+)"')


def test_writers_take_members_and_refuse_a_plain_string(tmp_path: Path) -> None:
    """Every writer of ``events.jsonl`` (the coordinator's ``Log`` actions, every ``EventLog``) binds its kind
    to the vocabulary: a spelled-out kind is a TypeError at the write, whatever the call looks like."""
    from recover.coord.actions import Log

    assert Log(Event.COMMIT, {}).kind is Event.COMMIT
    with pytest.raises(TypeError, match="'commit' is not a recover.names.Event member"):
        Log("commit", {})  # type: ignore[arg-type]
    with EventLog(tmp_path / "events.jsonl") as log:
        with pytest.raises(TypeError, match="'kill' is not a recover.names.Event member"):
            log.event("kill", replica=1)  # type: ignore[arg-type]
        log.event(Event.KILL, replica=1)
    assert [r["kind"] for r in read_jsonl(tmp_path / "events.jsonl")] == ["kill"]


def test_every_kind_read_by_name_is_a_member() -> None:
    named = {(path.relative_to(SRC).as_posix(), kind) for path in SRC.rglob("*.py")
             for kind in READS.findall(path.read_text())}
    assert {kind for _, kind in named} <= {e.value for e in Event}, sorted(named)


def test_the_readers_of_reports_and_goodput_match_members_not_literals() -> None:
    for module in ("launch/report.py", "observe/goodput.py", "observe/plots.py", "faults/registry.py"):
        assert not READS.findall((SRC / module).read_text()), module


def test_members_are_the_plain_names_in_json_both_ways(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events.jsonl") as log:
        log.event(Event.KILL, replica=1)
    line = (tmp_path / "events.jsonl").read_text()
    assert json.loads(line)["kind"] == "kill" and '"kind":"kill"' in line
    (record,) = read_jsonl(tmp_path / "events.jsonl")
    assert record["kind"] == Event.KILL and record["kind"] in {Event.KILL} and Event(record["kind"]) is Event.KILL


def test_a_writer_reopening_a_file_torn_by_a_killed_writer_keeps_every_new_record(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"t":1,"kind":"commit"}\n{"t":2,"kind":"comm')  # a writer died mid-line
    with EventLog(path) as log:
        log.event(Event.COMMIT, step=3)
    with EventLog(path) as log:  # a clean end is left as it is
        log.event(Event.COMMIT, step=4)
    assert [(r["kind"], r.get("step")) for r in read_jsonl(path)] == [("commit", None), ("commit", 3), ("commit", 4)]
    assert path.read_text().count("\n\n") == 0


def test_a_disk_that_refuses_writes_loses_no_record_and_raises_nothing(tmp_path: Path, capsys) -> None:
    """The file size limit makes the kernel refuse writes past it (EFBIG) as a full disk would, cutting
    one record short: the writer keeps the records, warns once, and completes them all once it can."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.event(Event.COMMIT, step=0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 20, hard))  # room for a part of one
    try:
        for step in range(1, 5):
            log.event(Event.COMMIT, step=step)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, sigxfsz)
    assert capsys.readouterr().err.count("cannot write") == 1
    log.event(Event.COMMIT, step=5)  # the disk takes writes again: the backlog goes out first, in order
    log.close()
    assert [r["step"] for r in read_jsonl(path)] == list(range(6))
    assert len(path.read_text().splitlines()) == 6  # the record cut short was completed, not repeated


def test_every_reader_of_a_run_skips_a_torn_last_line_even_one_cut_inside_a_character(tmp_path: Path) -> None:
    from recover.bench.gpu import read_rows
    from recover.observe.events import records_before
    from recover.observe.plots import load_events, load_metrics

    whole = ['{"step":0,"loss":2.5,"kind":"commit"}', '7', '{"step":1,"loss":2.25,"kind":"commit","note":"é"}']
    torn = '{"step":2,"loss":2.0,"kind":"commit","note":"é"}'.encode()[:-3]  # a killed writer, mid-"é"
    for name in ("metrics.jsonl", "events.jsonl"):
        (tmp_path / name).write_bytes("\n".join(whole).encode() + b"\n" + torn)
    assert [r["step"] for r in read_jsonl(tmp_path / "events.jsonl")] == [0, 1]  # the non-object line too
    assert [r["step"] for r in load_metrics(tmp_path)] == [r["step"] for r in read_rows(tmp_path)] == [0, 1]
    assert [r["step"] for r in load_events(tmp_path)] == [0, 1] and list(records_before(tmp_path / "metrics.jsonl",
                                                                                         5)) == [0, 1]


def test_a_file_removed_under_its_writer_is_created_again_and_records_are_synced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 41: with the run directory removed, every writer went on appending to unlinked files
    import os
    import shutil

    from recover.observe.events import JsonlWriter, read_jsonl

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "run" / "events.jsonl"
    writer = JsonlWriter(path, sync_s=0.0)
    writer.write({"kind": "a"})
    shutil.rmtree(tmp_path / "run")
    writer.write({"kind": "b"})
    writer.close()
    assert [r["kind"] for r in read_jsonl(path)] == ["b"] and len(synced) >= 3  # every record, and the close


def test_a_deferred_writer_syncs_between_its_owners_turns_not_inside_a_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's event log: a record written in a failure round must not wait for the disk before the
    round's notices go out; the loop syncs it between two turns (at most ``sync_s`` after the last fsync)."""
    import os

    from recover.observe.events import JsonlWriter, read_jsonl

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    writer = JsonlWriter(tmp_path / "events.jsonl", sync_s=0.0, deferred_sync=True)
    writer.sync_due()
    assert synced == []  # nothing written: nothing to sync
    writer.write({"kind": "a"})
    writer.write({"kind": "b"})
    assert synced == [] and [r["kind"] for r in read_jsonl(tmp_path / "events.jsonl")] == ["a", "b"]
    writer.sync_due()
    assert len(synced) == 1
    writer.sync_due()
    assert len(synced) == 1  # nothing written since
    late = JsonlWriter(tmp_path / "late.jsonl", sync_s=3600.0, deferred_sync=True)
    late.write({"kind": "c"})
    late.sync_due()
    assert len(synced) == 1  # not due: the last fsync (its opening) is less than sync_s ago
    late.close()
    writer.close()
    assert len(synced) >= 3  # and at close, as ever
