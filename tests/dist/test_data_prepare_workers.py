"""recover prepare across processes: a pool of workers writes the same shards as one, names a bad row the
same way, and a run killed with SIGKILL resumes from its complete shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover.data import prepare
from recover.data.prepare import prepare_files
from recover.errors import DataError
from text_corpus import NAMES, big_text, corpus, shard_files, write_jsonl

__all__ = ["corpus"]  # the fixture, shared with tests/unit/test_data_prepare.py


def test_output_is_the_same_for_any_number_of_workers(
    tmp_path: Path, corpus: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    (root / "big.txt").write_text(big_text(3000))  # ~110 kB: cut into pieces
    write_jsonl(root / "rows.jsonl", [{"text": f"row {i} " * (i % 7 + 1)} for i in range(400)])
    monkeypatch.setattr(prepare, "TASK_BYTES", 4096)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 20_000)
    pools = []
    real_pool_size = prepare._pool_size
    monkeypatch.setattr(prepare, "_pool_size", lambda *a: pools.append(real_pool_size(*a)) or pools[-1])
    one = prepare_files([root], tmp_path / "one", quiet=True, workers=1, shard_tokens=2000)
    prepare_files([root], tmp_path / "two", quiet=True, workers=2, shard_tokens=2000)
    assert pools == [1, 2] and len(one["train"]["shards"] + one["val"]["shards"]) > 20
    assert shard_files(tmp_path / "one") == shard_files(tmp_path / "two")
    assert one["train"]["documents"] + one["val"]["documents"] == len(NAMES) + 1 + 400

    # pieces of a text file are cut where the byte tokenizer gives the same ids as the whole file
    monkeypatch.setattr(prepare, "PIECE_BYTES", 1 << 30)
    whole = prepare_files([root], tmp_path / "whole", quiet=True, workers=1, shard_tokens=2000)
    assert whole["content_sha256"] != one["content_sha256"]  # other cuts were made...
    for name in one["train"]["shards"] + one["val"]["shards"]:  # ...with the same tokens
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_a_bad_row_met_in_a_worker_process_is_named_as_in_this_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    single = tmp_path / "one.jsonl"
    monkeypatch.setattr(prepare, "TASK_BYTES", 64)
    write_jsonl(single, [{"body": f"document {j}"} for j in range(40)] + [{"body": None}])
    with pytest.raises(DataError, match=r"one\.jsonl, line 41: field 'body' is null, not a string"):
        prepare_files([single], tmp_path / "single", quiet=True, field="body", workers=2)


KILLED_RUN = """
import sys, time
from pathlib import Path
import recover.data.writers as writers
from recover.data.prepare import prepare_files

write_shard = writers.write_shard
def slow_write_shard(*args, **kwargs):  # a slow disk: the run is killed while it writes
    time.sleep(0.05)
    return write_shard(*args, **kwargs)
writers.write_shard = slow_write_shard
if __name__ == "__main__":
    prepare_files([Path(sys.argv[1])], sys.argv[2], quiet=True, workers=1, shard_tokens=500)
"""


def test_resume_after_kill_9(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    root, _ = corpus
    (root / "big.txt").write_text(big_text(600))
    out, script = tmp_path / "out", tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    src = str(Path(prepare.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(out)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if len(json.loads((out / prepare.JOURNAL_NAME).read_text())["shards"]["train"]) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (out / "meta.json").exists()
    meta = prepare_files([root], out, quiet=True, workers=1, shard_tokens=500)
    prepare_files([root], tmp_path / "clean", quiet=True, workers=1, shard_tokens=500)
    assert meta["resumed_shards"] >= 3
    assert shard_files(out) == shard_files(tmp_path / "clean")
