"""A save the storage refused is abandoned (recover.train.checkpoint.abandon): what it left goes, the rest stays."""

from __future__ import annotations

import errno
from pathlib import Path

from recover.train.checkpoint import abandon


def test_abandon_removes_every_partial_keeps_complete_and_set_aside_ones_and_names_the_cause(tmp_path: Path) -> None:
    for name in ("step_000002", "step_000002.replaced", "step_000004.partial", "step_000006.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x" * 10)
    line = abandon(tmp_path, 6, OSError(errno.ENOSPC, "No space left on device"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000002.replaced"]
    assert line.startswith(f"checkpoint of step 6 abandoned: could not write {tmp_path / 'step_000006'} (")
    assert "MiB free; OSError: [Errno 28] No space left on device" in line and "\n" not in line
