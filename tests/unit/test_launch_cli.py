"""`recover launch` refuses a bad job up front: one line on stderr, exit 2, nothing created or started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover.cli import build_parser
from recover.errors import ConfigError
from recover.launch.cli import LaunchRequest, check_launch
from recover.launch.demo import demo_failures
from recover.names import Baseline, Phase

TP3_SWIGLU = ["--config", "debug", "--replicas", "1", "--procs-per-replica", "3", "--tp", "3",
              "--model.dim", "96", "--model.n_heads", "6", "--model.n_kv_heads", "6"]


def _launch(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "recover", "launch", *args, "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


@pytest.mark.parametrize(("args", "field", "says"), [
    (TP3_SWIGLU, "parallel.tp", "must divide the SwiGLU width 256"),
    (["--config", "debug", "--pp", "3"], "parallel.pp", "at most model.n_layers = 2"),
    (["--config", "debug", "--replicas", "3", "--training.global_microbatches", "2"],
     "training.global_microbatches", "at least parallel.replicas x parallel.fsdp = 3"),
    (["--config", "debug", "--parallel.backend", "mpi"], "parallel.backend", "one of 'auto', 'gloo', 'nccl'"),
    (["--config", "debug", "--procs-per-replica", "2"], "--procs-per-replica", "pp x tp x fsdp = 1 x 1 x 1 = 1"),
    (["--config", "debug", "--fail", "0@3:backwrd"], "phase 'backwrd'", "did you mean 'backward'"),
    (["--config", "debug", "--slow", "1@3:0.5"], "slow-down factor 0.5", "a number >= 1"),
    (["--config", "debug", "--random-failures", "5", "--random-faults", "kill,crash"], "--random-faults kill,crash",
     "some of kill, hang, freeze"),
])
def test_a_bad_launch_is_refused_in_one_line_before_anything_starts(
        tmp_path: Path, args: list[str], field: str, says: str) -> None:
    out = tmp_path / "run"
    proc, elapsed = _launch(args, out)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("recover: error: "), proc.stderr
    assert field in lines[0] and says in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert elapsed < 10, f"refused after {elapsed:.1f} s"
    assert not out.exists()  # no run directory, so no coordinator, no worker, no data


def test_a_malformed_command_line_is_one_line_too(tmp_path: Path) -> None:
    proc, _ = _launch(["--config", "debug", "--tp", "three"], tmp_path / "run")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["recover launch: error: argument --tp: invalid int value: 'three' "
                                        "(see recover launch --help)"]


def test_check_launch_has_no_side_effects(tmp_path: Path) -> None:
    out = tmp_path / "run"
    opts = check_launch(LaunchRequest(out=out, config="debug", replicas=2, failures=("1@3:reduce",),
                                      baseline=Baseline.SHRINK))
    assert opts.config.parallel.replicas == 2 and [str(s) for s in opts.failures] == ["1@3:reduce"]
    assert opts.baseline is Baseline.SHRINK and "--parallel.replicas=2" in opts.overrides
    with pytest.raises(ConfigError, match=r"needs periodic checkpoints"):
        check_launch(LaunchRequest(out=out, config="debug", baseline=Baseline.RESTART))
    with pytest.raises(ConfigError, match=r"--rejoin-replicas 5 is not allowed: replicas are 0\.\.1"):
        check_launch(LaunchRequest(out=out, config="debug", replicas=2, rejoin_after_s=1.0,
                                   rejoin_replicas=frozenset({5})))
    assert not out.exists()


def test_help_lists_every_phase_and_baseline_from_their_enums(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["launch", "--help"], ["worker", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(command)
        text = "".join(capsys.readouterr().out.split())  # undo the wrapping (it may break at a hyphen)
        for member in (*Phase, *Baseline):
            assert "".join(f"{member.value} ({member.help})".split()) in text, (command, member)


def test_demo_failures_scale_with_the_run() -> None:
    assert demo_failures(60) == ("1@12:backward", "3@30:reduce")
    assert demo_failures(6) == ("1@1:backward", "3@3:reduce")
