"""Processes the benchmarks and the launcher start: a child past its time is interrupted before it is killed,
a terminated benchmark takes its child with it, a GPU is described by a child process, and GPUs are found
through ``nvidia-smi``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover.bench import gpu
from recover.bench.common import run_child
from recover.errors import ConfigError


def test_a_timed_out_child_gets_sigint_before_sigkill(tmp_path: Path) -> None:
    # a launcher stops the processes it started in its `finally`: SIGINT lets it run
    flag = tmp_path / "cleaned-up"
    script = (f"import pathlib, time\nprint('up', flush=True)\ntry:\n    time.sleep(60)\n"
              f"finally:\n    pathlib.Path({str(flag)!r}).write_text('x')\n")
    log = tmp_path / "child.log"
    assert run_child([sys.executable, "-c", script], log, timeout_s=1.5) == 124
    assert flag.read_text() == "x" and "up" in log.read_text()


def test_a_terminated_benchmark_takes_its_running_child_with_it(tmp_path: Path) -> None:
    """SIGTERM to a benchmark while run_child waits: the child's process group goes too (it was
    orphaned, still training, before)."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = (f"from pathlib import Path; from recover.bench.common import run_child; "
              f"run_child([{sys.executable!r}, '-c', {child!r}], Path({str(tmp_path / 'log')!r}), 60)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(grandchild, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(grandchild, signal.SIGKILL)
            raise AssertionError("the benchmark's child outlived it")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_gpu_without_a_gpu_refuses_in_one_line_and_names_the_cpu_smoke_test() -> None:
    with pytest.raises(ConfigError, match="--device cpu"):
        gpu.device_info("cuda")


def test_gpus_are_found_by_nvidia_smi_when_the_driver_shows_no_proc_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers often show neither CUDA_VISIBLE_DEVICES nor /proc/driver/nvidia while CUDA works."""
    from recover.launch import placement

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)'\n"
                   "echo '  MIG 1g.10gb Device 0: (UUID: MIG-b)'\necho 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-c)'\n")
    smi.chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(placement, "NVIDIA_PROC", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert placement.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert placement.visible_gpus() == []
