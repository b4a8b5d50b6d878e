"""The README's own-loop example under plain ``torchrun --nproc-per-node 2`` (the convention of every DDP user):
one replica of two ranks whose model is not sharded over ``rt.mesh``. recover makes it data parallel inside the
replica: the ranks compute different microbatches, their gradients are summed over the ranks, and the parameters
stay equal on both ranks and equal (within float32 rounding) to the example run as one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, subprocess_env
from recover.bench.common import STOP_GRACE_S, kill_group

WORKER = ROOT / "tests" / "dist" / "_workers" / "own_example.py"


def run(cmd: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([*cmd, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env(), cwd=ROOT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=180)
    finally:
        kill_group(proc, STOP_GRACE_S)
    assert proc.returncode == 0, text
    return subprocess.CompletedProcess(cmd, proc.returncode, text, "")


def test_plain_torchrun_of_the_example_is_data_parallel_inside_the_replica(tmp_path: Path) -> None:
    alone, ranks = tmp_path / "alone", tmp_path / "torchrun"
    alone.mkdir()
    ranks.mkdir()
    run([sys.executable, str(WORKER)], alone)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)], ranks)
    one = json.loads((alone / "rank_0.json").read_text())
    r0, r1 = (json.loads((ranks / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert r0["bits"] == r1["bits"], (r0, r1)  # the ranks' parameters are the same, bit for bit
    assert abs(r0["param_sum"] - one["param_sum"]) <= 1e-4 * abs(one["param_sum"]), (r0, one)
    assert abs(r0["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]), (r0, one)
