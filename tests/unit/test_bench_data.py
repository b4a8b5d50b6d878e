"""``recover bench data``'s pieces: sparse datasets that open as real ones, and the probe a run times."""

from __future__ import annotations

import json
from pathlib import Path

from recover.bench import data as bench
from recover.config import DataConfig
from recover.data.sampler import open_samplers


def test_a_sparse_dataset_opens_like_a_prepared_one_and_takes_no_disk(tmp_path: Path) -> None:
    root = bench.make_dataset(tmp_path / "d", 30_000_000, 10_000_000)
    names = sorted(p.name for p in root.glob("*.bin"))
    assert names == ["train_000000.bin", "train_000001.bin", "train_000002.bin", "val_000000.bin"]
    used = sum(p.stat().st_blocks * 512 for p in root.glob("*.bin"))
    assert used < 1_000_000  # 62 MB of tokens are holes
    meta = json.loads((root / "meta.json").read_text())
    assert meta["max_id"] == 0 and meta["vocab_size"] == bench.GPT2_VOCAB
    inode = (root / "train_000000.bin").stat().st_ino
    assert bench.make_dataset(root, 30_000_000, 10_000_000) == root  # complete: reused, not rewritten
    assert (root / "train_000000.bin").stat().st_ino == inode
    sampler, val = open_samplers(DataConfig(path=str(root), seq_len=1024, microbatch_size=8), root,
                                 bench.GPT2_VOCAB, 8, seed=0)
    assert sampler.num_tokens == 30_000_000 and val.num_windows == (bench.VAL_TOKENS - 1) // 1024
    x, y = sampler.microbatch(10, 3)
    assert x.shape == (8, 1024) and int(x.max()) == 0
    bench.evict(root)  # no error on any file


def test_the_probe_reports_startup_memory_and_cost(tmp_path: Path) -> None:
    root = bench.make_dataset(tmp_path / "d", 2_000_000, 1_000_000)
    res = bench.probe(str(root), 256, 4, 8, samples=16, t_spawn=0.0)
    assert res["windows"] == 2 * ((1_000_000 - 1) // 256)
    assert res["open_s"] > 0 and res["sample_us"] > 0 and res["startup_s"] > res["open_s"]
    assert res["sampler_mb"] < 50
