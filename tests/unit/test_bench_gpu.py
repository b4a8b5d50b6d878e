"""``recover bench gpu``'s pieces that need no GPU: the peak tables, the MFU note, the summary and ratios,
the kill-and-rejoin run's length and verdict, the refusal without a GPU, and the plain loop it compares
recover with (run here on the CPU for two steps)."""

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
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_flops("NVIDIA H100 NVL") == 835e12  # not the SXM part's 989 (F15)
    assert gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu.peak_flops("NVIDIA L40") == 181e12 and gpu.peak_flops("NVIDIA L40S") == 362e12
    assert gpu.peak_flops("CPU") is None


@pytest.mark.parametrize("table", [gpu.PEAK_BF16, gpu.PEAK_MEM_BW])
def test_every_entry_wins_over_the_shorter_keys_it_contains(table: gpu.Peaks) -> None:
    """The longest key contained in a name wins, whatever the order: each entry's own name gets its own
    value even where a family's key is a part of it (H100 in H100 NVL, H200 in GH200, L4 in L40S)."""
    for key, value in table:
        assert gpu.lookup_peak(table, f"NVIDIA {key} 96GB") == value, key


def test_bandwidth_peaks_leave_ambiguous_names_unknown() -> None:
    assert gpu.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu.peak_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert gpu.peak_bandwidth("NVIDIA GH200 480GB") is None  # HBM3 or HBM3e: the name does not say
    assert gpu.peak_bandwidth("NVIDIA A100-PG509-200") is None


def test_the_mfu_note_states_how_much_full_attention_overstates() -> None:
    from recover.config import load_config
    from recover.model import model_stats

    cfg = load_config("1b", [])
    flops = model_stats(cfg.model, cfg.data.seq_len).flops_per_token
    over = gpu.attention_overstatement(cfg.model.n_layers, cfg.model.dim, cfg.data.seq_len, flops)
    assert 0.04 < over < 0.06  # half of the attention term (~10% of the count) is not executed


def test_a_round_is_summarised_after_its_warmup() -> None:
    runs = [{"time_s": [9.0, 1.0, 1.2, 1.1], "peak_gb": 3.0}, {"time_s": [8.0, 1.4, 1.3, 1.5], "peak_gb": 3.5}]
    s = gpu.summarise(runs, warmup=1)
    assert s["per_round_s"] == [1.1, 1.4] and s["step_s"] == pytest.approx(1.25) and s["peak_gb"] == 3.5


def result(kill: dict | None = None) -> dict:
    runs = {"plain": [{"time_s": [5.0, 1.0, 1.0], "peak_gb": 10.0}],
            "train": [{"time_s": [5.0, 1.02, 1.02], "peak_gb": 11.0}],
            "launch": [{"time_s": [5.0, 1.05, 1.05], "peak_gb": 11.5, "startup_s": 8.0}]}
    entry = gpu.preset_entry(runs, tokens=65536, stats={"vocab_size": 128256, "flops_per_token": 8e9,
                                                        "mfu_overstates": 0.052}, warmup=1, peak=989e12)
    res = {"machine": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "peak_flops": 989e12},
           "load_before": [1.0], "load_after": [1.0], "steps": 3, "warmup": 1, "rounds": 1, "microbatches": 8,
           "dtype": "bfloat16", "compile": True, "presets": {"1b": entry}}
    return {**res, "kill": kill} if kill else res


def test_each_system_is_compared_with_the_plain_loop_and_mfu_says_what_it_counts() -> None:
    res = result()
    entry = res["presets"]["1b"]
    assert entry["train_over_plain"] == pytest.approx(1.02) and entry["launch_over_plain"] == pytest.approx(1.05)
    assert entry["systems"]["plain"]["mfu"] == pytest.approx(8e9 * 65536 / 989e12)
    columns, rows, notes = gpu.result_rows(res)
    assert [r[0] for r in rows] == ["1b plain", "1b train", "1b launch"] and columns[-1] == "/ plain"
    assert [r[-1] for r in rows] == ["-", "1.020", "1.050"]
    assert any("full attention" in n and "1b 5.2%" in n for n in notes)


def test_the_kill_run_lasts_long_enough_for_a_fresh_process_to_rejoin() -> None:
    assert gpu.rejoin_steps("cpu", 5.0, [3.0, 1.0], 0.1, 1) == gpu.CPU_REJOIN_STEPS  # a spare waits there
    # on a GPU: (start-up 10 s + compilation 4 s beyond a 1 s step) x 2 = 28 steps, + 5
    assert gpu.rejoin_steps("cuda", 10.0, [5.0, 1.0, 1.0], 1.0, 2) == 33
    assert gpu.rejoin_steps("cuda", 1e6, [1.0], 0.01, 1) == gpu.MAX_REJOIN_STEPS


def rows(live: list[int], mb: int = 8) -> list[dict]:
    return [{"step": i, "live_replicas": n, "microbatches": mb} for i, n in enumerate(live)]


@pytest.mark.parametrize(("records", "code", "problem"), [
    (rows([2, 2, 1, 2, 2]), 0, None),
    (rows([2, 2, 1, 1, 1]), 0, "had not rejoined by the last step: raise --rejoin-steps"),
    (rows([2, 2, 2, 2, 2]), 0, "no step ran on 1 replica"),
    (rows([2, 2, 1, 2, 2], mb=4), 0, "with [4] microbatches instead of 8"),
    (rows([2, 2, 1, 2]), 0, "4 of 5 steps committed"),
    (rows([2, 2, 1, 2, 2]), 1, "recover launch exited 1"),
])
def test_the_kill_run_passes_with_every_step_m_and_both_replicas_at_the_end(records: list[dict], code: int,
                                                                             problem: str | None) -> None:
    got = gpu.kill_verdict(records, code, steps=5, microbatches=8)
    assert got == problem if problem is None else problem in got


def test_the_rejoin_is_reported_next_to_the_table() -> None:
    kill = {"exit": 0, "kill_step": 10, "steps": 40, "expected_steps": 40, "rejoined_at": 17, "microbatches": [8],
            "live_min": 1, "live_after": 2, "ok": True, "problem": None}
    notes = gpu.result_rows(result(kill))[2]
    assert any("back at step 17" in n and "2 live replicas at the end" in n for n in notes)


def test_rejoin_steps_below_one_are_refused_in_one_line() -> None:
    args = argparse.Namespace(presets="debug", steps=4, warmup=1, rounds=1, microbatches=8, rejoin_steps=0)
    with pytest.raises(ConfigError, match="--rejoin-steps 0 is not allowed"):
        gpu.run_from_args(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the refusal is for machines without one")
def test_the_plain_loop_trains_and_reports_its_step_times(tmp_path: Path, corpus: Path) -> None:
    args = argparse.Namespace(steps=2, microbatches=2, dtype="float32", compile=False, overrides=[], device="cpu")
    result = tmp_path / "plain.json"
    extra = [*gpu.overrides(args, vocab_size=384), f"--data.path={corpus}"]  # kept though the data's is 257
    assert "--training.threads=1" in extra  # on the CPU every system gets one thread
    threads = torch.get_num_threads()
    try:
        assert gpu.plain_worker(argparse.Namespace(config="debug", result=str(result), overrides=extra)) == 0
    finally:  # the worker sets this process's threads and denormal flushing, as in its own process
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    out = json.loads(result.read_text())
    assert len(out["time_s"]) == 2 and all(t > 0 for t in out["time_s"]) and out["peak_gb"] is None
    assert out["vocab_size"] == 384  # the preset's shape is what is measured, not one shrunk to the data
