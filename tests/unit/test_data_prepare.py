"""recover prepare: text -> train/val shards + meta.json, split by file, deterministic, skipped on re-run."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from recover.cli import main
from recover.data import prepare
from recover.data.layout import open_split
from recover.data.prepare import (
    STDLIB_EXCLUDED_DIRS,
    collect_files,
    prepare_builtin,
    prepare_files,
    split_files,
    stdlib_files,
)
from recover.data.shards import read_shard
from recover.data.tokenizer import ByteTokenizer, load_tokenizer
from recover.errors import DataError
from text_corpus import NAMES, big_text, corpus, make_corpus, shard_files, write_jsonl

__all__ = ["corpus"]  # the fixture, shared with tests/dist/test_data_prepare_workers.py

EOT = 256


def documents(out: Path, split: str) -> list[str]:
    """The texts of a split's documents, decoded from its shards (each document starts with EOT)."""
    ds = open_split(out, split)
    tokens = np.concatenate([ds.shard(i) for i in range(len(ds.paths))]).astype(np.int64)
    starts = np.flatnonzero(tokens == EOT).tolist() + [len(tokens)]
    return [ByteTokenizer().decode(tokens[a + 1 : b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def test_prepare_writes_shards_and_meta_split_by_file(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    root, texts = corpus
    out = tmp_path / "out"
    meta = prepare_files([root], out, quiet=True, val_fraction=0.2)
    assert meta["skipped"] is False and json.loads((out / "meta.json").read_text())["content_sha256"]
    assert meta["train"]["files"] + meta["val"]["files"] == len(NAMES)
    assert meta["train"]["files"] >= 1 and meta["val"]["files"] >= 1
    total_bytes = sum(len(t.encode()) for t in texts.values())
    assert meta["train"]["tokens"] + meta["val"]["tokens"] == total_bytes + len(NAMES)  # + one EOT each
    assert (meta["vocab_size"], meta["eot_id"], meta["format"]) == (257, EOT, "llmc")

    pieces = collect_files([root])
    assert sorted(p.rel for p in pieces) == sorted(NAMES)  # hidden and non-text files skipped
    val_rels = [p.rel for p in split_files(pieces, 0.2)["val"]]
    assert sorted(documents(out, "val")) == sorted(texts[r] for r in val_rels)
    assert sorted(documents(out, "train")) == sorted(texts[r] for r in NAMES if r not in val_rels)
    assert open_split(out, "train").meta["request_sha256"] == meta["request_sha256"]


def test_split_is_stable_under_file_order_and_renaming(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    root, texts = corpus
    first = prepare_files([root], tmp_path / "out1", quiet=True, val_fraction=0.3)
    again = tmp_path / "again"  # the same files created in reverse order elsewhere
    make_corpus(again, list(reversed(NAMES)))
    second = prepare_files([again], tmp_path / "out2", quiet=True, val_fraction=0.3)
    assert second["content_sha256"] == first["content_sha256"]
    for name in ("train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()

    val_before = set(documents(tmp_path / "out1", "val"))
    moved = NAMES[0]
    shutil.move(again / moved, again / "a" / "renamed.txt")  # renaming one file moves only that file
    prepare_files([again], tmp_path / "out3", quiet=True, val_fraction=0.3)
    val_after = set(documents(tmp_path / "out3", "val"))
    assert val_before - {texts[moved]} == val_after - {texts[moved]}


def test_rerun_skips_and_a_change_redoes(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    root, _ = corpus
    out = tmp_path / "out"
    prepare_files([root], out, quiet=True, shard_tokens=500)
    assert len(list(out.glob("train_*.bin"))) > 3
    stamp = (out / "train_000000.bin").stat().st_mtime_ns
    again = prepare_files([root], out, quiet=True, shard_tokens=500)
    assert again["skipped"] is True and (out / "train_000000.bin").stat().st_mtime_ns == stamp

    (root / NAMES[1]).write_text("changed, and longer than before " * 20)
    redone = prepare_files([root], out, quiet=True)  # also a new shard size: old shards must go
    assert redone["skipped"] is False and redone["content_sha256"] != again["content_sha256"]
    assert sorted(p.name for p in out.glob("*.bin")) == ["train_000000.bin", "val_000000.bin"]


def test_single_file_nanogpt_and_budget(tmp_path: Path) -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    (tmp_path / "input.txt").write_text(text)
    meta = prepare_files([tmp_path / "input.txt"], tmp_path / "out", fmt="nanogpt", quiet=True)
    assert meta["split"] == "single-file-tail" and meta["format"] == "nanogpt"
    train, val = documents(tmp_path / "out", "train"), documents(tmp_path / "out", "val")
    assert train[0] + val[0] == text and val[0].startswith("line ") and 0 < len(val[0]) < len(text) * 0.1

    budget = prepare_files([tmp_path / "input.txt"], tmp_path / "small", max_bytes=1000, quiet=True)
    assert budget["train"]["bytes"] + budget["val"]["bytes"] == 1000


def test_builtin_stdlib_offline(tmp_path: Path) -> None:
    meta = prepare_builtin("stdlib", tmp_path / "std", max_bytes=2_000_000, quiet=True)
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == 2_000_000
    assert meta["train"]["tokens"] > 1_000_000 and meta["val"]["tokens"] > 0 and meta["val"]["files"] >= 1
    assert meta["source"].startswith("builtin:stdlib")
    pieces, _ = stdlib_files()
    assert all(
        p.rel.endswith(".py") and not STDLIB_EXCLUDED_DIRS & set(p.rel.split("/")[:-1]) for p in pieces
    )
    assert any(p.rel == "json/decoder.py" for p in pieces)
    with pytest.raises(DataError, match="unknown builtin corpus"):
        prepare_builtin("wikipedia", tmp_path / "x")


def test_tokenizers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_tokenizer("byte")
    ids = tok.encode("héllo\n")
    assert ids.tolist() == list("héllo\n".encode()) and tok.decode([*ids, EOT]) == "héllo\n"
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the optional package were missing
    with pytest.raises(DataError, match=r"pip install 'recover-llm\[hf\]'"):
        load_tokenizer(str(tmp_path))


def test_cli(tmp_path: Path, corpus: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", "--out", str(tmp_path / "o")]) == 2
    assert "neither inputs nor --builtin" in capsys.readouterr().err
    assert main(["prepare", str(corpus[0]), "--builtin", "stdlib", "--out", str(tmp_path / "o")]) == 2
    assert "both inputs and --builtin" in capsys.readouterr().err
    assert (
        main(["prepare", str(corpus[0]), "--out", str(tmp_path / "o"), "--quiet", "--format", "nanogpt"]) == 0
    )
    out = capsys.readouterr().out
    assert "train tokens" in out and "val tokens" in out and str(tmp_path / "o") in out
    assert open_split(tmp_path / "o", "train").meta["format"] == "nanogpt"


def test_split_guarantees_one_file_each_and_skips_its_own_output(tmp_path: Path) -> None:
    make_corpus(tmp_path, ["x.txt", "y.txt", "z.txt"])
    pieces = collect_files([tmp_path])
    for fraction in (1e-9, 1 - 1e-9):
        splits = split_files(pieces, fraction)
        assert len(splits["train"]) >= 1 and len(splits["val"]) >= 1
        assert sorted(p.rel for p in splits["train"] + splits["val"]) == ["x.txt", "y.txt", "z.txt"]
    meta = prepare_files([tmp_path], tmp_path / "out", quiet=True)  # output inside the input directory
    again = prepare_files([tmp_path], tmp_path / "out", quiet=True)  # its meta.json is not an input
    assert meta["train"]["files"] + meta["val"]["files"] == 3 and again["skipped"] is True


# ---------------------------------------------------------------- all cores, JSONL, Parquet, resume, meta


def test_jsonl_one_document_per_line(tmp_path: Path) -> None:
    texts = []
    for i in range(6):
        rows = [{"text": f"file {i} row {j}\nsecond line", "id": j} for j in range(5)] + [{"text": ""}, "\n"]
        texts += write_jsonl(tmp_path / "data" / f"part{i}.jsonl", rows)
    meta = prepare_files([tmp_path / "data"], tmp_path / "out", quiet=True, val_fraction=0.3)
    assert meta["field"] == "text" and meta["split"] == "by-file" and meta["val"]["files"] >= 1
    got = documents(tmp_path / "out", "train") + documents(tmp_path / "out", "val")
    assert sorted(got) == sorted(texts)  # empty rows and blank lines are skipped
    assert meta["train"]["documents"] + meta["val"]["documents"] == 30
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == sum(len(t.encode()) for t in texts)

    single = tmp_path / "one.jsonl"  # one file: split by rows, the last ones go to val
    rows = write_jsonl(single, [{"body": f"document {j}"} for j in range(40)])
    meta = prepare_files([single], tmp_path / "single", quiet=True, val_fraction=0.1, field="body")
    assert meta["split"] == "single-file-tail" and meta["field"] == "body" and rows == []
    assert documents(tmp_path / "single", "val") == [f"document {j}" for j in range(36, 40)]
    assert documents(tmp_path / "single", "train") == [f"document {j}" for j in range(36)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"txt": "x"}, r"bad\.jsonl, line 3: has no field 'text'; pass --field NAME"),
        ({"text": 7}, r"bad\.jsonl, line 3: field 'text' is a number, not a string"),
        ("[1, 2]\n", r"bad\.jsonl, line 3: is not a JSON object"),
        ("{oops\n", r"bad\.jsonl, line 3: not valid JSON"),
    ],
)
def test_jsonl_bad_row_is_named(tmp_path: Path, line: object, message: str) -> None:
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}, line, {"text": "c"}])
    with pytest.raises(DataError, match=message):
        prepare_files([tmp_path / "bad.jsonl"], tmp_path / "out", quiet=True)


def test_parquet_one_document_per_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pa = pytest.importorskip("pyarrow", reason="Parquet inputs need the optional pyarrow (recover-llm[parquet])")
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "wörds " * (i % 5) for i in range(300)]
    pq.write_table(pa.table({"id": list(range(300)), "content": texts}), tmp_path / "train.parquet",
                   row_group_size=64)
    monkeypatch.setattr(prepare, "TASK_BYTES", 1000)  # several tasks per row group
    meta = prepare_files([tmp_path / "train.parquet"], tmp_path / "out", quiet=True, column="content", workers=1)
    assert meta["split"] == "single-file-tail" and meta["column"] == "content"
    assert documents(tmp_path / "out", "train") == texts[:285] and documents(tmp_path / "out", "val") == texts[285:]
    two = prepare_files([tmp_path / "train.parquet"], tmp_path / "two", quiet=True, column="content", workers=2)
    assert two["content_sha256"] == meta["content_sha256"]
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "two")

    budget = prepare_files([tmp_path / "train.parquet"], tmp_path / "b", quiet=True, column="content",
                           max_bytes=(tmp_path / "train.parquet").stat().st_size // 3)
    assert 80 < budget["train"]["documents"] + budget["val"]["documents"] < 120  # a third of the rows

    with pytest.raises(DataError, match=r"train\.parquet: no column 'text' \(it has id, content\); pass --column"):
        prepare_files([tmp_path / "train.parquet"], tmp_path / "x", quiet=True)
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls\.parquet, row 2: column 'text' is null"):
        prepare_files([tmp_path / "nulls.parquet"], tmp_path / "x", quiet=True)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data.parquet").write_bytes(b"PAR1 not really")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the optional package were missing
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"data\.parquet: reading Parquet needs .*pip install 'recover-llm\[parquet\]'"):
        prepare_files([tmp_path], tmp_path / "out", quiet=True)


