"""On GPUs: one replica on its GPU in bf16 with compiled blocks, two replicas sharing one GPU through a
kill, and layer 1 on NCCL through a kill (one GPU per replica).

Skipped, with the reason, where there are fewer GPUs than a test needs (CI has none); every run is
compared with its failure-free reference, as on the CPU. The CPU tiers cover everything else these
paths use (placement, bf16, the streamed reduction, compile with the aot_eager backend).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import NO_PLOTS, losses, run_recover
from recover.launch.placement import visible_gpus

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ONE_GPU = ["--gpus", visible_gpus()[0]] if GPUS and visible_gpus() else []
"""Both replicas on the first visible GPU: with --share-gpus they share it even where there are more."""
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; none is visible")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL allows one rank per device); {GPUS} visible")
STEPS, M = 16, 8


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def launch(out: Path, corpus: Path, *extra: str) -> list[dict]:
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "2", "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--data.path", str(corpus), "--deterministic", *extra], timeout=600)
    recs = rows(out)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    return recs


@one_gpu
def test_one_replica_trains_on_its_gpu_in_bf16_with_compiled_blocks(tmp_path: Path, corpus: Path) -> None:
    common = ["--config", "debug", "--no-progress", "--data.path", str(corpus), f"--training.steps={STEPS}"]
    run_recover(["train", "--out", str(tmp_path / "fp32"), *common], timeout=600)
    run_recover(["train", "--out", str(tmp_path / "bf16"), *common, "--training.dtype=bfloat16",
                 "--training.compile=true"], timeout=900)
    bf16 = rows(tmp_path / "bf16")
    assert all(r["gpu_mem_gb"] > 0 for r in bf16)  # it ran on the GPU
    ref = losses(tmp_path / "fp32")[STEPS - 1]
    assert abs(bf16[-1]["loss"] - ref) <= 0.03 * ref


@one_gpu
def test_two_replicas_sharing_one_gpu_keep_every_microbatch_through_a_kill(tmp_path: Path, corpus: Path) -> None:
    reference = launch(tmp_path / "ref", corpus, *ONE_GPU, "--share-gpus")
    killed = launch(tmp_path / "kill", corpus, *ONE_GPU, "--share-gpus", "--fail", "1@5:backward")
    assert killed[5]["live_replicas"] == 1
    assert [r["loss"] for r in killed] == [r["loss"] for r in reference]


@two_gpus
def test_nccl_cross_replica_groups_are_aborted_and_replaced_through_a_kill(tmp_path: Path, corpus: Path) -> None:
    reference = launch(tmp_path / "ref", corpus, "--gpus", "0,1")
    killed = launch(tmp_path / "kill", corpus, "--gpus", "0,1", "--fail", "1@5:reduce")
    assert killed[5]["live_replicas"] == 1
    assert [r["loss"] for r in killed] == [r["loss"] for r in reference]
