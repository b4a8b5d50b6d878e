"""`recover coordinator --lease DIR` (the recipes' run directory): one job per run directory, across restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import warmstart
from conftest import subprocess_env


def _coordinator(run: Path, token: Path) -> list[str]:
    return [sys.executable, "-m", "recover", "coordinator", "--port", "0", "--token-file", str(token),
            "--events", str(run / "events.jsonl"), "--lease", str(run)]


def test_a_second_coordinator_on_a_held_run_directory_is_refused_and_a_dead_ones_lease_is_taken_over(
        tmp_path: Path) -> None:
    run, token = tmp_path / "run", tmp_path / "token"
    token.write_text("t" * 32)
    first = warmstart.popen(_coordinator(run, token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env())
    try:
        assert first.stdout is not None and json.loads(first.stdout.readline())["ready"]
        assert json.loads((run / "lease.json").read_text())["pid"] == first.pid
        second = subprocess.run(_coordinator(run, token), capture_output=True, text=True, timeout=120,
                                env=subprocess_env())
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"belongs to a running job: recover coordinator (PID {first.pid} on " in lines[0]
        os.kill(first.pid, signal.SIGKILL)  # its lease stays behind
        first.wait(10)
        third = warmstart.popen(_coordinator(run, token), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=subprocess_env())
        try:
            assert third.stdout is not None and json.loads(third.stdout.readline())["ready"]
            assert json.loads((run / "lease.json").read_text())["pid"] == third.pid
            third.send_signal(signal.SIGTERM)  # no job: it exits at once, giving the lease up
            _, err = third.communicate(timeout=30)
            assert f"took over {run}'s lease from recover coordinator (PID {first.pid}" in err
            deadline = time.monotonic() + 10
            while (run / "lease.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not (run / "lease.json").exists()
        finally:
            third.kill()
            third.wait(10)
    finally:
        first.kill()
        first.wait(10)
