"""End to end: one job per run directory, and what operators and machines do around a running job.

- a second `recover launch` on a live run directory (with --resume, with --overwrite, with neither) is
  refused in one line naming the holder and writes nothing: the first job's files end as a lone run's;
- a launcher SIGKILLed (its lease left behind) is followed by a --resume that takes the lease over and
  finishes bitwise (a requeued job starting after the old one died);
- SIGHUP to the launcher (its terminal hung up) is a graceful stop: a checkpoint, status 6, the --resume
  line; the --resume finishes bitwise.

Every run is 3 replicas of the `debug` preset, deterministic, compared with the failure-free run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warmstart
from conftest import NO_PLOTS, losses, run_recover, subprocess_env

STEPS = 16
M = 8
BASE = ("--config", "debug", "--replicas", "3", "--steps", str(STEPS), "--no-progress", "--deterministic",
        "--training.eval_every=0")


def _args(run: Path, corpus: Path, *extra: str) -> list[str]:
    return ["launch", NO_PLOTS, *BASE, "--out", str(run), "--data.path", str(corpus), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("ownership-ref")
    run_recover(_args(out, corpus), timeout=300)
    return out


def _start(run: Path, corpus: Path, *extra: str) -> subprocess.Popen[bytes]:
    return warmstart.popen([sys.executable, "-m", "recover", *_args(run, corpus, "--device-time-s", "0.1", *extra)],
                            env=subprocess_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _await_step(run: Path, step: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(f'"step":{step},' in p.read_text() for p in (run / "replicas").glob("replica_*.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None, f"step {step} never came"
        time.sleep(0.05)


def _processes_of(run: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"{run} " in cmdline + " " and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def _reap(run: Path, proc: subprocess.Popen[bytes]) -> None:
    for pid in [proc.pid, *_processes_of(run)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _bitwise(run: Path, reference: Path) -> None:
    recs = _rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    assert losses(run) == losses(reference)


def _files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and "checkpoints" not in p.parts}


def test_a_second_launch_on_a_live_run_directory_is_refused_naming_the_holder_and_writes_nothing(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _start(run, corpus)
    try:
        _await_step(run, 3, proc)
        config = (run / "config.json").read_bytes()
        status = run_recover(["status", str(run), "--json"])
        holder = json.loads(status.stdout)["holder"]
        assert holder["pid"] == proc.pid and holder["command"] == "recover launch" and holder["gone"] is None
        for flags in (["--resume"], ["--overwrite"], []):
            second = run_recover(_args(run, corpus, *flags), check=False, timeout=60)
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            assert f"PID {proc.pid}" in lines[0] and "belongs to a running job" in lines[0]
            assert "--resume" not in lines[0] and "--overwrite" not in lines[0]  # no destructive advice
            assert (run / "config.json").read_bytes() == config
        assert proc.poll() is None
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        _reap(run, proc)
    _bitwise(run, reference)
    assert json.loads((run / "summary.json").read_text())["committed_steps"] == STEPS
    assert _files(run) == _files(reference)  # the lease is gone with its holder; nothing else differs
    assert not (run / "lease.json").exists()


def test_a_sigkilled_launchers_lease_is_taken_over_by_resume_which_finishes_bitwise(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _start(run, corpus, "--training.checkpoint_every=4")
    try:
        _await_step(run, 9, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while _processes_of(run) and time.monotonic() < deadline:  # the lifeline ends its children
            time.sleep(0.1)
        assert _processes_of(run) == []
    finally:
        _reap(run, proc)
    assert json.loads((run / "lease.json").read_text())["pid"] == proc.pid  # left behind by the SIGKILL
    resumed = run_recover(_args(run, corpus, "--resume"), timeout=300)
    assert f"took over --out's lease from recover launch (PID {proc.pid}" in resumed.stderr
    assert "runs no more" in resumed.stderr
    _bitwise(run, reference)
    assert not (run / "lease.json").exists()


def test_sighup_to_the_launcher_is_a_graceful_stop_and_resume_finishes_bitwise(
        reference: Path, corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _start(run, corpus)
    try:
        _await_step(run, 5, proc)
        os.kill(proc.pid, signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 6, err.decode()[-3000:]
        assert "continue with the same command and --resume" in err.decode().strip().splitlines()[-1]
    finally:
        _reap(run, proc)
    stopped_at = len(_rows(run))
    assert 5 < stopped_at < STEPS and (run / "checkpoints" / f"step_{stopped_at:06d}").is_dir()
    ev = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["signal"] for e in ev if e["kind"] == "stop_requested" and e.get("source") == "launcher"] == ["SIGHUP"]
    run_recover(_args(run, corpus, "--resume"), timeout=300)
    _bitwise(run, reference)
