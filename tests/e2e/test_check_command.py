"""``recover check`` as an operator runs it: on this CPU machine it passes with the CPU path checked (a gloo
all-reduce of 2 processes, one microbatch's gradient reproduced in deterministic mode) and says there is no
GPU; when the all-reduce cannot work it exits 1 with one line naming what failed and what to check.
The rows' logic for GPUs is unit-tested in tests/unit/test_check.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from conftest import run_recover


def rows(path: Path) -> dict[str, dict]:
    return {r["check"]: r for r in json.loads(path.read_text())["rows"]}


def test_this_host_passes_and_a_machine_without_gpus_is_a_row_not_a_failure(tmp_path: Path) -> None:
    out = run_recover(["check", "--determinism", "--json", str(tmp_path / "check.json")], timeout=180)
    got = rows(tmp_path / "check.json")
    assert got["gloo all-reduce, 2 processes"]["status"] == "ok"
    assert got["determinism (1 microbatch, 2 runs)"]["status"] == "ok"  # same fingerprint, deterministic kernels on
    if not torch.cuda.is_available():
        assert got["GPUs"]["status"] == "info" and got["CPU matmul"]["result"].endswith("cores)")
    assert "recover check" in out.stdout and out.stderr.strip() == ""


def test_a_broken_all_reduce_fails_with_one_line_naming_it(tmp_path: Path) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "nosuchif0"  # gloo cannot open its device: the all-reduce fails
    try:
        out = run_recover(["check", "--json", str(tmp_path / "check.json")], timeout=180, check=False)
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]
    assert out.returncode == 1
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith("recover check: the gloo all-reduce of 2 processes on 127.0.0.1 "
                                                "failed") and "GLOO_SOCKET_IFNAME" in line
    assert rows(tmp_path / "check.json")["gloo all-reduce, 2 processes"]["status"] == "FAIL"
