"""A start-up that does not grow with the data: launch checks headers and recorded ids (no token read),
TokenDataset opens shards lazily (bounded maps and file descriptors), and `recover prepare --verify`
reads every token once, in parallel, caching what it found per (size, mtime) of each shard."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest

import recover.data.verify as verify_mod
from recover.cli import main
from recover.config import DataConfig
from recover.data.layout import open_split
from recover.data.shards import HEADER_BYTES, TokenDataset, read_header, write_shard
from recover.data.verify import CACHE_NAME, check_data, load_cache, recorded_maxima, verify
from recover.errors import DataError

BAD_POS = 1234


def data_dir(root: Path, bad: bool = True, shards: int = 2) -> Path:
    """recover's layout: train shards of 3000 ids < 200 (the second with id 300 at BAD_POS), one val shard."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(shards):
        tokens = rng.integers(0, 200, 3000)
        if bad and i == 1:
            tokens[BAD_POS] = 300
            tokens[BAD_POS + 10] = 299
        write_shard(root / f"train_{i:06d}.bin", tokens, vocab_size=257)
    write_shard(root / "val_000000.bin", rng.integers(0, 200, 1000), vocab_size=257)
    return root


def cfg(root: Path) -> DataConfig:
    return DataConfig(path=str(root))


def test_launch_check_reads_no_token(tmp_path: Path) -> None:
    """Tokens beyond the vocabulary behind a good header pass check_data when nothing records them (so it
    cannot have read them), with one hint line; a recorded max id refuses them, naming where it comes from."""
    root = data_dir(tmp_path / "d")
    hints: list[str] = []
    train, val = check_data(cfg(root), root, 257, hint=hints.append)
    assert train.num_tokens == 6000 and val.num_tokens == 1000 and train.open_shards == 0  # nothing mapped
    assert len(hints) == 1 and "3 of 3 shard(s)" in hints[0] and f"recover prepare --verify {root}" in hints[0]

    meta = root / "meta.json"
    meta.write_text(json.dumps({"vocab_size": 257, "max_id": 300,
                                "train": {"shards": ["train_000000.bin", "train_000001.bin"]},
                                "val": {"shards": ["val_000000.bin"]}}))
    with pytest.raises(DataError) as err:
        check_data(cfg(root), root, 257)
    assert str(err.value).startswith(f"{meta}: token id 300 (the largest in the data") and "vocab_size 257" in str(
        err.value)
    check_data(cfg(root), root, 301, hint=hints.append)  # fits; nothing left unrecorded: no second hint
    assert len(hints) == 1

    info = {f"train_{i:06d}.bin": {"tokens": 3000, "max_id": m} for i, m in enumerate((199, 300))}
    meta.write_text(json.dumps({"vocab_size": 257, "shard_info": info}))
    with pytest.raises(DataError) as err:
        check_data(cfg(root), root, 257)
    line = str(err.value)
    assert str(root / "train_000001.bin") in line and "token id 300" in line and "shard_info" in line
    assert "re-prepare with the model's tokenizer or raise model.vocab_size" in line
    info["train_000000.bin"]["tokens"] = 2999  # a shard replaced after prepare: meta.json is not its record
    meta.write_text(json.dumps({"shard_info": info}))
    with pytest.raises(DataError, match=r"train_000000.bin: holds 3000 tokens but .*records 2999"):
        check_data(cfg(root), root, 400)


def test_launch_uses_a_matching_verify_cache_and_ignores_a_stale_one(tmp_path: Path) -> None:
    root = data_dir(tmp_path / "d")
    result = verify(root, progress=False, emit=lambda _: None)  # no vocabulary recorded: ids only recorded
    assert result.ok and result.max_id == 300 and result.vocab is None
    with pytest.raises(DataError) as err:
        check_data(cfg(root), root, 257)
    line = str(err.value)
    pos = BAD_POS  # the first occurrence of the largest id
    assert (f"{root / 'train_000001.bin'}: token id 300 at position {pos} (byte {HEADER_BYTES + 2 * pos})" in line
            and CACHE_NAME in line), line
    hints: list[str] = []
    check_data(cfg(root), root, 301, hint=hints.append)
    assert hints == []  # every shard recorded

    bad = root / "train_000001.bin"
    write_shard(bad, np.zeros(3000, dtype=np.int64), vocab_size=257)  # fixed (same size, new mtime)
    os.utime(bad, ns=(bad.stat().st_atime_ns, bad.stat().st_mtime_ns + 10**9))
    check_data(cfg(root), root, 257, hint=hints.append)  # the stale entry is not trusted
    assert len(hints) == 1 and "1 of 3 shard(s)" in hints[0]


