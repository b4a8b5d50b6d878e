"""Trainer end to end: data-parallel equivalence under torchrun, resume, and clear errors on bad input.

These run real `recover train` processes (gloo on 127.0.0.1) and compare per-step losses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import losses, max_rel_diff, run_recover, subprocess_env
from recover.bench.common import STOP_GRACE_S, kill_group
from recover.cli import main
from recover.data import write_shard

STEPS = 20


def train_args(out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(corpus),
            f"--training.steps={STEPS}", "--training.eval_every=10", "--training.threads=1", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """1 process x M microbatches (run in this process): the run every other layout must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    assert main(train_args(out, corpus)) == 0
    return out


@pytest.mark.parametrize(("nproc", "assignment"), [(2, "blocks"), (4, "shuffled")])
def test_data_parallel_matches_single_process(reference: Path, corpus: Path, tmp_path: Path, nproc: int,
                                              assignment: str) -> None:
    run_recover(train_args(tmp_path, corpus, f"--parallel.replicas={nproc}", f"--training.assignment={assignment}"),
                nproc=nproc)
    ref, run = losses(reference), losses(tmp_path)
    assert len(run) == STEPS
    assert max_rel_diff(ref, run) <= 1e-6
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["microbatches"] == 8 and r["live_replicas"] == nproc for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["final_val_loss"] > 0


def test_sigterm_under_torchrun_saves_at_a_step_boundary_and_resume_reproduces_the_rest(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    """SIGTERM to the torchrun agent (it passes it on to both ranks, as Slurm signals every process):
    the ranks agree to stop after the same step, save a complete checkpoint and exit 6; two fresh
    processes resume from it and reproduce the uninterrupted run's remaining steps."""
    args = train_args(tmp_path, corpus)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "recover",
           *args, "--training.device_time_s=0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").is_file() or len(losses(tmp_path)) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc, STOP_GRACE_S)
    stopped = len(losses(tmp_path))
    assert 4 <= stopped < STEPS and sorted(losses(tmp_path)) == list(range(stopped))
    assert (tmp_path / "checkpoints" / f"step_{stopped:06d}" / "COMMITTED").is_file()
    assert f"stopped on request after {stopped} steps" in out  # rank 0, just before its exit status 6
    out = run_recover([*args, "--resume"], nproc=2).stdout  # resumed by 2 fresh processes
    assert "resumed from" in out and f"(step {stopped})" in out
    resumed, ref = losses(tmp_path), losses(reference)
    assert sorted(resumed) == list(range(STEPS))
    assert max_rel_diff({s: ref[s] for s in range(stopped, STEPS)}, {s: resumed[s] for s in range(stopped, STEPS)}) \
        <= 1e-6


def in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Runs `recover ARGS` in this process (error paths need no fresh interpreter)."""
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_named_and_resume_falls_back_to_the_previous_intact_one(
        reference: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    """4 bytes flipped inside the tensor data of the newest checkpoint's largest file, or one of its
    files cut short: one line names the checkpoint and the file, the previous checkpoint is loaded, and
    the resumed run reproduces the uninterrupted run exactly (the damaged state never loaded). A save
    killed halfway leaves a ``.partial`` directory that the next start removes; keep_checkpoints holds. Saves are
    synchronous here: an asynchronous one still writing when the next is due makes that one skipped, by design,
    which a loaded machine did (step 10's, after step 5's)."""
    args = train_args(tmp_path, corpus, "--training.checkpoint_every=5", "--training.keep_checkpoints=2",
                      "--training.checkpoint_async=false")
    assert in_process([*args, "--stop-at-step", "15"], capsys)[0] == 0
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in sorted(ckpts.iterdir())] == ["step_000010", "step_000015"]  # step 5 pruned
    code, _, err = in_process(args, capsys)  # neither --resume nor --overwrite: refused, nothing touched
    assert code == 2 and "holds another run" in err and len(losses(tmp_path)) == 15
    shutil.copytree(ckpts / "step_000015", ckpts / "step_000020.partial")  # a save killed halfway
    files = sorted((p for p in (ckpts / "step_000015").iterdir() if p.suffix in (".distcp", ".metadata")),
                   key=lambda p: p.stat().st_size)
    victim = files[-1] if damage == "flip" else files[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        middle = len(data) // 2
        data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    code, out, err = in_process([*args, "--resume"], capsys)
    assert code == 0 and "(step 10)" in out
    damaged = [line for line in err.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and "step_000015" in damaged[0] and victim.name in damaged[0], err
    assert not list(ckpts.glob("*.partial"))
    assert losses(tmp_path) == losses(reference)  # steps 10..19 recomputed from the intact state: exactly
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS))  # each step once


def test_resume_refuses_a_checkpoint_of_another_model(corpus: Path, tmp_path: Path, capsys) -> None:
    assert in_process([*train_args(tmp_path, corpus, "--training.checkpoint_every=5"), "--stop-at-step", "5"],
                      capsys)[0] == 0
    code, _, err = in_process([*train_args(tmp_path, corpus, "--model.dim=32"), "--resume"], capsys)
    assert code == 2
    assert "was written for another model (model.dim: checkpoint 64, this run 32" in err


def test_resume_without_checkpoint_says_so(corpus: Path, tmp_path: Path, capsys) -> None:
    code, _, err = in_process([*train_args(tmp_path, corpus), "--resume"], capsys)
    assert code == 2 and "no complete checkpoint under" in err


def test_token_id_beyond_the_vocabulary_is_a_clear_error(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, 300, 50_000))
    write_shard(data / "val_000000.bin", rng.integers(0, 300, 5_000))
    code, _, err = in_process(["train", "--config", "debug", "--out", str(tmp_path / "run"), "--data.path", str(data),
                               "--model.vocab_size=256"], capsys)
    assert code == 2
    assert "train_000000.bin" in err and "256" in err


def test_missing_data_directory_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code, _, err = in_process(["train", "--config", "debug", "--out", str(tmp_path), "--data.path",
                               str(tmp_path / "nope")], capsys)
    assert code == 2
    assert "is not a directory; prepare one with `recover prepare" in err


def test_bfloat16_compute_trains_like_float32(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """training.dtype = bfloat16 (autocast; float32 master weights, optimizer and accumulation): 40 steps
    of the debug preset end within 3% of float32's final loss."""
    final = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert main(train_args(out, corpus, "--training.steps=40", f"--training.dtype={dtype}")) == 0
        final[dtype] = losses(out)[39]
    capsys.readouterr()
    assert final["bfloat16"] != final["float32"]  # bf16 really computed: not float32's arithmetic
    assert abs(final["bfloat16"] - final["float32"]) <= 0.03 * final["float32"]