def test_resume_after_a_crash_keeps_complete_shards(
    tmp_path: Path, corpus: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    (root / "big.txt").write_text(big_text(1000))
    monkeypatch.setattr(prepare, "TASK_BYTES", 2048)
    monkeypatch.setattr(prepare, "PIECE_BYTES", 4096)
    calls, tokenize = [], prepare._tokenize
    monkeypatch.setattr(prepare, "_tokenize", lambda *a: calls.append(1) or tokenize(*a))
    clean = prepare_files([root], tmp_path / "clean", quiet=True, workers=1, shard_tokens=1000)
    clean_calls, out = len(calls), tmp_path / "out"

    saves, save = [], prepare._save_journal

    def crash_after_five(out_dir: Path, journal: dict) -> None:
        save(out_dir, journal)
        saves.append(1)
        if len(saves) == 5:
            raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(prepare, "_save_journal", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        prepare_files([root], out, quiet=True, workers=1, shard_tokens=1000)
    monkeypatch.setattr(prepare, "_save_journal", save)
    assert not (out / "meta.json").exists()
    journal = json.loads((out / prepare.JOURNAL_NAME).read_text())
    kept = {p.name: p.stat().st_ino for p in out.glob("*.bin")}
    assert sorted(kept) == [name for split in ("train", "val") for name, _ in journal["shards"][split]]
    assert len(kept) >= 4  # the first save is the empty journal

    calls.clear()
    meta = prepare_files([root], out, quiet=True, workers=1, shard_tokens=1000)
    assert meta["resumed_shards"] == len(kept) and not (out / prepare.JOURNAL_NAME).exists()
    assert journal["resume"]["task"] > 2 and len(calls) == clean_calls - journal["resume"]["task"]  # not redone
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # nor rewritten
    assert shard_files(out) == shard_files(tmp_path / "clean")
    assert {**meta, "resumed_shards": 0} == clean

    monkeypatch.setattr(prepare, "_save_journal", crash_after_five)  # another request starts over
    saves.clear()
    with pytest.raises(KeyboardInterrupt):
        prepare_files([root], out, quiet=True, workers=1, shard_tokens=1000, val_fraction=0.3)
    monkeypatch.setattr(prepare, "_save_journal", save)
    again = prepare_files([root], out, quiet=True, workers=1, shard_tokens=2500)
    assert again["resumed_shards"] == 0 and again["train"]["tokens"] + again["val"]["tokens"] == (
        clean["train"]["tokens"] + clean["val"]["tokens"])


def test_meta_records_max_id_and_checksums_per_shard(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    root, _ = corpus
    meta = prepare_files([root], tmp_path / "out", quiet=True, shard_tokens=700)
    assert meta["max_id"] == 256 and set(meta["shard_info"]) == set(meta["train"]["shards"] + meta["val"]["shards"])
    check_shard_info(tmp_path / "out")
    nano = prepare_files([root], tmp_path / "nano", quiet=True, fmt="nanogpt")
    assert set(nano["shard_info"]) == {"train.bin", "val.bin"}
    check_shard_info(tmp_path / "nano")


def check_shard_info(out: Path) -> None:
    """meta.json's max_id and shard_info agree with the shards (recomputed from the files)."""
    meta = json.loads((out / "meta.json").read_text())
    maxima = []
    for name, info in meta["shard_info"].items():
        tokens = np.asarray(read_shard(out / name))
        assert info["tokens"] == len(tokens) and info["max_id"] == int(tokens.max())
        assert info["blake2b"] == hashlib.blake2b((out / name).read_bytes(), digest_size=32).hexdigest()
        assert info["blake2b"] == prepare.file_blake2b(out / name)
        maxima.append(info["max_id"])
    for split in ("train", "val"):
        assert meta[split]["max_id"] == max(meta["shard_info"][n]["max_id"] for n in meta[split]["shards"])
    assert meta["max_id"] == max(maxima)


def test_meta_checksums_after_uint32_rewrite(tmp_path: Path) -> None:
    """A tokenizer with ids past 65,535: shards that fit uint16 are rewritten as uint32, checksums follow."""
    tokenizers = pytest.importorskip("tokenizers", reason="needs the optional tokenizers package")
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data").mkdir()
    for i in range(8):  # a few files with small ids only, one with large ones
        (tmp_path / "data" / f"f{i}.txt").write_text(" ".join(f"w{j + (69_000 if i == 3 else 0)}" for j in range(50)))
    meta = prepare_files([tmp_path / "data"], tmp_path / "out", tokenizer=str(tmp_path / "tokenizer.json"),
                         quiet=True, shard_tokens=40)
    assert meta["max_id"] == 70_000 and meta["eot_id"] == 70_000
    assert {read_shard(tmp_path / "out" / n).dtype for n in meta["shard_info"]} == {np.dtype("<u4")}
    check_shard_info(tmp_path / "out")


def test_progress_and_quiet(tmp_path: Path, corpus: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = corpus
    prepare_files([root], tmp_path / "quiet", quiet=True)
    assert capsys.readouterr() == ("", "")
    prepare_files([root], tmp_path / "loud")
    shown = capsys.readouterr()
    assert "tokenising" in shown.out + shown.err and "tokens/s" in shown.out + shown.err
    assert main(["prepare", str(root), "--out", str(tmp_path / "cli"), "--quiet", "--workers", "1",
                 "--field", "body", "--column", "content"]) == 0
    assert "Prepared" in capsys.readouterr().out
    assert main(["prepare", str(root), "--out", str(tmp_path / "cli"), "--workers", "0"]) == 2
    assert "--workers 0 is not allowed" in capsys.readouterr().err
