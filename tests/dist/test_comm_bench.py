"""`recover bench collectives` runs end to end (tiny sizes; the numbers themselves are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warmstart

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_collectives_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "bench.json"
    r = warmstart.run([sys.executable, "-m", "recover", "bench", "collectives", "--kills", "1", "--replicas", "2",
                        "--floats", "1000", "--kill-floats", "1000", "--iters", "2", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=180, start_new_session=True)
    assert r.returncode == 0, r.stderr
    assert "kill -> new group ready" in r.stdout and "overhead" in r.stdout
    res = json.loads(out.read_text())
    assert res["kills"] == 1 and set(res["kill_to"]) == {"detect", "notice", "raise", "ready"}
    assert 0 < res["kill_to"]["ready"]["median_ms"] < 30_000 and res["overhead"]["ratio_median"] > 0