def test_lazy_open_keeps_a_bounded_number_of_maps_and_fds(tmp_path: Path) -> None:
    for i in range(200):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(i, i + 20) % 65000, "llmc" if i % 2 else "nanogpt")
    def fds() -> int:  # this process's descriptors open on the shards (other tests' come and go)
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        return sum(link.startswith(str(tmp_path)) for link in links)

    before = fds()
    ds = TokenDataset(tmp_path, max_open=8)
    assert ds.open_shards == 0 and fds() == before == 0 and ds.lengths == [20] * 200 and ds.num_tokens == 4000
    order = np.random.default_rng(0).permutation(200).tolist() * 2
    for i in order:
        assert ds.shard(i).tolist() == list(range(i, i + 20))
        assert ds.open_shards <= 8
    assert fds() - before <= 8
    assert ds.shard(-1).tolist() == list(range(199, 219))
    with pytest.raises(IndexError):
        ds.shard(200)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.open_shards == 0 and copy.shard(5).tolist() == list(range(5, 25))
    (tmp_path / "train_000007.bin").write_bytes(b"\0" * 10)  # changed under a running dataset
    ds2 = TokenDataset(tmp_path, max_open=8)
    (tmp_path / "train_000009.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"train_000009.bin: shard changed on disk after it was opened"):
        ds2.shard(9)


def test_read_header_reads_only_the_header(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.bin", np.arange(100_000) % 50_000)
    h = read_header(path)
    assert (h.fmt, h.count, h.offset, h.size, h.dtype.itemsize) == ("llmc", 100_000, HEADER_BYTES,
                                                                     path.stat().st_size, 2)
    assert h.byte_offset(10) == HEADER_BYTES + 20
    raw = read_header(path, "nanogpt")  # the same bytes read as raw tokens: no header
    assert raw.fmt == "nanogpt" and raw.offset == 0 and raw.count == path.stat().st_size // 2
    with pytest.raises(DataError, match="no such shard file"):
        read_header(tmp_path / "missing.bin")


def test_out_of_range_names_file_position_byte_id_and_fix(tmp_path: Path) -> None:
    root = data_dir(tmp_path / "d")
    ds = open_split(root, "train")
    exc = ds.out_of_range(1, BAD_POS, 300, 257)
    assert isinstance(exc, DataError)
    line = str(exc)
    assert line.startswith(f"{root / 'train_000001.bin'}: token id 300 at position {BAD_POS} "
                           f"(byte {HEADER_BYTES + 2 * BAD_POS}) is out of range for vocab_size 257")
    assert "re-prepare with the model's tokenizer or raise model.vocab_size" in line


@pytest.mark.parametrize("workers", [1, 4])
def test_verify_finds_a_bad_id_with_its_file_and_offset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], workers: int) -> None:
    monkeypatch.setattr(verify_mod, "CHUNK_BYTES", 512)  # many chunks per shard
    root = data_dir(tmp_path / "d")
    lines: list[str] = []
    result = verify(root, 257, workers=workers, progress=False, emit=lines.append)
    assert not result.ok and result.max_id == 300 and len(lines) == 1 and result.problems == lines
    bad = root / "train_000001.bin"
    assert lines[0].startswith(f"{bad}: token id 300 at position {BAD_POS} (byte {HEADER_BYTES + 2 * BAD_POS}) is "
                               "out of range for vocab_size 257 (--vocab-size); 2 such id(s) in this shard, the "
                               "largest 300"), lines[0]
    assert result.tokens == 7000 and result.shards == 3 and result.reused == 0
    entries = load_cache(root)
    assert entries["train_000001.bin"]["max_id"] == 300 and entries["train_000001.bin"]["max_pos"] == BAD_POS
    assert entries["train_000000.bin"]["max_id"] == int(TokenDataset(root / "train_000000.bin").max_token_id())

    assert main(["prepare", "--verify", str(root), "--quiet", "--vocab-size", "257"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0] == lines[0] and "1 problem(s)" in out[1] and "3 shard(s)" in out[1]
    assert main(["prepare", "--verify", str(root), "--quiet", "--vocab-size", "301"]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    (root / "meta.json").write_text(json.dumps({"vocab_size": 257}))  # default: the data's recorded vocabulary
    assert main(["prepare", "--verify", str(root), "--quiet"]) == 1
    assert "vocab_size 257 (" in capsys.readouterr().out
    assert main(["prepare", "--verify", str(root), "--out", str(tmp_path / "o")]) == 2
    assert "takes no inputs" in capsys.readouterr().err


def test_verify_cache_reuse_and_invalidation(tmp_path: Path) -> None:
    root = data_dir(tmp_path / "d", bad=False, shards=3)
    quiet = dict(progress=False, emit=lambda _: None)
    first = verify(root, 257, **quiet)
    assert first.ok and first.reused == 0 and first.bytes_scanned == first.bytes_total
    again = verify(root, 257, **quiet)
    assert again.ok and again.reused == 4 and again.bytes_scanned == 0 and again.max_id == first.max_id

    touched = root / "train_000001.bin"  # same bytes, new mtime: read again
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    third = verify(root, 257, **quiet)
    assert third.reused == 3 and third.bytes_scanned == st.st_size

    grown = np.concatenate([np.fromfile(root / "train_000002.bin", dtype="<u2")[HEADER_BYTES // 2:], [256]])
    write_shard(root / "train_000002.bin", grown, vocab_size=257)  # new size (and a larger id)
    fourth = verify(root, 257, **quiet)
    assert fourth.reused == 3 and fourth.ok and fourth.max_id == 256
    assert load_cache(root)["train_000002.bin"]["tokens"] == 3001
    ds = open_split(root, "train")
    assert [r.max_id for r in recorded_maxima(ds)] == [int(ds.shard(i).max()) for i in range(3)]

    (root / "train_000000.bin").write_bytes(b"\1\2\3")  # now a damaged shard: reported, dropped from the cache
    fifth = verify(root, 257, **quiet)
    assert len(fifth.problems) == 1 and "train_000000.bin" in fifth.problems[0] and "train_000000.bin" not in \
        load_cache(root)


def test_verify_in_a_read_only_directory_warns_and_still_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root = data_dir(tmp_path / "d", bad=False)
    mode = root.stat().st_mode
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(root, os.W_OK):  # root ignores the mode: make the write fail as a read-only mount would
            def refuse(*_: object) -> None:
                raise PermissionError(30, "Read-only file system")

            monkeypatch.setattr(os, "replace", refuse)
        result = verify(root, 257, progress=False, emit=lambda _: None)
        assert result.ok and result.cache_warning and "could not record the result" in result.cache_warning
        assert "warning: could not record" in capsys.readouterr().err
        monkeypatch.undo()
        assert not (root / CACHE_NAME).exists() and sorted(p.name for p in root.iterdir() if p.name[0] == ".") == []
        assert main(["prepare", "--verify", str(root), "--quiet", "--vocab-size", "257"]) == 0
    finally:
        root.chmod(mode)


def test_verify_names_a_checksum_mismatch(tmp_path: Path) -> None:
    root = data_dir(tmp_path / "d", bad=False)
    names = ["train_000000.bin", "train_000001.bin", "val_000000.bin"]
    info = {}
    for name in names:
        ds = TokenDataset(root / name)
        info[name] = {"tokens": ds.num_tokens, "max_id": ds.max_token_id(),
                      "blake2b": hashlib.blake2b((root / name).read_bytes(), digest_size=32).hexdigest()}
    (root / "meta.json").write_text(json.dumps({"vocab_size": 257, "shard_info": info}))
    quiet = dict(progress=False, emit=lambda _: None)
    assert verify(root, **quiet).ok
    assert verify(root, **quiet).reused == 3  # the digests are cached too

    path = root / "train_000001.bin"
    raw = bytearray(path.read_bytes())
    old = int(np.frombuffer(raw[HEADER_BYTES + 2 * 500:HEADER_BYTES + 2 * 501], dtype="<u2")[0])
    raw[HEADER_BYTES + 2 * 500:HEADER_BYTES + 2 * 501] = np.array([(old + 1) % 150], dtype="<u2").tobytes()
    path.write_bytes(bytes(raw))  # one id flipped, still in range: only the checksum can tell
    result = verify(root, **quiet)
    assert len(result.problems) == 1 and result.reused == 2
    assert result.problems[0].startswith(f"{path}: checksum mismatch: blake2b ") and info["train_000001.bin"][
        "blake2b"] in result.problems[0] and "re-create it with `recover prepare`" in result.problems[0]
    assert len(verify(root, **quiet).problems) == 1  # still reported from the cache


def test_file_names_match_path_glob_with_one_listing(tmp_path: Path) -> None:
    from recover.data.shards import file_names, one_listing

    for name in ("b_train_1.bin", "a_train_2.bin", ".hidden_train.bin", "train_x.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "dir_train_.bin").mkdir()  # a directory is never a shard
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c_train_3.bin").write_bytes(b"")
    for pattern in ("*_train*.bin", ".*", "sub/*.bin", "*.txt", "nothing*"):
        want = sorted(p for p in glob.glob(pattern, root_dir=tmp_path) if (tmp_path / p).is_file())
        assert file_names(tmp_path, pattern) == want, pattern
    with one_listing():
        assert file_names(tmp_path, "*.bin") == ["a_train_2.bin", "b_train_1.bin"]
        (tmp_path / "z.bin").write_bytes(b"")
        assert file_names(tmp_path, "*.bin") == ["a_train_2.bin", "b_train_1.bin"]  # one listing per check
    assert file_names(tmp_path, "*.bin") == ["a_train_2.bin", "b_train_1.bin", "z.bin"]
