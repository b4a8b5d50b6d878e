"""``recover bench gpu``'s pieces that need no GPU: the peak table, the summary, the refusal without a
GPU, and the plain loop it compares recover with (run here on the CPU for two steps)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from recover.bench import gpu
from recover.errors import ConfigError


def test_peaks_are_looked_up_by_device_name() -> None:
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12  # the PCIe card before the generic H100 entry
    assert gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu.peak_flops("CPU") is None


def test_a_round_is_summarised_after_its_warmup() -> None:
    runs = [{"time_s": [9.0, 1.0, 1.2, 1.1], "peak_gb": 3.0}, {"time_s": [8.0, 1.4, 1.3, 1.5], "peak_gb": 3.5}]
    s = gpu.summarise(runs, warmup=1)
    assert s["per_round_s"] == [1.1, 1.4] and s["step_s"] == pytest.approx(1.25) and s["peak_gb"] == 3.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the refusal is for machines without one")
def test_without_a_gpu_it_refuses_in_one_line_and_names_the_cpu_smoke_test() -> None:
    with pytest.raises(ConfigError, match="--device cpu"):
        gpu.device_info("cuda")


def test_the_plain_loop_trains_and_reports_its_step_times(tmp_path: Path, corpus: Path) -> None:
    args = argparse.Namespace(steps=2, microbatches=2, dtype="float32", compile=False, overrides=[])
    result = tmp_path / "plain.json"
    extra = [*gpu.overrides(args, vocab_size=384), f"--data.path={corpus}"]  # kept though the data's is 257
    threads = torch.get_num_threads()
    try:
        assert gpu.plain_worker(argparse.Namespace(config="debug", result=str(result), overrides=extra)) == 0
    finally:  # the worker sets this process's threads and denormal flushing, as in its own process
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    out = json.loads(result.read_text())
    assert len(out["time_s"]) == 2 and all(t > 0 for t in out["time_s"]) and out["peak_gb"] is None
    assert out["vocab_size"] == 384  # the preset's shape is what is measured, not one shrunk to the data
