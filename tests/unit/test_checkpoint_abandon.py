"""A save the storage refused is abandoned (recover.train.checkpoints.checkpoint.abandon): what it left goes, the
rest stays. A periodic one lets training go on; one the job ends with leaves the loop ``unsaved`` (exit status 12)."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from recover.config import load_config
from recover.names import Event
from recover.recovery.protocol import Progress
from recover.train.checkpoints.cadence import Cadence
from recover.train.checkpoints.checkpoint import MARKER, UNSAVED, UNSAVED_NONE, abandon
from recover.train.processes import exits
from recover.train.processes.loop import Loop


def test_abandon_removes_every_partial_keeps_complete_and_set_aside_ones_and_names_the_cause(tmp_path: Path) -> None:
    for name in ("step_000002", "step_000002.replaced", "step_000004.partial", "step_000006.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x" * 10)
    line = abandon(tmp_path, 6, OSError(errno.ENOSPC, "No space left on device"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000002.replaced"]
    assert line.startswith(f"checkpoint of step 6 abandoned: could not write {tmp_path / 'step_000006'} (")
    assert "MiB free; OSError: [Errno 28] No space left on device" in line and "\n" not in line


def test_a_full_disk_behind_torchs_zip_writer_is_named_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 41: the warning showed torch's "unexpected pos 704 vs 598" instead of ENOSPC
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 4096))
    line = abandon(tmp_path, 4, RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598"))
    assert ("(0.0 MiB free; ENOSPC: no space left on device (torch's writer said RuntimeError: [enforce fail at "
            "inline_container.cc:664] . unexpected pos 704 vs 598)); training goes on") in line
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 0, 10 << 30))
    line = abandon(tmp_path, 4, RuntimeError("file write failed"))  # room left: not a full disk, said as it came
    assert "MiB free; RuntimeError: file write failed); training goes on" in line and "ENOSPC" not in line


class FullDisk:
    """A checkpointer whose writes fail as on a full disk; an asynchronous save in flight fails too when asked."""

    def __init__(self, root: Path, pending_fails: bool = False) -> None:
        self.root, self.pending_fails, self.last_blocking_s = root, pending_fails, 0.0
        self.epoch_of = lambda step: 0

    def wait(self) -> None:
        if self.pending_fails:
            self.pending_fails = False
            raise OSError(errno.ENOSPC, "No space left on device")

    def save(self, step: int, data_step: int, total_tokens: int, blocking: bool | None = None) -> Path:
        (self.root / f"step_{step:06d}.partial").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")


def loop_over(checkpointer: FullDisk) -> tuple[Loop, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    loop = Loop(load_config("debug"), SimpleNamespace(progress=Progress(step=6, data_step=6, tokens=60)),  # type: ignore[arg-type]
                None, None, checkpointer, lambda record: None,  # type: ignore[arg-type]
                on_event=lambda kind, **fields: events.append((kind, fields)))
    return loop, events


def test_a_final_save_the_disk_refuses_is_one_line_and_unsaved_older_checkpoints_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / MARKER).write_text("4")  # a complete older checkpoint
    loop, events = loop_over(FullDisk(tmp_path, pending_fails=True))  # a periodic async save failed meanwhile
    assert loop.save_last() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]
    assert loop.unsaved is not None and "\n" not in loop.unsaved
    assert loop.unsaved.startswith(f"checkpoint of step 6 abandoned: could not write {tmp_path / 'step_000006'} (")
    assert loop.unsaved.endswith("); " + UNSAVED) and "MiB free; OSError: [Errno 28] No space left" in loop.unsaved
    assert [kind for kind, _ in events] == [Event.CHECKPOINT_ABANDONED, Event.CHECKPOINT_UNSAVED]
    assert events[1][1] == {"step": 6, "message": loop.unsaved}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("recover: warning: ") and err[1] == f"recover: error: {loop.unsaved}"


def test_an_unsaved_end_with_no_complete_checkpoint_says_there_is_none_to_resume_from(tmp_path: Path) -> None:
    (tmp_path / "step_000004").mkdir()  # never completed: no marker
    loop, _ = loop_over(FullDisk(tmp_path))
    assert loop.save_last() is None and loop.unsaved is not None
    assert loop.unsaved.endswith("); " + UNSAVED_NONE) and "older checkpoints are kept" not in loop.unsaved


def test_a_periodic_save_the_disk_refuses_goes_on_and_still_counts_for_the_cadence(tmp_path: Path) -> None:
    loop, events = loop_over(FullDisk(tmp_path))
    loop.cadence = Cadence("auto", prior_mtbf_s=100.0)
    assert loop.save_or_abandon() is None and loop.unsaved is None
    assert [kind for kind, _ in events] == [Event.CHECKPOINT_ABANDONED] and not list(tmp_path.iterdir())
    assert loop.cadence.saved_at == 6 and len(loop.cadence.save_costs) == 1  # not tried again at the next step


def test_an_unsaved_end_has_its_own_exit_status_before_any_other() -> None:
    from recover.launch.launcher import EXIT_ORDER

    statuses = [v for k, v in vars(exits).items() if k.startswith("EXIT_")]
    assert len(set(statuses)) == len(statuses) and exits.EXIT_UNSAVED not in (0, 1, 2)
    assert EXIT_ORDER[0] == exits.EXIT_UNSAVED  # a quorum lost and not saved reads as not saved


def test_the_state_a_cut_off_replica_kept_is_put_in_place_only_when_newest(tmp_path: Path) -> None:
    """Every replica cut off from the coordinator: the lowest kept the committed state under checkpoints/cut_off/;
    the launcher makes it the newest checkpoint (for --resume) when it is newer than every complete one there."""
    from recover.launch.launcher import rescue
    from recover.train.checkpoints.integrity import MARKER, list_checkpoints

    root = tmp_path / "checkpoints"

    def complete(path: Path) -> Path:
        path.mkdir(parents=True)
        (path / MARKER).write_text("ok")
        return path

    assert rescue(root) is None  # nothing kept: nothing to do
    complete(root / "step_000004")
    complete(root / "cut_off" / "replica_0" / "step_000006")
    (root / "cut_off" / "replica_1" / "step_000007.partial").mkdir(parents=True)  # never completed: not taken
    placed = rescue(root)
    assert placed == root / "step_000006" and [s for s, _ in list_checkpoints(root)] == [4, 6]
    assert not (root / "cut_off").exists()
    complete(root / "cut_off" / "replica_0" / "step_000005")  # older than the newest complete: left alone
    assert rescue(root) is None and [s for s, _ in list_checkpoints(root)] == [4, 6]
