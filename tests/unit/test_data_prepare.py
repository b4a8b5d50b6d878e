"""recover prepare: text -> train/val shards + meta.json, split by file, deterministic, skipped on re-run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from recover.cli import main
from recover.data.prepare import (
    STDLIB_EXCLUDED_DIRS,
    collect_files,
    prepare_builtin,
    prepare_files,
    split_files,
    stdlib_files,
)
from recover.data.shards import TokenDataset
from recover.data.tokenizer import ByteTokenizer, load_tokenizer
from recover.errors import DataError

EOT = 256


def make_corpus(root: Path, names: list[str]) -> dict[str, str]:
    """Write one small text file per name, in the given order (text depends on the name only)."""
    texts = {}
    for rel in names:
        text = f"# document {rel}\n" + f"a line of {rel}: héllo wörld\n" * (3 + sum(map(ord, rel)) % 5)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        texts[rel] = text
    return texts


NAMES = [
    f"{d}/file{i:02d}.{ext}"
    for i, (d, ext) in enumerate(zip("ab" * 12, ["txt", "md", "py"] * 8, strict=True))
]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "corpus"
    texts = make_corpus(root, NAMES)
    (root / "a" / "ignored.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (root / ".hidden.txt").write_text("hidden")  # hidden entries are skipped
    return root, texts


def documents(out: Path, split: str) -> list[str]:
    """The texts of a split's documents, decoded from its shards (each document starts with EOT)."""
    ds = TokenDataset.from_split(out, split)
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
    assert TokenDataset.from_split(out, "train").meta["request_sha256"] == meta["request_sha256"]


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
    assert TokenDataset.from_split(tmp_path / "o", "train").meta["format"] == "nanogpt"


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
