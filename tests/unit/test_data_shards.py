"""Token shards: both formats round-trip, auto-detection, and every bad file gives a useful DataError."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recover.data.layout import open_split
from recover.data.shards import (
    GPT2_MAGIC,
    HEADER_BYTES,
    LLAMA3_MAGIC,
    TokenDataset,
    detect_format,
    read_shard,
    write_shard,
)
from recover.errors import DataError

RNG = np.random.default_rng(0)


@pytest.mark.parametrize(
    ("fmt", "high", "dtype", "magic"),
    [
        ("llmc", 50_257, np.uint16, GPT2_MAGIC),
        ("llmc", 128_256, np.uint32, LLAMA3_MAGIC),
        ("nanogpt", 65_536, np.uint16, None),
    ],
)
def test_round_trip_and_auto_detection(
    tmp_path: Path, fmt: str, high: int, dtype: type, magic: int | None
) -> None:
    tokens = RNG.integers(0, high, size=3001)
    tokens[5] = high - 1  # the largest id must survive
    path = write_shard(tmp_path / "s.bin", tokens, fmt)
    for read_fmt in (fmt, "auto"):
        arr = read_shard(path, read_fmt)
        assert isinstance(arr, np.memmap) and not arr.flags.writeable
        assert arr.dtype == dtype
        np.testing.assert_array_equal(arr, tokens)
    assert detect_format(path) == fmt
    if magic is not None:
        header = np.fromfile(path, dtype="<i4", count=3)
        assert header.tolist() == [magic, 1 if magic == GPT2_MAGIC else 7, len(tokens)]
        assert path.stat().st_size == HEADER_BYTES + len(tokens) * np.dtype(dtype).itemsize
    else:
        assert path.stat().st_size == 2 * len(tokens)


def test_vocab_size_picks_the_wide_flavour_and_empty_shards_work(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "wide.bin", [1, 2, 3], "llmc", vocab_size=100_000)
    assert read_shard(path).dtype == np.uint32 and read_shard(path).tolist() == [1, 2, 3]
    empty = write_shard(tmp_path / "empty.bin", [], "llmc")
    assert len(read_shard(empty)) == 0


def test_nanogpt_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"65536.*fmt='llmc'"):
        write_shard(tmp_path / "big.bin", [1, 65_536], "nanogpt")
    assert not (tmp_path / "big.bin").exists()


@pytest.mark.parametrize(("cut", "kind"), [(-7 * 2, "truncated"), (4 * 2, "oversized")])
def test_llmc_size_disagreeing_with_header(tmp_path: Path, cut: int, kind: str) -> None:
    path = write_shard(tmp_path / "bad.bin", np.arange(100), "llmc")
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut < 0 else data + b"\0" * cut)
    held = 100 + cut // 2
    with pytest.raises(DataError) as err:
        read_shard(path)
    msg = str(err.value)
    assert str(path) in msg and kind in msg
    assert "header says 100 tokens" in msg and f"holds {held} tokens" in msg


def test_truncated_nanogpt_shard(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(np.arange(10, dtype="<u2").tobytes()[:-1])
    with pytest.raises(DataError) as err:
        read_shard(path, "nanogpt")
    assert (
        str(path) in str(err.value) and "truncated" in str(err.value) and "19 bytes is odd" in str(err.value)
    )


def test_unknown_magic_or_version_with_llmc(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "raw.bin", np.arange(2000), "nanogpt")
    with pytest.raises(DataError) as err:
        read_shard(path, "llmc")
    assert str(path) in str(err.value) and "unknown magic" in str(err.value)
    np.testing.assert_array_equal(read_shard(path), np.arange(2000))  # auto reads it as nanoGPT

    header = np.zeros(256, dtype="<i4")
    header[:3] = (GPT2_MAGIC, 3, 0)
    path.write_bytes(header.tobytes())
    with pytest.raises(DataError, match="unsupported llm.c version 3"):
        read_shard(path)


def test_token_out_of_vocab_names_file_id_and_position(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.arange(200), "llmc")
    bad = np.arange(50)
    bad[7] = 300
    write_shard(tmp_path / "b.bin", bad, "llmc")
    ds = TokenDataset(tmp_path)
    assert ds.max_token_id() == 300
    ds.check_vocab(301)  # fits
    with pytest.raises(DataError) as err:
        ds.check_vocab(257)
    msg = str(err.value)
    assert str(tmp_path / "b.bin") in msg and "token id 300 at position 7" in msg and "vocab_size 257" in msg
    assert "re-prepare with the model's tokenizer or raise model.vocab_size" in msg


def test_dataset_sources_and_meta(tmp_path: Path) -> None:
    for i in range(3):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.full(10 + i, i), "llmc")
    write_shard(tmp_path / "val_000000.bin", np.arange(5), "nanogpt")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 257}))

    whole = TokenDataset(tmp_path)
    assert [p.name for p in whole.paths] == [
        "train_000000.bin",
        "train_000001.bin",
        "train_000002.bin",
        "val_000000.bin",
    ]
    assert whole.num_tokens == 10 + 11 + 12 + 5 and whole.meta == {"vocab_size": 257}
    train = open_split(tmp_path, "train")
    assert len(train.paths) == 3 and train.num_tokens == 33 and train.max_token_id() == 2
    single = TokenDataset(tmp_path / "val_000000.bin")
    assert single.shard(0).tolist() == [0, 1, 2, 3, 4]

    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(DataError, match="nothing_"):
        TokenDataset(pattern)


def test_a_damaged_magic_or_a_cut_header_is_named_as_such_never_as_a_vocabulary_problem(tmp_path: Path) -> None:
    tokens = RNG.integers(0, 50_000, 5_000)
    bad = write_shard(tmp_path / "train_000001.bin", tokens)
    raw = bytearray(bad.read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")  # the magic alone is damaged
    bad.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"damaged llm.c header: magic 12345 .* \(version 1, 5000 tokens\)"):
        detect_format(bad)
    cut = tmp_path / "val_000000.bin"
    cut.write_bytes(write_shard(tmp_path / "whole.bin", tokens).read_bytes()[:100])  # cut to 100 bytes
    assert detect_format(cut) == "llmc"
    with pytest.raises(DataError, match="truncated llm.c shard: 100 bytes, shorter than the 1024-byte header"):
        TokenDataset(cut)
    nanogpt = write_shard(tmp_path / "raw.bin", tokens, fmt="nanogpt")  # raw tokens stay raw tokens
    assert detect_format(nanogpt) == "nanogpt"


def test_a_shard_cut_short_under_a_reader_is_a_data_error_naming_it_never_a_sigbus(tmp_path: Path) -> None:
    # issue 41: a training shard truncated under a running job killed every worker with SIGBUS (its memory map)
    path = tmp_path / "train_000.bin"
    write_shard(path, np.arange(50_000) % 300, fmt="llmc")
    ds = TokenDataset(path)
    assert ds.read(0, 40_000, 5).tolist() == [(40_000 + k) % 300 for k in range(5)]  # opened and read
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 10_000)  # the header and 10,000 tokens left
    assert ds.read(0, 9_000, 3).tolist() == [0, 1, 2]  # what is still there reads as before
    with pytest.raises(DataError, match=rf"^{path}: shard changed on disk during the run \(101024 bytes when opened, "
                                        r"now 21024\); the data must not change during a run: restore it"):
        ds.read(0, 40_000, 5)
    assert TokenDataset.__getstate__(ds)["_fds"] == {}  # pickles without its descriptors
