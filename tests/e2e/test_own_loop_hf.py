"""Model code no one here wrote: Hugging Face causal LMs (Llama, and GPT-2 with its dropout) built from a config
with random weights, trained by a user loop on `recover.api` as the replicas of `recover launch -- python
SCRIPT`, through a crash, a hang and a corrupted replica: every step M microbatches, bitwise equal to the
failure-free run of the same script. Marked `interop` (transformers' import in every process makes each
launch ~30 s): `make test-interop` runs it, and CI runs that target too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import NO_PLOTS, ROOT, losses, run_recover

pytest.importorskip("transformers", reason="the export extra (transformers) is not installed")
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_hf.py"
STEPS, M = 8, 6  # the script's


def launch(out: Path, arch: str, *extra: str) -> list[dict]:
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "5", "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--deterministic", "--fault_tolerance.hang_timeout_s=3",
                 "--workload.policy=even",  # every replica computes in every step, so each fault lands in its step
                 *extra, "--",
                 sys.executable, str(SCRIPT), arch], timeout=400)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    return rows


@pytest.mark.interop
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_hugging_face_model_trains_bitwise_through_a_kill_a_hang_and_a_corruption(arch: str, tmp_path: Path) -> None:
    launch(tmp_path / "ref", arch)
    rows = launch(tmp_path / "run", arch, "--fail", "1@2:backward", "--hang", "2@3:forward", "--corrupt", "0@5")
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    assert [r["live_replicas"] for r in rows][-1] == 2
